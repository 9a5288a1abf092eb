// One KDA + MoE decoder layer at T=1 as one persistent, warp-specialised kernel (issue 35).
//
// The task tables, counters and epoch scheme are lingls/kernels/persistent.py's (`build_schedule(...,
// norm_tasks=False, local_route=True)`, proven by `check_schedule` and `check_loader`); this file is the runner
// that executes them. One CTA per SM:
//
//   warp 8 (the loader): walks the CTA's task list and, for every task that streams bytes (a GEMV tile's rows,
//     the experts' rows, a KDA head's recurrent state), takes the next free stage of a shared-memory ring
//     ("empty" mbarrier) and issues 1-D bulk async copies that complete on the stage's "full" mbarrier. It runs
//     ahead of the consumers across task boundaries and never waits for a task's inputs. Where the weights'
//     address depends on the routing (the routed experts' gate-up and down rows) it waits for this CTA's own
//     routing (the "routed" mbarrier), then issues every routed copy of its list at once. After a KDA task's
//     state it waits for that task to end (the "quiet" mbarrier), so no copy queues ahead of the recurrence's
//     own loads on the way back to the SM.
//   warps 0-7 (the consumers): per task, wait for the stage's bytes, wait for the task's input counters (one
//     thread's acquire polls, then a named barrier), build the small input vector in shared memory (the
//     RMSNorms are recomputed here from the residual stream: no norm task, no hop), multiply from shared
//     memory (a warp per row, 16-byte loads), store, release the stage, and bump the task's counter with a
//     release. At the CTA's first routed task they first route for themselves from the router's logits (the
//     grouped top-k of the chain's routing), into shared memory, and hand the choice to the loader: no ROUTE
//     task, no hop.
//
// Counters are never reset: launch g waits for need * g; g comes from the epoch cell that the last CTA of the
// previous launch advanced. Data other CTAs wrote in this launch is read with ld.global.cg (L2), never L1.

#include <cuda_runtime.h>
#include <stdint.h>

namespace lingls_persistent {

enum Kind { NONE = 0, PROJ, KDA, OPROJ, ROUTER, SHARED_GU, ROUTE, EXPERT_GU, DOWN, NORM };  // no ROUTE, NORM here
constexpr int FIELDS = 8;
constexpr int CONSUMERS = 256;  // threads of warps 0-7
constexpr int LOADER = CONSUMERS;  // warp 8's lane 0
constexpr int SIGNALLER = CONSUMERS + 32;  // warp 9's lane 0
constexpr int THREADS = CONSUMERS + 64;
constexpr int RED = 8 * 32;  // floats of the GEMV's cross-warp partials, then 32 row sums, then 8 for block_sum
constexpr int RED_FLOATS = RED + 32 + 8;

typedef uint16_t bf16;

struct Params {
  const int* tasks;
  int* cnt;
  long long* stamps;
  const bf16* h;
  bf16* out;
  const bf16* in_norm;
  const bf16* proj;
  const bf16* conv_w;
  const float* a_log;
  const float* dt_bias;
  const bf16* o_norm;
  const bf16* o_proj;
  const bf16* post_norm;
  const bf16* router;
  const float* expert_bias;
  const bf16* gate_up;
  const bf16* down;
  const bf16* sgu;
  const bf16* sdn;
  float* state;
  bf16* conv;
  bf16* p;
  bf16* o;
  bf16* a;
  float* logits;
  float* topk_w;
  int* topk_i;
  bf16* act;
  float eps, q_scale, lower_bound, scale, limit, shared_limit;
  int H, NH, D, E, I, I_S, I_PAD, TOP_K, G, TOPK_GROUP;
  int proj_rows, oproj_rows, router_rows, gu_rows, down_rows;
  int max_tasks, programs, epoch, done, router_counter, router_need;
  int stages, stage_bytes, scratch_floats, timeline;
  int inflight;  // stages the loader keeps in flight (copies issued, not yet landed); the rest of the ring waits
  int free_kinds;  // bit k: tasks of kind k take ring stages without that limit (every stage of the ring)
  int kda_quiet;  // the loader waits for a KDA task to end before any later copy
};

// ---- small device helpers -------------------------------------------------------------------------------

__device__ __forceinline__ float bf2f(bf16 v) { return __uint_as_float(uint32_t(v) << 16); }

__device__ __forceinline__ bf16 f2bf(float f) {  // round to nearest even (NaN kept quiet)
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16(u >> 16);
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + __expf(-x)); }

__device__ __forceinline__ bf16 ldcg_bf(const bf16* p) {
  unsigned short v;
  asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float ldcg_f(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ int ldcg_i(const int* p) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ldcg_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_relaxed(int* p, int v) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_cta(int* p, int v) {
  asm volatile("st.release.cta.shared::cta.s32 [%0], %1;" ::"r"(uint32_t(__cvta_generic_to_shared(p))), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire_cta(const int* p) {
  int v;
  asm volatile("ld.acquire.cta.shared::cta.s32 %0, [%1];" : "=r"(v) : "r"(uint32_t(__cvta_generic_to_shared(p))) : "memory");
  return v;
}
__device__ __forceinline__ int atom_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ void wait_counter(const int* cnt, int c, int need, int gen) {
  if (c < 0) return;
  const int target = need * gen;
  while (ld_acquire(cnt + c) < target) {
  }
}
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }
__device__ __forceinline__ long long globaltimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t ok = 0;
  while (!ok) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
// shared -> global, asynchronous: no generic store of the issuing thread waits for it (nor does a fence)
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(src)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// fp32 sum over the consumer threads, the same value in all of them; `red` holds 8 floats (reused after)
__device__ float block_sum(float v, float* red) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
  for (int off = 16; off; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (lane == 0) red[warp] = v;
  consumer_sync();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < 8; ++w) s += red[w];
  consumer_sync();
  return s;
}

// the shared-memory layout, from the parameters (the host computes the same in persistent_cuda.smem_plan)
struct Smem {
  unsigned char* ring;
  bf16* xs;  // the GEMV input vector, max(H, NH * D) bf16
  float* red;
  float* scratch;
  float* acts;  // the DOWN tasks' activations: [1 + TOP_K][max(I, I_S)] fp32, the routed ones times their weight
  int* tasks;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* routed;  // the consumers have routed (misc holds the choice); the loader's routed copies wait here
  uint64_t* quiet;  // the consumers ended a KDA task (one phase per KDA task of the list)
  int* misc;  // [0]: the generation; [1, 1 + TOP_K): the chosen experts; then their weights (fp32); TOP_K <= 16
  int* ended;  // tasks of the list the consumers have ended (the signaller releases their counters)
};

__device__ Smem carve(unsigned char* base, const Params& P) {
  Smem s;
  size_t off = 0;
  s.ring = base;
  off += size_t(P.stages) * P.stage_bytes;
  s.xs = reinterpret_cast<bf16*>(base + off);
  const int xn = P.H > P.NH * P.D ? P.H : P.NH * P.D;
  off += ((size_t(xn) * 2 + 15) / 16) * 16;
  s.red = reinterpret_cast<float*>(base + off);
  off += RED_FLOATS * 4;
  s.scratch = reinterpret_cast<float*>(base + off);
  off += ((size_t(P.scratch_floats) * 4 + 15) / 16) * 16;
  s.acts = reinterpret_cast<float*>(base + off);
  off += ((size_t(1 + P.TOP_K) * (P.I > P.I_S ? P.I : P.I_S) * 4 + 15) / 16) * 16;
  s.tasks = reinterpret_cast<int*>(base + off);
  off += ((size_t(P.max_tasks) * FIELDS * 4 + 15) / 16) * 16;
  s.full = reinterpret_cast<uint64_t*>(base + off);
  s.empty = s.full + P.stages;
  s.routed = s.empty + P.stages;
  s.quiet = s.routed + 1;
  off += size_t(P.stages) * 16 + 16;
  s.misc = reinterpret_cast<int*>(base + off);
  s.ended = s.misc + 1 + 2 * 16;
  return s;
}

// how many ring stages a task's bytes take (the loader and the consumers walk the same lists)
__device__ __forceinline__ int stages_of(int kind) {
  switch (kind) {
    case PROJ: case OPROJ: case ROUTER: case SHARED_GU: case EXPERT_GU: case DOWN: return 1;
    case KDA: return 2;  // the head's [D, D] fp32 state, rows 0..D/2 and D/2..D
    default: return 0;
  }
}

// ---- the loader -----------------------------------------------------------------------------------------

__device__ void loader(const Params& P, const Smem& s) {
  bool after_previous = false;  // past griddepcontrol.wait: everything before this launch is visible
  bool routed = false;  // this CTA's routing is in s.misc
  int stage = 0;
  uint32_t phase = 0;
  int issued = 0;  // stages armed so far
  int kda_done = 0;  // KDA tasks of the list the consumers have ended (the quiet fence)
  const int H = P.H, C = P.NH * P.D;
  const int* chosen = s.misc + 1;
  // the next free stage, armed for `bytes`. Unless the task's kind streams freely, first the stage armed
  // `inflight` stages ago must have landed: bytes in flight queue on the SM's way back from memory, ahead of
  // every load its consumers make (inputs, polls), so where the consumers' hops are on the critical path the
  // loader keeps only what the bandwidth needs in flight and lets the ring fill behind it
  auto next = [&](int kind, uint32_t bytes) -> unsigned char* {
    if (!((P.free_kinds >> kind) & 1) && issued >= P.inflight) {
      const int k = issued - P.inflight;
      mbar_wait(&s.full[k % P.stages], uint32_t(k / P.stages) & 1);
    }
    ++issued;
    mbar_wait(&s.empty[stage], phase ^ 1);
    mbar_expect_tx(&s.full[stage], bytes);
    return s.ring + size_t(stage) * P.stage_bytes;
  };
  auto advance = [&]() {
    if (++stage == P.stages) { stage = 0; phase ^= 1; }
  };
  auto route_wait = [&]() {  // this CTA's own routing, once (its consumers route at their first routed task)
    if (!routed) {
      mbar_wait(s.routed, 0);
      routed = true;
    }
  };
  for (int i = 0; i < P.max_tasks; ++i) {
    const int* row = s.tasks + i * FIELDS;
    const int kind = row[0], tile = row[1];
    switch (kind) {
      case PROJ: {  // the last tile may hold fewer rows
        const int n = 5 * C + P.NH - tile * P.proj_rows;
        const uint32_t b = uint32_t(n < P.proj_rows ? n : P.proj_rows) * H * 2;
        uint64_t* bar = &s.full[stage];
        bulk_copy(next(kind, b), P.proj + size_t(tile) * P.proj_rows * H, b, bar);
        advance();
        break;
      }
      case OPROJ: {
        const uint32_t b = uint32_t(P.oproj_rows) * C * 2;
        uint64_t* bar = &s.full[stage];
        bulk_copy(next(kind, b), P.o_proj + size_t(tile) * P.oproj_rows * C, b, bar);
        advance();
        break;
      }
      case ROUTER: {
        const uint32_t b = uint32_t(P.router_rows) * H * 2;
        uint64_t* bar = &s.full[stage];
        bulk_copy(next(kind, b), P.router + size_t(tile) * P.router_rows * H, b, bar);
        advance();
        break;
      }
      case SHARED_GU:
      case EXPERT_GU: {
        const uint32_t b = uint32_t(P.gu_rows) * H * 2;
        const bf16* base;
        int inter, r0;
        if (kind == SHARED_GU) {
          base = P.sgu;
          inter = P.I_S;
          r0 = tile * P.gu_rows;
        } else {
          route_wait();
          const int n_blk = P.I / P.gu_rows;
          base = P.gate_up + size_t(chosen[tile / n_blk]) * 2 * P.I * H;
          inter = P.I;
          r0 = (tile % n_blk) * P.gu_rows;
        }
        uint64_t* bar = &s.full[stage];
        unsigned char* dst = next(kind, 2 * b);
        bulk_copy(dst, base + size_t(r0) * H, b, bar);                 // gate rows
        bulk_copy(dst + b, base + size_t(inter + r0) * H, b, bar);     // up rows
        advance();
        break;
      }
      case DOWN: {
        const uint32_t bs = uint32_t(P.down_rows) * P.I_S * 2, br = uint32_t(P.down_rows) * P.I * 2;
        uint64_t* bar = &s.full[stage];
        unsigned char* dst = next(kind, bs + P.TOP_K * br);
        bulk_copy(dst, P.sdn + size_t(tile) * P.down_rows * P.I_S, bs, bar);  // before the routing is known
        route_wait();
        for (int j = 0; j < P.TOP_K; ++j)
          bulk_copy(dst + bs + j * br, P.down + (size_t(chosen[j]) * H + size_t(tile) * P.down_rows) * P.I, br, bar);
        advance();
        break;
      }
      case KDA: {  // the state the previous launch of this layer wrote: after that launch has ended
        if (!after_previous) {
          asm volatile("griddepcontrol.wait;" ::: "memory");
          after_previous = true;
        }
        const uint32_t b = uint32_t(P.D / 2) * P.D * 4;
        const float* st = P.state + size_t(tile) * P.D * P.D;
        for (int half = 0; half < 2; ++half) {
          uint64_t* bar = &s.full[stage];
          bulk_copy(next(kind, b), st + size_t(half) * (P.D / 2) * P.D, b, bar);
          advance();
        }
        if (P.kda_quiet) mbar_wait(s.quiet, uint32_t(kda_done++) & 1);
        break;
      }
      default:
        break;
    }
  }
}

// ---- the consumers' tasks -------------------------------------------------------------------------------

// rows [R, K] bf16 in shared memory times xs [K] bf16: warp w takes rows w, w + 8, ..., its lanes 8 columns
// (16 bytes) at a time along the row; returns the row sums in red[RED .. RED + R) once all threads pass the
// one barrier
template <int R>
__device__ void gemv_rows(const bf16* w, const bf16* xs, int K, float* red) {
  static_assert(R % 8 == 0, "a warp per row: rows in multiples of the 8 consumer warps");
  constexpr int RPW = R / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float acc[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
#pragma unroll 2
  for (int c = lane; c < K / 8; c += 32) {
    const uint4 xv = *reinterpret_cast<const uint4*>(xs + c * 8);
    float xf[8];
    const uint32_t xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      xf[2 * q] = __uint_as_float(xw[q] << 16);
      xf[2 * q + 1] = __uint_as_float(xw[q] & 0xffff0000u);
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const uint4 wv = *reinterpret_cast<const uint4*>(w + size_t(warp + 8 * r) * K + c * 8);
      const uint32_t ww[4] = {wv.x, wv.y, wv.z, wv.w};
      float a = acc[r];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        a = fmaf(__uint_as_float(ww[q] << 16), xf[2 * q], a);
        a = fmaf(__uint_as_float(ww[q] & 0xffff0000u), xf[2 * q + 1], a);
      }
      acc[r] = a;
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    float v = acc[r];
#pragma unroll
    for (int off = 16; off; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) red[RED + warp + 8 * r] = v;
  }
  consumer_sync();
}

__device__ void gemv_any(int rows, const bf16* w, const bf16* xs, int K, float* red) {
  switch (rows) {
    case 8: gemv_rows<8>(w, xs, K, red); break;
    case 16: gemv_rows<16>(w, xs, K, red); break;
    case 32: gemv_rows<32>(w, xs, K, red); break;
    default: __trap();
  }
}

// the input vector into shared memory (once per vector and launch: every later task of the CTA reuses it)
// (every load of a thread is issued before the first store: under the loader's stream each round trip to L2
// costs a microsecond or more, and a store between two loads would make them two)
constexpr int MAXC = 2;  // 8-element chunks per thread of a vector: H and NH * D <= 4096 (at 4 the kernel spilled)

__device__ void load_input(const bf16* src, int K, bf16* xs) {
  uint4 v[MAXC];
#pragma unroll
  for (int m = 0; m < MAXC; ++m) {
    const int c = threadIdx.x + m * CONSUMERS;
    if (c < K / 8) v[m] = ldcg_v4(src + c * 8);
  }
#pragma unroll
  for (int m = 0; m < MAXC; ++m) {
    const int c = threadIdx.x + m * CONSUMERS;
    if (c < K / 8) *reinterpret_cast<uint4*>(xs + c * 8) = v[m];
  }
  consumer_sync();
}

// the GEMV's normed input vector into shared memory, recomputed by every CTA that needs it (no norm task, no
// hop): without `add` x = RMSNorm(h) * w; with it h1 = h + add (rounded as the residual add writes it), then
// x2 = RMSNorm(h1) * w, in the norm kernel's roundings. Every load is issued before the first store.
__device__ void norm_input(const Params& P, const Smem& s, const bf16* add, const bf16* wn) {
  const int H = P.H, nch = H / 8;
  uint4 hvs[MAXC], avs[MAXC], wvs[MAXC];
#pragma unroll
  for (int m = 0; m < MAXC; ++m) {
    const int c = threadIdx.x + m * CONSUMERS;
    if (c < nch) {
      hvs[m] = ldcg_v4(P.h + c * 8);
      avs[m] = add ? ldcg_v4(add + c * 8) : make_uint4(0, 0, 0, 0);
      wvs[m] = *reinterpret_cast<const uint4*>(wn + c * 8);
    }
  }
  float v[MAXC][8];
  float ss = 0.f;
#pragma unroll
  for (int m = 0; m < MAXC; ++m) {
    const int c = threadIdx.x + m * CONSUMERS;
    if (c < nch) {
      const bf16* hb = reinterpret_cast<const bf16*>(&hvs[m]);
      const bf16* ab = reinterpret_cast<const bf16*>(&avs[m]);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        float f = bf2f(hb[q]);
        if (add) f = bf2f(f2bf(f + bf2f(ab[q])));
        v[m][q] = f;
        ss = fmaf(f, f, ss);
      }
    }
  }
  const float rms = rsqrtf(block_sum(ss, s.red + RED + 32) / H + P.eps);
#pragma unroll
  for (int m = 0; m < MAXC; ++m) {
    const int c = threadIdx.x + m * CONSUMERS;
    if (c < nch) {
      const bf16* wb = reinterpret_cast<const bf16*>(&wvs[m]);
      uint4 ov;
      bf16* ob = reinterpret_cast<bf16*>(&ov);
#pragma unroll
      for (int q = 0; q < 8; ++q) ob[q] = f2bf(bf2f(wb[q]) * bf2f(f2bf(v[m][q] * rms)));
      *reinterpret_cast<uint4*>(s.xs + c * 8) = ov;
    }
  }
  consumer_sync();
}

// one causal-conv output: taps t (4 bf16, 8 bytes) over the window w0..w2 (oldest first) and the input x; SiLU
__device__ __forceinline__ float conv_silu(uint2 t, bf16 w0, bf16 w1, bf16 w2, float x) {
  const float y = __uint_as_float(t.x << 16) * bf2f(w0) + __uint_as_float(t.x & 0xffff0000u) * bf2f(w1) +
                  __uint_as_float(t.y << 16) * bf2f(w2) + __uint_as_float(t.y & 0xffff0000u) * x;
  return y * sigmoidf(y);
}

// KDA: head h's conv + SiLU, q/k L2 norm, gate, delta rule on the state streamed into two stages, gated norm
// (the new state is written over the old in the two ring stages and goes back to global memory as two bulk
// stores, issued by thread 0 and awaited only before the stages are reused: the task's signal does not wait
// for 64 KB of stores to be acknowledged, as it would behind a fence)
__device__ void kda_task(const Params& P, const Smem& s, int h, float* S0, float* S1) {
  const int D = P.D, C = P.NH * D, tid = threadIdx.x;
  float* q = s.scratch;
  float* k = q + D;
  float* dec = k + D;
  float* v = dec + D;
  float* z = v + D;
  float* part = z + D;  // [CONSUMERS]
  float* opart = part + CONSUMERS;  // [CONSUMERS]
  float* red = s.red + RED + 32;
  float qt = 0.f, kt = 0.f;
  const float beta_in = bf2f(ldcg_bf(P.p + 5 * C + h));
  const float onw = bf2f(P.o_norm[tid % D]);
  if (tid < D) {  // channel tid of q and k (every load before the first store)
    const int ck = h * D + tid;
    const bf16 q_in = ldcg_bf(P.p + ck), k_in = ldcg_bf(P.p + C + ck);
    const float f = bf2f(ldcg_bf(P.p + 3 * C + ck));
    bf16* wq = P.conv + size_t(ck) * 3;
    bf16* wk = P.conv + size_t(C + ck) * 3;
    const bf16 q0 = wq[0], q1 = wq[1], q2 = wq[2], k0 = wk[0], k1 = wk[1], k2 = wk[2];
    const uint2 tq = *reinterpret_cast<const uint2*>(P.conv_w + size_t(ck) * 4);
    const uint2 tk = *reinterpret_cast<const uint2*>(P.conv_w + size_t(C + ck) * 4);
    const float rate = __expf(P.a_log[h]), dtb = P.dt_bias[ck];
    qt = conv_silu(tq, q0, q1, q2, bf2f(q_in));
    kt = conv_silu(tk, k0, k1, k2, bf2f(k_in));
    dec[tid] = __expf(P.lower_bound * sigmoidf(rate * (f + dtb)));
    wq[0] = q1; wq[1] = q2; wq[2] = q_in;
    wk[0] = k1; wk[1] = k2; wk[2] = k_in;
  } else if (tid < 2 * D) {  // channel tid - D of v, and the output gate
    const int cv = h * D + tid - D;
    const bf16 v_in = ldcg_bf(P.p + 2 * C + cv);
    const float zin = bf2f(ldcg_bf(P.p + 4 * C + cv));
    bf16* wv = P.conv + size_t(2 * C + cv) * 3;
    const bf16 v0 = wv[0], v1 = wv[1], v2 = wv[2];
    const uint2 tv = *reinterpret_cast<const uint2*>(P.conv_w + size_t(2 * C + cv) * 4);
    v[tid - D] = conv_silu(tv, v0, v1, v2, bf2f(v_in));
    z[tid - D] = zin;
    wv[0] = v1; wv[1] = v2; wv[2] = v_in;
  }
  const float beta = sigmoidf(beta_in);
  const float ssq = block_sum(qt * qt, red), ssk = block_sum(kt * kt, red);
  qt *= rsqrtf(ssq + 1e-6f) * P.q_scale;
  kt *= rsqrtf(ssk + 1e-6f);
  if (tid < D) { q[tid] = qt; k[tid] = kt; }
  const float qk = block_sum(qt * kt, red);  // the barrier inside also publishes q, k, dec, v, z
  const int nsplit = CONSUMERS / D, rows = D / nsplit, col = tid % D, sp = tid / D, half = D / 2;
  float ks = 0.f;
  for (int r = sp * rows; r < (sp + 1) * rows; ++r) {
    const float Srv = r < half ? S0[r * D + col] : S1[(r - half) * D + col];
    ks = fmaf(Srv * dec[r], k[r], ks);
  }
  part[tid] = ks;
  consumer_sync();
  float kS = 0.f;
  for (int j = 0; j < nsplit; ++j) kS += part[j * D + col];
  const float err = beta * (v[col] - kS);
  float oacc = 0.f;
  for (int r = sp * rows; r < (sp + 1) * rows; ++r) {
    float* S = r < half ? S0 + r * D + col : S1 + (r - half) * D + col;
    const float Pv = *S * dec[r];
    oacc = fmaf(Pv, q[r], oacc);
    *S = fmaf(k[r], err, Pv);
  }
  opart[tid] = oacc;
  fence_async_smem();  // the new state, for the bulk stores' async proxy
  consumer_sync();
  if (tid == 0) {
    float* out_state = P.state + size_t(h) * D * D;
    bulk_store(out_state, S0, uint32_t(half) * D * 4);
    bulk_store(out_state + size_t(half) * D, S1, uint32_t(D - half) * D * 4);
    bulk_commit();
  }
  float o = 0.f;
  if (sp == 0) {
    for (int j = 0; j < nsplit; ++j) o += opart[j * D + col];
    o += qk * err;
  }
  const float ss = block_sum(sp == 0 ? o * o : 0.f, red);
  if (sp == 0) {
    const float rms = rsqrtf(ss / D + P.eps);
    P.o[h * D + col] = f2bf(o * rms * onw * sigmoidf(z[col]));
  }
}

// the routing, on every CTA that hosts routed tasks, at its first one: once the router's tiles are all written
// (the acquire poll), sigmoid, bias, grouped top-k (groups by the sum of their best two), renormalised and
// scaled weights, into s.misc (and, the same values from every CTA, into topk_i / topk_w for the caller); then
// the loader may copy the chosen experts' rows
__device__ void route_local(const Params& P, const Smem& s, int gen) {
  const int E = P.E, G = P.G, epg = E / G, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* score = s.scratch;
  float* choice = score + E;
  float* gscore = choice + E;  // [G]
  int* kept = reinterpret_cast<int*>(gscore + G);  // [G]
  constexpr int MAXE = 4;  // experts per thread: E <= 1024
  float lg[MAXE], bs[MAXE];
#pragma unroll
  for (int m = 0; m < MAXE; ++m) {  // the bias (a weight) before the wait
    const int e = tid + m * CONSUMERS;
    if (e < E) bs[m] = P.expert_bias[e];
  }
  if (tid == 0) wait_counter(P.cnt, P.router_counter, P.router_need, gen);
  consumer_sync();
#pragma unroll
  for (int m = 0; m < MAXE; ++m) {
    const int e = tid + m * CONSUMERS;
    if (e < E) lg[m] = ldcg_f(P.logits + e);
  }
#pragma unroll
  for (int m = 0; m < MAXE; ++m) {
    const int e = tid + m * CONSUMERS;
    if (e < E) {
      const float sc = sigmoidf(lg[m]);
      score[e] = sc;
      choice[e] = sc + bs[m];
    }
  }
  consumer_sync();
  for (int g = warp; g < G; g += 8) {  // the best two of each group (a value twice counts twice)
    float b1 = -INFINITY, b2 = -INFINITY;
    for (int e = lane; e < epg; e += 32) {
      const float c = choice[g * epg + e];
      if (c > b1) { b2 = b1; b1 = c; } else if (c > b2) { b2 = c; }
    }
#pragma unroll
    for (int off = 16; off; off >>= 1) {
      const float o1 = __shfl_xor_sync(0xffffffffu, b1, off), o2 = __shfl_xor_sync(0xffffffffu, b2, off);
      const float hi = fmaxf(b1, o1), lo = fmaxf(fminf(b1, o1), fmaxf(b2, o2));
      b1 = hi;
      b2 = lo;
    }
    if (lane == 0) gscore[g] = b1 + b2;
  }
  consumer_sync();
  if (tid < G) {  // kept when fewer than TOPK_GROUP groups beat it (ties: the lower group first)
    int beaten = 0;
    for (int o = 0; o < G; ++o) beaten += gscore[o] > gscore[tid] || (gscore[o] == gscore[tid] && o < tid);
    kept[tid] = beaten < P.TOPK_GROUP;
  }
  consumer_sync();
  if (warp == 0) {
    for (int e = lane; e < E; e += 32)
      if (!kept[e / epg]) choice[e] = -INFINITY;
    __syncwarp();
    int my_id = 0;
    float my_w = 0.f, total = 0.f;
    for (int j = 0; j < P.TOP_K; ++j) {  // one pick each, ties to the lower id
      float best = -INFINITY;
      int bi = E;
      for (int e = lane; e < E; e += 32) {
        const float c = choice[e];
        if (c > best) { best = c; bi = e; }
      }
#pragma unroll
      for (int off = 16; off; off >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, off);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
      }
      const float w = score[bi];
      total += w;
      if (lane == j) { my_id = bi; my_w = w; }
      if (lane == (bi & 31)) choice[bi] = -INFINITY;
      __syncwarp();
    }
    const float mult = P.scale / (total + 1e-20f);
    if (lane < P.TOP_K) {
      s.misc[1 + lane] = my_id;
      reinterpret_cast<float*>(s.misc)[1 + P.TOP_K + lane] = my_w * mult;
      P.topk_w[lane] = my_w * mult;
      P.topk_i[lane] = my_id;
    }
  }
  consumer_sync();
  if (tid == 0) mbar_arrive(s.routed);
}

// the activations every DOWN task of the CTA reads, into shared memory at once (one round trip to L2): the
// shared expert's as they are, the routed experts' times their routing weight (fp32, as the chain's kernel)
constexpr int MAXA = 8;  // activations per thread: (1 + TOP_K) * max(I, I_S) <= 2048

__device__ void load_acts(const Params& P, const Smem& s, float* acts) {
  const float* topk_w = reinterpret_cast<const float*>(s.misc) + 1 + P.TOP_K;
  const int width = P.I > P.I_S ? P.I : P.I_S;
  float a[MAXA], wt[MAXA];
#pragma unroll
  for (int m = 0; m < MAXA; ++m) {
    const int n = threadIdx.x + m * CONSUMERS, j = n / width, i = n % width;
    a[m] = 0.f;
    wt[m] = 1.f;
    if (n < (1 + P.TOP_K) * width && i < (j ? P.I : P.I_S)) {
      a[m] = bf2f(ldcg_bf(P.act + j * P.I_PAD + i));
      if (j) wt[m] = topk_w[j - 1];
    }
  }
#pragma unroll
  for (int m = 0; m < MAXA; ++m) {
    const int n = threadIdx.x + m * CONSUMERS, j = n / width;
    if (n < (1 + P.TOP_K) * width) acts[n] = j ? a[m] * wt[m] : a[m];
  }
  consumer_sync();
}

// DOWN: hidden rows tile*R..: the shared and routed experts' down rows times their activations (routed ones
// weighted), summed, plus the residual h1 = h + a (recomputed at these rows, rounded as the residual add)
constexpr int MAX_DOWN_ROWS = 32;  // 4 rows per warp

struct DownResidual {  // lane 0's h and a at its warp's rows, requested before the activations
  bf16 h[MAX_DOWN_ROWS / 8], a[MAX_DOWN_ROWS / 8];
};

__device__ DownResidual load_down_residual(const Params& P, int tile) {
  DownResidual d;
  const int R = P.down_rows, warp = threadIdx.x >> 5;
#pragma unroll
  for (int q = 0; q < MAX_DOWN_ROWS / 8; ++q) {
    const int r = warp + 8 * q;
    if ((threadIdx.x & 31) == 0 && r < R) {
      d.h[q] = ldcg_bf(P.h + tile * R + r);
      d.a[q] = ldcg_bf(P.a + tile * R + r);
    }
  }
  return d;
}

__device__ void down_task(const Params& P, const bf16* w, const float* acts, int tile, const DownResidual& d) {
  const int R = P.down_rows, I = P.I, IS = P.I_S, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int width = I > IS ? I : IS;
  const bf16* routed = w + size_t(R) * IS;
#pragma unroll
  for (int q = 0; q < MAX_DOWN_ROWS / 8; ++q) {
    const int r = warp + 8 * q;
    if (r >= R) break;
    const bf16 hr = d.h[q], ar = d.a[q];
    float sum = 0.f;
    for (int i = lane; i < width; i += 32) {
      float acc = i < IS ? bf2f(w[r * IS + i]) * acts[i] : 0.f;
      if (i < I) {
        for (int j = 0; j < P.TOP_K; ++j) acc = fmaf(bf2f(routed[(size_t(j) * R + r) * I + i]), acts[(1 + j) * width + i], acc);
      }
      sum += acc;
    }
#pragma unroll
    for (int off = 16; off; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
      const int row = tile * R + r;
      const float m = bf2f(f2bf(sum));
      P.out[row] = f2bf(bf2f(f2bf(bf2f(hr) + bf2f(ar))) + m);
    }
  }
}

__device__ __forceinline__ void stamp(const Params& P, int idx, int k) {
  if (P.timeline && threadIdx.x == 0) P.stamps[idx * 4 + k] = globaltimer();
}

__device__ void consumers(const Params& P, const Smem& s, int gen) {
  enum Input { NO_INPUT, X, X2, O };  // what xs holds: RMSNorm(h), RMSNorm(h + a), the attention output
  const int tid = threadIdx.x, C = P.NH * P.D;
  int stage = 0;
  uint32_t phase = 0;
  int input = NO_INPUT;
  bool acts_ready = false;  // s.acts holds this launch's activations
  bool routed = false;  // s.misc holds this launch's routing
  for (int i = 0; i < P.max_tasks; ++i) {
    const int* row = s.tasks + i * FIELDS;
    const int kind = row[0], tile = row[1], idx = row[7];
    if (kind == NONE) continue;
    stamp(P, idx, 0);
    if (!routed && (kind == EXPERT_GU || kind == DOWN)) {  // before the stage: the loader's copies need it
      route_local(P, s, gen);
      routed = true;
    }
    const int nst = stages_of(kind);
    unsigned char* w0 = s.ring + size_t(stage) * P.stage_bytes;
    int stage1 = stage + 1 == P.stages ? 0 : stage + 1;
    unsigned char* w1 = s.ring + size_t(stage1) * P.stage_bytes;
    if (nst >= 1) mbar_wait(&s.full[stage], phase);
    if (nst == 2) mbar_wait(&s.full[stage1], stage1 == 0 ? phase ^ 1 : phase);
    stamp(P, idx, 1);
    if (tid == 0) {  // (the routing polled the router's counter already)
      if (row[2] != P.router_counter || !routed) wait_counter(P.cnt, row[2], row[3], gen);
      if (row[4] != P.router_counter || !routed) wait_counter(P.cnt, row[4], row[5], gen);
    }
    consumer_sync();
    stamp(P, idx, 2);
    const bf16* w = reinterpret_cast<const bf16*>(w0);
    float* res = s.red + RED;
    switch (kind) {
      case PROJ:
      case ROUTER: {
        const int R = kind == PROJ ? P.proj_rows : P.router_rows;
        const int want = kind == PROJ ? X : X2;
        if (input != want) {
          norm_input(P, s, kind == PROJ ? nullptr : P.a, kind == PROJ ? P.in_norm : P.post_norm);
          input = want;
        }
        gemv_any(R, w, s.xs, P.H, s.red);
        if (tid < R) {  // a last PROJ tile's rows past the end were never copied: not stored
          if (kind == ROUTER) P.logits[tile * R + tid] = res[tid];
          else if (tile * R + tid < 5 * C + P.NH) P.p[tile * R + tid] = f2bf(res[tid]);
        }
        break;
      }
      case OPROJ: {
        if (input != O) { load_input(P.o, C, s.xs); input = O; }
        gemv_any(P.oproj_rows, w, s.xs, C, s.red);
        if (tid < P.oproj_rows) P.a[tile * P.oproj_rows + tid] = f2bf(res[tid]);
        break;
      }
      case SHARED_GU:
      case EXPERT_GU: {
        if (input != X2) { norm_input(P, s, P.a, P.post_norm); input = X2; }
        const int gr = P.gu_rows;
        gemv_any(2 * gr, w, s.xs, P.H, s.red);
        if (tid < gr) {
          float g = res[tid], u = res[gr + tid];
          const float lim = kind == SHARED_GU ? P.shared_limit : P.limit;
          float act = g * sigmoidf(g);
          if (lim > 0.f) { act = fminf(act, lim); u = fminf(fmaxf(u, -lim), lim); }
          int slot, r0;
          if (kind == SHARED_GU) { slot = 0; r0 = tile * gr; }
          else { const int n_blk = P.I / gr; slot = 1 + tile / n_blk; r0 = (tile % n_blk) * gr; }
          P.act[slot * P.I_PAD + r0 + tid] = f2bf(act * u);
        }
        break;
      }
      case DOWN: {
        const DownResidual d = load_down_residual(P, tile);  // in flight with the activations
        if (!acts_ready) {
          load_acts(P, s, s.acts);
          acts_ready = true;
        }
        down_task(P, w, s.acts, tile, d);
        break;
      }
      case KDA:
        kda_task(P, s, tile, reinterpret_cast<float*>(w0), reinterpret_cast<float*>(w1));
        break;
      default:
        break;
    }
    consumer_sync();  // every thread's reads of the stage and its stores are done
    stamp(P, idx, 3);
    if (tid == 0) {
      st_release_cta(s.ended, i + 1);  // the signaller releases the task's counter
      if (kind == KDA) bulk_wait_read();  // the new state has left the stages
      for (int k = 0; k < nst; ++k) mbar_arrive(&s.empty[k == 0 ? stage : stage1]);
      if (kind == KDA && P.kda_quiet) mbar_arrive(s.quiet);
    }
    for (int k = 0; k < nst; ++k)
      if (++stage == P.stages) { stage = 0; phase ^= 1; }
  }
}

// ---- the signaller ---------------------------------------------------------------------------------------

// Releases the counters of the tasks the consumers ended, in list order, so that no consumer waits for its
// stores to be acknowledged (a release waits for every earlier store of the CTA it has seen: under a full
// stream of copies, a round trip to L2 of a microsecond or more per task). Whatever has ended since its last
// look goes under one fence: fence.acq_rel.gpu then relaxed adds is a release of each (the consumers' stores
// reach it through their barrier and the release/acquire of `ended` in shared memory).
__device__ void signaller(const Params& P, const Smem& s) {
  int n = 0;  // the list's tasks (the table pads a list at its end)
  while (n < P.max_tasks && s.tasks[n * FIELDS] != NONE) ++n;
  int signalled = 0;
  while (signalled < n) {
    const int ended = ld_acquire_cta(s.ended);
    if (ended == signalled) {
      __nanosleep(32);  // (the spin shares its SM sub-partition with two consumer warps)
      continue;
    }
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    for (; signalled < ended; ++signalled) {
      const int sig = s.tasks[signalled * FIELDS + 6];
      if (sig >= 0) red_relaxed(P.cnt + sig, 1);
    }
  }
}

__global__ void __launch_bounds__(THREADS, 1) layer_kernel(const __grid_constant__ Params P) {
  extern __shared__ __align__(128) unsigned char smem[];
  const Smem s = carve(smem, P);
  const int tid = threadIdx.x;
  for (int j = tid; j < P.max_tasks * FIELDS; j += THREADS) s.tasks[j] = P.tasks[blockIdx.x * P.max_tasks * FIELDS + j];
  if (tid == 0) {
    for (int k = 0; k < P.stages; ++k) {
      mbar_init(&s.full[k], 1);
      mbar_init(&s.empty[k], 1);
    }
    mbar_init(s.routed, 1);
    mbar_init(s.quiet, 1);
    *s.ended = 0;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid >= CONSUMERS) {  // the weights stream before the previous launch has ended (PDL)
    if (tid == LOADER) loader(P, s);
    if (tid == SIGNALLER) signaller(P, s);
    return;
  }
  // under programmatic dependent launch the next launch may start as this one's CTAs leave their SMs; its
  // consumers wait for this whole grid (griddepcontrol.wait) before reading anything it wrote
  if (tid == 0) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (tid == 0) {
    s.misc[0] = ld_acquire(P.cnt + P.epoch) + 1;  // this launch's generation
  }
  consumer_sync();
  const int gen = s.misc[0];
  consumers(P, s, gen);
  if (tid == 0) {
    bulk_wait_all();  // a KDA task's state stores, complete before this CTA ends
    const int arrived = atom_acq_rel(P.cnt + P.done, 1);
    if (arrived == gen * P.programs - 1) red_release(P.cnt + P.epoch, 1);  // the next launch's generation
  }
}

}  // namespace lingls_persistent

using lingls_persistent::Params;

// The launch, on `stream` (capturable): 0 or a cudaError_t; -1 if the caller's Params differ from this file's.
extern "C" int lingls_persistent_layer(const Params* params, size_t params_size, int smem_bytes, int pdl,
                                       void* stream) {
  if (params_size != sizeof(Params)) return -1;
  static int configured = 0;
  if (configured < smem_bytes) {
    cudaError_t e = cudaFuncSetAttribute(lingls_persistent::layer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (e != cudaSuccess) return int(e);
    configured = smem_bytes;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(params->programs);
  config.blockDim = dim3(lingls_persistent::THREADS);
  config.dynamicSmemBytes = size_t(smem_bytes);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  config.attrs = attr;
  config.numAttrs = 1;
  return int(cudaLaunchKernelEx(&config, lingls_persistent::layer_kernel, *params));
}

// sizeof(Params), for the caller's check of its mirror of the struct
extern "C" size_t lingls_persistent_params_size() { return sizeof(Params); }
