"""Fused batch-1 KDA layer step: short conv + SiLU, q/k L2 norm, gate, delta rule and gated output norm in one
Triton launch for T = 1..MAX_TOKENS tokens, plus the on-device commit of a staged (speculative) state.

Why one kernel: at batch 1 a KDA layer's step moves ~1 MiB (the fp32 state of 8 heads x 128 x 128 per TP=4
rank, read and written) and does almost no math, so the separate conv, norm, gate, recurrence and output-norm
launches of the torch form cost far more in launch gaps and round trips through memory than the work itself.

Parallel layout: the delta rule's value columns are independent (S's column j only ever mixes with v_j), so the
grid is (head, block of `block_v` value columns). Each program recomputes its head's conv, SiLU, q/k L2 norm and
gate over all D key channels (D-vectors: cheap) and keeps its [D, block_v] slice of the state in registers for
all T tokens; H=8, D=128, block_v=16 gives 64 programs instead of 8.

Two things need a whole head, which no single program owns:
- the q/k conv state: every program of a head reads it, so no program may overwrite it while another might
  still read it;
- the gated RMSNorm of the output, over all D value channels of a head.
Both are done by the *last arriving* program of the head: each program writes its fp32 slice of o to a
scratch buffer, passes a CTA barrier and increments the head's arrival counter (acq_rel, gpu scope); the one
that sees NV-1 knows every other program of its head has finished reading the conv state and writing o, so
it writes the new q/k conv state, normalises the head's o (RMSNorm_D(o) * w * sigmoid(z), fp32) and resets
the counter. There is no spinning, so it cannot deadlock and runs unchanged in Triton's interpreter. The norm
therefore lives inside this kernel (not in norm.py): a separate launch per layer would cost ~1-2 us x 35 layers
per step, more than the norm's work; pass `norm_weight=None` to get the raw fp32 o instead (e.g. to fold the
norm into the next GEMV's prologue).

Speculative verification: with `stage=(stage_state [>=T, H, D, D] fp32, stage_conv [>=T, 3, C, K-1])` the
live state and conv state are only read; the state and conv state after every position t are written to
stage_*[t]. `commit(index, ...)` then copies stage_*[index] into the live tensors, reading `index` on device,
so the host never waits for the accepted count. It takes a leading layer dim, so one launch commits all layers.

Programmatic dependent launch (pdl=True, CUDA only): a kernel loads its weights (conv taps, A_log, dt_bias),
then `gdc_wait`s for the previous kernel before touching anything a kernel writes (inputs, states,
counters), then lets the next kernel launch (`gdc_launch_dependents`) so that kernel can load its own weights
while this one runs. Since each kernel waits before it triggers, at most two neighbours overlap, and everything
two or more launches back has completed: consecutive kda_step calls on the same state stay correct.
"""

from __future__ import annotations

import torch

from lingls.kernels import by_tokens
from lingls.kernels import reference as ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch wheels ship without Triton: the references serve there
    triton = tl = None

_jit = triton.jit if triton is not None else (lambda fn: fn)

MAX_TOKENS = 64  # one step's tokens; the model switches to the chunked form at 64
CONV_KERNEL = 4  # Ling's short_conv_kernel_size; the kernel keeps the last 3 inputs in registers


# ---------------------------------------------------------------------------------------------------------
# KDA step


@_jit
def _conv_silu(w0, w1, w2, w3, x0, x1, x2, x):
    """One causal-conv output (taps w0..w3 over inputs x0, x1, x2, x oldest first) then SiLU, fp32."""
    y = w0 * x0 + w1 * x1 + w2 * x2 + w3 * x
    return y * tl.sigmoid(y)


@_jit
def _kda_step_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, z_ptr, sq, sk, sv, sf, sb, sz,
    conv_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr, state_ptr,
    out_ptr, s_out, o_acc_ptr, count_ptr, stage_state_ptr, stage_conv_ptr,
    q_scale, lower_bound, eps,
    T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    STAGE: tl.constexpr, NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    h = tl.program_id(0)
    j = tl.program_id(1)
    NV: tl.constexpr = D // BV
    C: tl.constexpr = H * D
    dk = tl.arange(0, D)
    dv = j * BV + tl.arange(0, BV)
    ck = h * D + dk  # this head's q/k/f/z channels
    cv = h * D + dv  # this program's v channels
    # conv taps [3, C, 4] and the gate's constants: weights, safe to load before the previous kernel ends
    wq0 = tl.load(conv_w_ptr + ck * 4 + 0).to(tl.float32)
    wq1 = tl.load(conv_w_ptr + ck * 4 + 1).to(tl.float32)
    wq2 = tl.load(conv_w_ptr + ck * 4 + 2).to(tl.float32)
    wq3 = tl.load(conv_w_ptr + ck * 4 + 3).to(tl.float32)
    wk0 = tl.load(conv_w_ptr + (C + ck) * 4 + 0).to(tl.float32)
    wk1 = tl.load(conv_w_ptr + (C + ck) * 4 + 1).to(tl.float32)
    wk2 = tl.load(conv_w_ptr + (C + ck) * 4 + 2).to(tl.float32)
    wk3 = tl.load(conv_w_ptr + (C + ck) * 4 + 3).to(tl.float32)
    wv0 = tl.load(conv_w_ptr + (2 * C + cv) * 4 + 0).to(tl.float32)
    wv1 = tl.load(conv_w_ptr + (2 * C + cv) * 4 + 1).to(tl.float32)
    wv2 = tl.load(conv_w_ptr + (2 * C + cv) * 4 + 2).to(tl.float32)
    wv3 = tl.load(conv_w_ptr + (2 * C + cv) * 4 + 3).to(tl.float32)
    rate = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + ck).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    # conv state [3, C, 3], oldest input first; kept as three sliding registers per stream
    xq0 = tl.load(conv_ptr + ck * 3 + 0).to(tl.float32)
    xq1 = tl.load(conv_ptr + ck * 3 + 1).to(tl.float32)
    xq2 = tl.load(conv_ptr + ck * 3 + 2).to(tl.float32)
    xk0 = tl.load(conv_ptr + (C + ck) * 3 + 0).to(tl.float32)
    xk1 = tl.load(conv_ptr + (C + ck) * 3 + 1).to(tl.float32)
    xk2 = tl.load(conv_ptr + (C + ck) * 3 + 2).to(tl.float32)
    xv0 = tl.load(conv_ptr + (2 * C + cv) * 3 + 0).to(tl.float32)
    xv1 = tl.load(conv_ptr + (2 * C + cv) * 3 + 1).to(tl.float32)
    xv2 = tl.load(conv_ptr + (2 * C + cv) * 3 + 2).to(tl.float32)
    s_off = h * D * D + dk[:, None] * D + dv[None, :]
    S = tl.load(state_ptr + s_off)  # [D, BV] fp32

    for t in range(T):
        xq = tl.load(q_ptr + t * sq + ck).to(tl.float32)
        xk = tl.load(k_ptr + t * sk + ck).to(tl.float32)
        xv = tl.load(v_ptr + t * sv + cv).to(tl.float32)
        qt = _conv_silu(wq0, wq1, wq2, wq3, xq0, xq1, xq2, xq)
        kt = _conv_silu(wk0, wk1, wk2, wk3, xk0, xk1, xk2, xk)
        vt = _conv_silu(wv0, wv1, wv2, wv3, xv0, xv1, xv2, xv)
        xq0, xq1, xq2 = xq1, xq2, xq
        xk0, xk1, xk2 = xk1, xk2, xk
        xv0, xv1, xv2 = xv1, xv2, xv
        qt = qt / tl.sqrt(tl.sum(qt * qt, 0) + 1e-6) * q_scale
        kt = kt / tl.sqrt(tl.sum(kt * kt, 0) + 1e-6)
        f = tl.load(f_ptr + t * sf + ck).to(tl.float32)
        decay = tl.exp(lower_bound * tl.sigmoid(rate * (f + dt_bias)))
        beta = tl.sigmoid(tl.load(b_ptr + t * sb + h).to(tl.float32))
        # S' = diag(decay) S + k (beta (v - (diag(decay) S)^T k))^T and o = S'^T q: both reductions read the
        # decayed state P, so they are independent (o = P^T q + (k.q) err) and their latencies overlap.
        P = S * decay[:, None]
        kS = tl.sum(P * kt[:, None], 0)
        qS = tl.sum(P * qt[:, None], 0)
        err = beta * (vt - kS)
        S = P + kt[:, None] * err[None, :]
        o = qS + tl.sum(qt * kt, 0) * err
        if NORM:
            tl.store(o_acc_ptr + t * C + cv, o)
        else:
            tl.store(out_ptr + t * s_out + cv, o.to(out_ptr.dtype.element_ty))
        if STAGE:
            tl.store(stage_state_ptr + t * H * D * D + s_off, S)
            sc = stage_conv_ptr + t * 3 * C * 3
            sty = stage_conv_ptr.dtype.element_ty
            tl.store(sc + (2 * C + cv) * 3 + 0, xv0.to(sty))
            tl.store(sc + (2 * C + cv) * 3 + 1, xv1.to(sty))
            tl.store(sc + (2 * C + cv) * 3 + 2, xv2.to(sty))
            first = (dk < D) & (j == 0)  # one program per head writes the q/k windows
            tl.store(sc + ck * 3 + 0, xq0.to(sty), mask=first)
            tl.store(sc + ck * 3 + 1, xq1.to(sty), mask=first)
            tl.store(sc + ck * 3 + 2, xq2.to(sty), mask=first)
            tl.store(sc + (C + ck) * 3 + 0, xk0.to(sty), mask=first)
            tl.store(sc + (C + ck) * 3 + 1, xk1.to(sty), mask=first)
            tl.store(sc + (C + ck) * 3 + 2, xk2.to(sty), mask=first)

    ety = conv_ptr.dtype.element_ty
    if not STAGE:  # this program's own columns: nobody else reads them
        tl.store(state_ptr + s_off, S)
        tl.store(conv_ptr + (2 * C + cv) * 3 + 0, xv0.to(ety))
        tl.store(conv_ptr + (2 * C + cv) * 3 + 1, xv1.to(ety))
        tl.store(conv_ptr + (2 * C + cv) * 3 + 2, xv2.to(ety))
    if NORM or not STAGE:
        # last arriver of the head: all reads of the q/k conv state and all o writes of its peers are done
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + h, 1, sem="acq_rel", scope="gpu")
        if arrived == NV - 1:
            tl.atomic_xchg(count_ptr + h, 0, sem="relaxed", scope="gpu")
            if not STAGE:
                tl.store(conv_ptr + ck * 3 + 0, xq0.to(ety))
                tl.store(conv_ptr + ck * 3 + 1, xq1.to(ety))
                tl.store(conv_ptr + ck * 3 + 2, xq2.to(ety))
                tl.store(conv_ptr + (C + ck) * 3 + 0, xk0.to(ety))
                tl.store(conv_ptr + (C + ck) * 3 + 1, xk1.to(ety))
                tl.store(conv_ptr + (C + ck) * 3 + 2, xk2.to(ety))
            if NORM:
                rows = tl.arange(0, BT)
                m = (rows[:, None] < T) & (dk[None, :] < D)
                oh = tl.load(o_acc_ptr + rows[:, None] * C + ck[None, :], mask=m, other=0.0, cache_modifier=".cg")
                zh = tl.load(z_ptr + rows[:, None] * sz + ck[None, :], mask=m, other=0.0).to(tl.float32)
                w = tl.load(norm_w_ptr + dk).to(tl.float32)
                rms = tl.rsqrt(tl.sum(oh * oh, 1) / D + eps)
                y = oh * rms[:, None] * w[None, :] * tl.sigmoid(zh)
                tl.store(out_ptr + rows[:, None] * s_out + ck[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


_WORKSPACE: dict = {}


def _workspace(device: torch.device, heads: int, head_dim: int):
    """fp32 o scratch [MAX_TOKENS, C] and per-head arrival counters [H] (zero; each launch leaves them zero).

    One per (device, H, D), shared by all layers (their launches are stream-ordered) and allocated once, so a
    CUDA graph captured after the first call keeps valid addresses. Call once before capturing a graph."""
    key = (device, heads, head_dim)
    if key not in _WORKSPACE:
        _WORKSPACE[key] = (torch.empty(MAX_TOKENS, heads * head_dim, device=device, dtype=torch.float32),
                           torch.zeros(heads, device=device, dtype=torch.int32))
    return _WORKSPACE[key]


def _row_stride(x: torch.Tensor, name: str) -> int:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be [T, N] with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    return x.stride(0)


# (block_v, num_warps) by the step's token count (the smallest key >= T applies), timed by bench/tune_gpu.py at
# Ling-3.0-flash TP=4 rank shapes on an H200 (bench/results/fused_step_shard42.json): at T=9 (staged verify)
# 32 value columns per program take 22.6 us per layer against 28.2 us with 16; at T=1 the two are within 5%.
CONFIGS = {1: (16, 4), 16: (32, 4)}


def config_for(t: int) -> tuple[int, int]:
    return by_tokens(CONFIGS, t)


def fused_kda_step(q, k, v, f, b, z, conv_state, conv_weight, a_log, dt_bias, norm_weight, state, *,
                   lower_bound: float, eps: float = 1e-6, stage=None, out=None, pdl: bool = False,
                   block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """The Triton KDA step (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). Arguments as `kda_step`;
    block_v (value columns per program) and num_warps override `CONFIGS`."""
    t, c = q.shape
    h, d = state.shape[0], state.shape[-1]
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"T={t} tokens: the fused step handles 1..{MAX_TOKENS}")
    for name, x, width in (("k", k, c), ("v", v, c), ("f", f, c), ("z", z, c), ("b", b, h)):
        if x is not None and x.shape != (t, width):
            raise ValueError(f"{name} must be [T, {width}] = [{t}, {width}], got {tuple(x.shape)}")
    if c != h * d or state.shape != (h, d, d) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be contiguous fp32 [H, D, D] with H*D = C = {c}, got {tuple(state.shape)} {state.dtype}")
    if conv_weight.shape != (3, c, CONV_KERNEL) or conv_state.shape != (3, c, CONV_KERNEL - 1):
        raise ValueError(f"conv_weight must be [3, C, 4] and conv_state [3, C, 3], got {tuple(conv_weight.shape)}, {tuple(conv_state.shape)}")
    if not (conv_weight.is_contiguous() and conv_state.is_contiguous()):
        raise ValueError("conv_weight and conv_state must be contiguous")
    if norm_weight is not None and z is None:
        raise ValueError("the gated output norm needs z (the g_proj output)")
    tuned_bv, tuned_warps = config_for(t)
    block_v, num_warps = block_v or min(tuned_bv, d), num_warps or tuned_warps
    if d & (d - 1) or d % block_v or block_v & (block_v - 1):
        raise ValueError(f"D={d} and block_v={block_v} must be powers of two with block_v dividing D")
    o_acc, count = _workspace(q.device, h, d)
    if out is None:
        out = torch.empty(t, c, device=q.device, dtype=q.dtype if norm_weight is not None else torch.float32)
    if stage is None:
        stage_state = stage_conv = state  # never touched: STAGE is off
    else:
        stage_state, stage_conv = stage
        if stage_state.shape[0] < t or stage_state.shape[1:] != state.shape or stage_state.dtype != torch.float32:
            raise ValueError(f"stage state must be fp32 [>=T, H, D, D], got {tuple(stage_state.shape)}")
        if stage_conv.shape[0] < t or stage_conv.shape[1:] != conv_state.shape:
            raise ValueError(f"stage conv must be [>=T, 3, C, 3], got {tuple(stage_conv.shape)}")
        if not (stage_state.is_contiguous() and stage_conv.is_contiguous()):
            raise ValueError("stage buffers must be contiguous")
    kwargs = {"launch_pdl": True} if pdl and q.is_cuda else {}
    _kda_step_kernel[(h, d // block_v)](
        q, k, v, f, b, z if z is not None else q,
        _row_stride(q, "q"), _row_stride(k, "k"), _row_stride(v, "v"), _row_stride(f, "f"), _row_stride(b, "b"),
        _row_stride(z, "z") if z is not None else 0,
        conv_state, conv_weight, a_log, dt_bias, norm_weight if norm_weight is not None else a_log, state,
        out, _row_stride(out, "out"), o_acc, count, stage_state, stage_conv,
        d ** -0.5, float(lower_bound), float(eps),
        T=t, H=h, D=d, BV=block_v, BT=triton.next_power_of_2(t),
        STAGE=stage is not None, NORM=norm_weight is not None, USE_PDL=bool(kwargs),
        num_warps=num_warps, **kwargs,
    )
    return out


def kda_step_reference(q, k, v, f, b, z, conv_state, conv_weight, a_log, dt_bias, norm_weight, state, *,
                       lower_bound: float, eps: float = 1e-6, stage=None, out=None) -> torch.Tensor:
    """The same step from lingls.kernels.reference (the model's own math), with the same in-place contract."""
    t, c = q.shape
    h, d = state.shape[0], state.shape[-1]
    ys, convs = [], []
    for i, x in enumerate((q, k, v)):
        y, _ = ref.causal_conv_silu(x[None], conv_weight[i], conv_state[i][None])
        ys.append(y[0].view(t, h, d))
        ext = torch.cat([conv_state[i], x.t().to(conv_state.dtype)], dim=-1)  # [C, 3 + T]
        convs.append(torch.stack([ext[:, s + 1: s + CONV_KERNEL] for s in range(t)]))  # window after each token
    qn = ref.l2_normalize(ys[0].float()) * d ** -0.5
    kn = ref.l2_normalize(ys[1].float())
    g = ref.kda_gate(f.view(t, h, d), a_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b.float())
    s, os_, states = state.float()[None], [], []
    for i in range(t):
        o, s = ref.kda_recurrent(qn[None, i:i + 1], kn[None, i:i + 1], ys[2][None, i:i + 1], g[None, i:i + 1],
                                 beta[None, i:i + 1], s)
        os_.append(o[0, 0])
        states.append(s[0])
    o = torch.stack(os_)  # [T, H, D] fp32
    if norm_weight is not None:
        o = ref.gated_rms_norm(o, norm_weight, z.view(t, h, d), eps).to(q.dtype)
    o = o.reshape(t, c)
    conv_after = torch.stack(convs, dim=1)  # [T, 3, C, 3]
    if stage is None:
        state.copy_(states[-1])
        conv_state.copy_(conv_after[-1])
    else:
        stage[0][:t].copy_(torch.stack(states))
        stage[1][:t].copy_(conv_after)
    if out is None:
        return o
    return out.copy_(o)


def kda_step(q, k, v, f, b, z, conv_state, conv_weight, a_log, dt_bias, norm_weight, state, *,
             lower_bound: float, eps: float = 1e-6, stage=None, out=None, pdl: bool = False,
             block_v: int | None = None) -> torch.Tensor:
    """One KDA layer step for batch 1 over T tokens: the Triton kernel on CUDA tensors, the reference otherwise.

    q, k, v, f, z: [T, C] projections (C = H*D; bf16 or fp32; rows may be strided views of one fused GEMV
    output, the last dim must be contiguous); b: [T, H] beta logits; z: the output gate (g_proj).
    conv_state: [3, C, 3] activation dtype, the last 3 projected q, k, v inputs (oldest first), updated in
    place unless staged; conv_weight: [3, C, 4] (q, k, v conv1d weights stacked, any float dtype).
    a_log: [H] fp32; dt_bias: [C] fp32; norm_weight: [D] (o_norm, shared by heads), or None for raw o.
    state: [H, D, D] fp32 (key rows, value columns), updated in place unless staged.
    lower_bound: the safe gate's bound (kda_lower_bound, -5.0); eps: o_norm's eps (rms_norm_eps).
    stage: None, or (stage_state [>=T, H, D, D] fp32, stage_conv [>=T, 3, C, 3]) to receive the state after
    every token instead of updating the live ones (speculative verify; then `commit`).
    Returns out [T, C]: RMSNorm_D(o) * norm_weight * sigmoid(z) per head in q's dtype, or o in fp32 when
    norm_weight is None. T = 1..MAX_TOKENS. pdl: launch with programmatic dependent launch (CUDA graphs too).
    """
    if q.is_cuda:
        return fused_kda_step(q, k, v, f, b, z, conv_state, conv_weight, a_log, dt_bias, norm_weight, state,
                              lower_bound=lower_bound, eps=eps, stage=stage, out=out, pdl=pdl, block_v=block_v)
    return kda_step_reference(q, k, v, f, b, z, conv_state, conv_weight, a_log, dt_bias, norm_weight, state,
                              lower_bound=lower_bound, eps=eps, stage=stage, out=out)


# ---------------------------------------------------------------------------------------------------------
# Commit a staged position


@_jit
def _commit_kernel(index_ptr, live_a, staged_a, live_b, staged_b, NA, NB, T_STAGE,
                   BLOCK: tl.constexpr, BLOCKS_A: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (layer, block): copies staged[layer, index, block] -> live[layer, block] for two tensor pairs
    (the first BLOCKS_A blocks copy pair a, the rest pair b), so one launch commits state and conv state."""
    layer = tl.program_id(0)
    blk = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    idx = tl.load(index_ptr).to(tl.int64)
    layer = layer.to(tl.int64)
    if blk < BLOCKS_A:
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        m = offs < NA
        tl.store(live_a + layer * NA + offs, tl.load(staged_a + (layer * T_STAGE + idx) * NA + offs, mask=m), mask=m)
    else:
        offs = (blk - BLOCKS_A) * BLOCK + tl.arange(0, BLOCK)
        m = offs < NB
        tl.store(live_b + layer * NB + offs, tl.load(staged_b + (layer * T_STAGE + idx) * NB + offs, mask=m), mask=m)


def _check_staged(live, staged, what):
    if staged.dim() != live.dim() + 1 or staged.shape[0] != live.shape[0] or staged.shape[2:] != live.shape[1:]:
        raise ValueError(f"{what}: staged {tuple(staged.shape)} must be [L, T, ...] over live [L, ...] {tuple(live.shape)}")
    if staged.dtype != live.dtype or not (live.is_contiguous() and staged.is_contiguous()):
        raise ValueError(f"{what}: staged and live must be contiguous and of one dtype")


def fused_commit(index, state, stage_state, conv_state, stage_conv, *, pdl: bool = False) -> None:
    """The Triton commit (one launch for the recurrent and conv states of every layer). Arguments as `commit`."""
    _check_staged(state, stage_state, "state")
    _check_staged(conv_state, stage_conv, "conv")
    if state.shape[0] != conv_state.shape[0] or stage_state.shape[1] != stage_conv.shape[1]:
        raise ValueError("state and conv must have the same layers and staged positions")
    na, nb = state[0].numel(), conv_state[0].numel()
    block = 4096
    blocks_a = triton.cdiv(na, block)
    kwargs = {"launch_pdl": True} if pdl and state.is_cuda else {}
    _commit_kernel[(state.shape[0], blocks_a + triton.cdiv(nb, block))](
        index, state, stage_state, conv_state, stage_conv, na, nb, stage_state.shape[1],
        BLOCK=block, BLOCKS_A=blocks_a, USE_PDL=bool(kwargs), num_warps=4, **kwargs)


def commit_reference(index, state, stage_state, conv_state, stage_conv) -> None:
    """The same copy in torch (index stays a tensor, so this does not sync either)."""
    for live, staged in ((state, stage_state), (conv_state, stage_conv)):
        live.copy_(staged.index_select(1, index.reshape(1).long()).squeeze(1))


def commit(index, state, stage_state, conv_state, stage_conv, *, pdl: bool = False) -> None:
    """Make the staged position `index` live: state <- stage_state[index], conv_state <- stage_conv[index].

    index: int tensor with one element on the states' device, the accepted position in [0, T) (accepted tokens
    minus one); never read on the host. state: [L, H, D, D] fp32 with stage_state [L, T, H, D, D]; conv_state:
    [L, 3, C, 3] with stage_conv [L, T, 3, C, 3]; L is the number of layers (index one layer with [None]).
    """
    if state.is_cuda:
        return fused_commit(index, state, stage_state, conv_state, stage_conv, pdl=pdl)
    return commit_reference(index, state, stage_state, conv_state, stage_conv)
