"""The DSpark draft round's own kernels (`lingls.model.dspark`, `speculative.DSparkRuntime`), each with its
plain-torch reference.

A round is one forward of a B-row block (B = 8) through 5 small attention layers, then B Markov-corrected
choices. Its projections are the package's skinny GEMMs (`gemv`) and its norms `norm`'s; what is DSpark's own:
- `block_qk_rope`: the per-head RMSNorm of q and k (q_norm, k_norm), NeoX RoPE of both, the block's keys and
  values written into the drafter's context cache at rows pos..pos+B-1 (those rows are past every committed
  position, so no context row is lost: the next verify rewrites them), the queries to a buffer: one launch
  where torch took ~20.
- `block_attend`: the B queries of every head against cache rows [0, pos + B): the context before the block
  and the block itself, bidirectionally, the same key range for every query. A split-sequence (flash-decoding)
  kernel: programs (kv head, key range) write partial softmax sums, a second launch merges them, so all SMs
  stream the cache (one program per head would leave most of them idle at 8 heads).
- `markov_choose`: one slot's choice: logits row + markov_w2 @ markov_w1[prev] over this rank's vocabulary
  shard, reduced to the greedy token in the same launch (packed keys, last program to arrive decides; under
  tensor parallelism it writes `argmax_rows`' exchange message instead), prev read on the device (the anchor,
  the previous slot's choice, or under tensor parallelism the previous slot's all-reduced message, decided
  here and its token written to the drafts), so the B choices are B launches (+ one pick under TP) and no
  host read. Each launch asks L2 to keep its markov_w2 tile for the next slot (evict_last).
Streams requested ahead (`prefetch_l2`, GPU only): the attention's programs, their keys done, ask L2 for the
layer's o_proj, gate|up and down weights.
Loop trip counts are compile-time constants (`gemv`'s note on the interpreter); key ranges past pos + B are
masked.
"""

from __future__ import annotations

import math

import torch

from lingls.kernels import jit, tl, triton
from lingls.kernels import reference as ref
from lingls.kernels.gemv import gemv_reference
from lingls.kernels.pdl import mode as pdl_mode
from lingls.kernels.pdl import wait_previous
from lingls.kernels.sampling import picked
from lingls.kernels.shared import INTERPRET, NO_KEY, counters, key_index, key_value, make_key, mma, sm_count

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

ATTEND_BLOCK_N = 64  # keys per tile
# Two programs per SM: a program's tile loop is a chain of dependent steps (the tile's loads, q k^T, the online
# softmax's reductions, p v), so one program per SM left the cache streaming at ~2.6 TB/s (12.7 us per layer for
# 33.6 MB at 8k context, 120 programs: bench/results/spec_flash_dspark.json before this); at the TP=4 shapes a
# program takes 71,680 bytes of shared memory and 116 registers per thread, so two reside together.
ATTEND_PROGRAMS_PER_SM = 2
# The attention's programs, their keys done, request into L2 the weights of the kernels after it (`block_attend`'s
# then: the layer's o_proj, gate|up and down)
ATTEND_PREFETCH_THEN = True
MARKOV_TILE = 16384  # markov_w2 elements per program of `markov_choose` (64 rows at rank 256)
_LOG2E = 1.4426950408889634


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the lines of `ptrs` (`prefetch.global.L2`: nothing comes back to the program, nothing waits).
    GPU only (inline PTX): the interpreter's launches never reach it.

    One H200, TP=4 shard, the draft round with one setting changed (bench/spec_flash_gpu.py --dspark-sweep):
    the attention's programs asking, their keys done, for the layer's o_proj, gate|up and down weights took the
    round from 0.363 to 0.360 ms (spec_flash_dspark_sweep.json; 0.378 -> 0.374 in
    spec_flash_dspark_prefetch.json, timed after a profile). Asked for before a kernel's PDL wait, the
    attention's cache rows and the q|k|v kernel's weights made it slower (0.374 ms with both, 0.361 without the
    first, 0.368 without the second: spec_flash_dspark_prefetch.json)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@jit
def _prefetch_share(ptr, lines, program, PER: tl.constexpr):
    """`prefetch_l2` of lines [program * PER, (program + 1) * PER) (below `lines`) of the buffer at ptr."""
    PER_LINE: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth
    i = program * PER + tl.arange(0, PER)
    prefetch_l2(ptr + i.to(tl.int64) * PER_LINE, i < lines)


# ---- q/k norm + rope + cache write ------------------------------------------------------------------------------
@jit
def _qk_rope_kernel(qkv_ptr, qn_ptr, kn_ptr, freq_ptr, pos_ptr, q_ptr, ck_ptr, cv_ptr, s_qkv, s_cache, eps,
                    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr):
    """Program (slot, head): head < H a query head (normed, rotated, to q), else key head head - H (normed,
    rotated, to the cache's key row pos + slot) with its value head copied to the value row."""
    slot = tl.program_id(0)
    head = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF)
    is_q = head < H
    kv = tl.maximum(head - H, 0)
    row = qkv_ptr + slot * s_qkv + head * D
    x1 = tl.load(row + i).to(tl.float32)
    x2 = tl.load(row + HALF + i).to(tl.float32)
    r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    w1 = tl.where(is_q, tl.load(qn_ptr + i), tl.load(kn_ptr + i)).to(tl.float32)
    w2 = tl.where(is_q, tl.load(qn_ptr + HALF + i), tl.load(kn_ptr + HALF + i)).to(tl.float32)
    n1 = (x1 * r) * w1
    n2 = (x2 * r) * w2
    pos = tl.load(pos_ptr) + slot
    angle = pos.to(tl.float32) * tl.load(freq_ptr + i)
    c = tl.cos(angle)
    s = tl.sin(angle)
    y1 = n1 * c - n2 * s
    y2 = n2 * c + n1 * s
    q_row = q_ptr + (slot * H + tl.minimum(head, H - 1)) * D
    tl.store(q_row + i, y1.to(q_ptr.dtype.element_ty), mask=is_q & (i >= 0))
    tl.store(q_row + HALF + i, y2.to(q_ptr.dtype.element_ty), mask=is_q & (i >= 0))
    k_row = ck_ptr + pos * s_cache + kv * D
    is_k = (head >= H) & (i >= 0)
    tl.store(k_row + i, y1.to(ck_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_row + HALF + i, y2.to(ck_ptr.dtype.element_ty), mask=is_k)
    v_src = qkv_ptr + slot * s_qkv + (H + KVH + kv) * D
    v_row = cv_ptr + pos * s_cache + kv * D
    tl.store(v_row + i, tl.load(v_src + i, mask=is_k), mask=is_k)
    tl.store(v_row + HALF + i, tl.load(v_src + HALF + i, mask=is_k), mask=is_k)


def block_qk_rope_reference(qkv, q_norm, k_norm, inv_freq, pos, cache_k, cache_v, heads: int, kv_heads: int,
                            eps: float) -> torch.Tensor:
    """The definition: qkv [B, (H + 2 KVH) D] -> queries [B, H, D] (RMSNorm by q_norm, NeoX RoPE at
    pos + slot); keys likewise by k_norm and values into cache_k / cache_v [S, KVH, D] at rows pos + slot."""
    b = qkv.shape[0]
    d = q_norm.shape[0]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    positions = pos + torch.arange(b, device=qkv.device)
    ang = positions.float()[:, None] * inv_freq
    cos, sin = ang.cos(), ang.sin()

    def norm_rope(x, w, n):
        x = x.float().unflatten(-1, (n, d))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        return ref.apply_rope(x, cos, sin, interleave=False, heads=True)

    cache_k.index_copy_(0, positions, norm_rope(k, k_norm, kv_heads).to(cache_k.dtype))
    cache_v.index_copy_(0, positions, v.unflatten(-1, (kv_heads, d)).to(cache_v.dtype))
    return norm_rope(q, q_norm, heads).to(qkv.dtype)


def block_qk_rope(qkv, q_norm, k_norm, inv_freq, pos, cache_k, cache_v, heads: int, kv_heads: int, eps: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """One launch of `_qk_rope_kernel` (CUDA, or CPU under TRITON_INTERPRET=1); arguments as the reference.
    cache_k / cache_v: one layer's [S, KVH, D] views with contiguous rows."""
    b = qkv.shape[0]
    d = q_norm.shape[0]
    assert _pow2(d) and d >= 2 and qkv.stride(1) == 1 and cache_k.stride() == cache_v.stride()
    assert cache_k.stride(1) == d and cache_k.stride(2) == 1
    # heads = 0 (context rows: keys and values only) still passes a real buffer: an empty tensor's null pointer
    q = torch.empty(b, max(heads, 1), d, dtype=qkv.dtype, device=qkv.device) if out is None else out
    _qk_rope_kernel[(b, heads + kv_heads)](qkv, q_norm, k_norm, inv_freq, pos, q, cache_k, cache_v, qkv.stride(0),
                                           cache_k.stride(0), float(eps), H=heads, KVH=kv_heads, D=d, num_warps=1)
    return q[:, :heads]


# ---- q|k|v GEMV + q/k norm + rope + cache write ----------------------------------------------------------------
QKV_BLOCK_K = 128  # K columns per descriptor load


@jit
def _qkv_rope_kernel(x_desc, w_desc, qn_ptr, kn_ptr, freq_ptr, pos_ptr, q_ptr, ck_ptr, cv_ptr, part_ptr, cnt_ptr,
                     T, K_PER, s_cache, eps, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                     BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
                     F32_DOT: tl.constexpr):
    """Program (head, K range): W's rows of one head (query heads, then key heads, then value heads) times x's
    rows over the K range, as `gemv`'s descriptor path (W's [D, BLOCK_K] and x's [16, BLOCK_K] tiles through the
    tensor memory accelerator, the product W x^T), its fp32 partial [16, D] to part; the last program of the
    head to arrive sums the partials (in split order), rounds them to the activations' dtype as the GEMV's
    output would be, and finishes the head as `_qk_rope_kernel` does: a query head normed, rotated, to q; a key
    head to the cache's key rows pos + row; a value head copied to the value rows."""
    head = tl.program_id(0)
    sp = tl.program_id(1)
    HEADS: tl.constexpr = H + 2 * KVH
    HALF: tl.constexpr = D // 2
    acc = tl.zeros((D, 16), tl.float32)
    wait_previous(USE_PDL)
    for it in range(K_ITERS):
        kk = sp * K_PER + it * BLOCK_K
        acc = mma(acc, w_desc.load([head * D, kk]), tl.trans(x_desc.load([0, kk])), F32_DOT)
    rt = tl.arange(0, 16)
    d = tl.arange(0, D)
    tl.store(part_ptr + (sp * HEADS + head) * 16 * D + rt[:, None] * D + d[None, :], tl.trans(acc))
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + head, 1, sem="acq_rel")
    if arrived == SPLIT - 1:
        i = tl.arange(0, HALF)
        x1 = tl.zeros((16, HALF), tl.float32)
        x2 = tl.zeros((16, HALF), tl.float32)
        for s in tl.static_range(SPLIT):
            row = part_ptr + (s * HEADS + head) * 16 * D + rt[:, None] * D
            x1 += tl.load(row + i[None, :], cache_modifier=".cg")
            x2 += tl.load(row + HALF + i[None, :], cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + head, 0)
        dt = q_ptr.dtype.element_ty  # x's: the projection's rounding, the queries'
        x1 = x1.to(dt).to(tl.float32)
        x2 = x2.to(dt).to(tl.float32)
        live = (rt < T)[:, None] & (i >= 0)[None, :]
        pos = tl.load(pos_ptr) + rt
        if head < H + KVH:
            is_q = head < H
            r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
            w1 = tl.where(is_q, tl.load(qn_ptr + i), tl.load(kn_ptr + i)).to(tl.float32)
            w2 = tl.where(is_q, tl.load(qn_ptr + HALF + i), tl.load(kn_ptr + HALF + i)).to(tl.float32)
            n1 = (x1 * r[:, None]) * w1[None, :]
            n2 = (x2 * r[:, None]) * w2[None, :]
            angle = pos.to(tl.float32)[:, None] * tl.load(freq_ptr + i)[None, :]
            c = tl.cos(angle)
            s_ = tl.sin(angle)
            y1 = n1 * c - n2 * s_
            y2 = n2 * c + n1 * s_
            if is_q:
                dst = q_ptr + (rt[:, None] * H + head) * D + i[None, :]
                tl.store(dst, y1.to(dt), mask=live)
                tl.store(dst + HALF, y2.to(dt), mask=live)
            else:
                dst = ck_ptr + pos[:, None] * s_cache + (head - H) * D + i[None, :]
                tl.store(dst, y1.to(ck_ptr.dtype.element_ty), mask=live)
                tl.store(dst + HALF, y2.to(ck_ptr.dtype.element_ty), mask=live)
        else:
            dst = cv_ptr + pos[:, None] * s_cache + (head - H - KVH) * D + i[None, :]
            tl.store(dst, x1.to(cv_ptr.dtype.element_ty), mask=live)
            tl.store(dst + HALF, x2.to(cv_ptr.dtype.element_ty), mask=live)


def block_qkv_rope_reference(x, w, q_norm, k_norm, inv_freq, pos, cache_k, cache_v, heads: int, kv_heads: int,
                             eps: float) -> torch.Tensor:
    """The definition: the q|k|v projection x [T, K] @ w^T (w: [(H + 2 KVH) D, K], heads joined in that order),
    rounded to x's dtype, then `block_qk_rope_reference`."""
    return block_qk_rope_reference(gemv_reference(x, w), q_norm, k_norm, inv_freq, pos, cache_k, cache_v, heads,
                                   kv_heads, eps)


def block_qkv_rope(x, w, q_norm, k_norm, inv_freq, pos, cache_k, cache_v, heads: int, kv_heads: int, eps: float,
                   split: int | None = None, pdl: bool = False) -> torch.Tensor:
    """One launch of `_qkv_rope_kernel` (CUDA, or CPU under TRITON_INTERPRET=1); arguments as the reference
    (T <= 16 rows). Where `gemv` and `block_qk_rope` took two launches and a round trip of the projection.
    split: K ranges per head (default: about one program per SM over the heads); pdl: programmatic dependent
    launch (the launch overlaps the previous kernel's end)."""
    t, k = x.shape
    d = q_norm.shape[0]
    heads_all = heads + 2 * kv_heads
    assert t <= 16 and _pow2(d) and d >= 16 and w.shape == (heads_all * d, k)
    assert x.stride(1) == 1 and w.stride(1) == 1 and cache_k.stride() == cache_v.stride()
    assert cache_k.stride(1) == d and cache_k.stride(2) == 1
    block_k = min(QKV_BLOCK_K, max(16, triton.next_power_of_2(k)))
    tiles = triton.cdiv(k, block_k)
    split = max(1, min(tiles, split or sm_count(x.device) // heads_all))
    k_per = triton.cdiv(tiles, split) * block_k
    split = triton.cdiv(k, k_per)
    q = torch.empty(t, max(heads, 1), d, dtype=x.dtype, device=x.device)
    part = torch.empty(split * heads_all * 16 * d, dtype=torch.float32, device=x.device)
    launch = {"launch_pdl": True} if pdl and x.is_cuda else {}
    _qkv_rope_kernel[(heads_all, split)](
        TensorDescriptor.from_tensor(x, [16, block_k]), TensorDescriptor.from_tensor(w, [d, block_k]), q_norm, k_norm,
        inv_freq, pos, q, cache_k, cache_v, part, counters(x.device, heads_all), t, k_per, cache_k.stride(0),
        float(eps), H=heads, KVH=kv_heads, D=d, BLOCK_K=block_k, K_ITERS=k_per // block_k, SPLIT=split,
        USE_PDL=pdl_mode(bool(launch), "qkv_rope", t), F32_DOT=INTERPRET, num_warps=4, num_stages=4, **launch)
    return q[:, :heads]


# ---- block attention -------------------------------------------------------------------------------------------
@jit
def _attend_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, po_ptr, pml_ptr, s_kv, scale_log2, then0_ptr, then0_lines,
                   then1_ptr, then1_lines, then2_ptr, then2_lines,
                   B: tl.constexpr, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_N: tl.constexpr, TILES: tl.constexpr, THEN0: tl.constexpr, THEN1: tl.constexpr,
                   THEN2: tl.constexpr, F32_DOT: tl.constexpr):
    """Program (kv head g, split): its G query heads x B slots (row r = head_in_group * B + slot, padded to
    ROWS >= 16 for the MMA) against keys [split * TILES * BLOCK_N, +TILES * BLOCK_N) below pos + B; the
    partial output, running max and sum to po [split, g, ROWS, D] and pml [split, g, 2, ROWS] (fp32).

    THEN0..2 > 0: once its keys are done, the program asks L2 for its share (that many 128-byte lines, a power
    of two) of up to three weights the kernels after it read (then*_ptr, then*_lines lines in all): the layer's
    o_proj, gate|up and down, which then stream from L2 while the merge and the GEMVs before them run."""
    g = tl.program_id(0)
    sp = tl.program_id(1)
    KVH: tl.constexpr = H // G
    r = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    live = r < G * B
    head = g * G + r // B
    slot = r % B
    q = tl.load(q_ptr + (slot * H + head)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    limit = tl.load(pos_ptr) + B
    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for t in range(TILES):
        n = (sp * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = n < limit
        offs = n[:, None] * s_kv + g * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0)
        s = mma(tl.zeros([ROWS, BLOCK_N], tl.float32), q, tl.trans(k), F32_DOT) * scale_log2
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(acc * alpha[:, None], p.to(v.dtype), v, F32_DOT)
        m_i = m_new
    part = (sp * KVH + g) * ROWS
    tl.store(po_ptr + (part + r)[:, None] * D + d[None, :], acc)
    tl.store(pml_ptr + part * 2 + r, m_i)
    tl.store(pml_ptr + part * 2 + ROWS + r, l_i)
    program = sp * KVH + g
    if THEN0:
        _prefetch_share(then0_ptr, then0_lines, program, THEN0)
    if THEN1:
        _prefetch_share(then1_ptr, then1_lines, program, THEN1)
    if THEN2:
        _prefetch_share(then2_ptr, then2_lines, program, THEN2)


@jit
def _merge_kernel(po_ptr, pml_ptr, o_ptr, B: tl.constexpr, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                  ROWS: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Program (slot, head): the splits' partial sums merged into o [B, H * D]."""
    slot = tl.program_id(0)
    head = tl.program_id(1)
    KVH: tl.constexpr = H // G
    g = head // G
    r = (head % G) * B + slot
    sp = tl.arange(0, SPLITS_PAD)
    ok = sp < SPLITS
    part = (sp * KVH + g) * ROWS
    m = tl.load(pml_ptr + part * 2 + r, mask=ok, other=-1.0e30)
    l_s = tl.load(pml_ptr + part * 2 + ROWS + r, mask=ok, other=0.0)
    w = tl.where(ok, tl.exp2(m - tl.max(m, axis=0)), 0.0)
    d = tl.arange(0, D)
    o = tl.load(po_ptr + (part + r)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(o_ptr + slot * H * D + head * D + d, o.to(o_ptr.dtype.element_ty))


def block_attend_reference(q, cache_k, cache_v, pos, kv_len: int, then: tuple = ()) -> torch.Tensor:
    """The definition: queries q [B, H, D] against cache rows [0, kv_len) of cache_k / cache_v [S, KVH, D], each
    query seeing the rows below pos + B (GQA: query head h reads kv head h // (H / KVH)); softmax scale
    1/sqrt(D). Returns [B, H * D] in q's dtype. then: the kernel's prefetch hint, nothing here."""
    b, h, _ = q.shape
    kvh = cache_k.shape[1]
    keys, vals = cache_k[:kv_len].transpose(0, 1), cache_v[:kv_len].transpose(0, 1)
    visible = (torch.arange(kv_len, device=q.device) < pos + b).expand(b, kv_len)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), keys.to(q.dtype), vals.to(q.dtype),
                                                         attn_mask=visible, enable_gqa=h != kvh)
    return o.transpose(0, 1).flatten(-2)


def attend_plan(kv_len: int, kv_heads: int, device: torch.device) -> tuple[int, int]:
    """(splits, tiles per split): about ATTEND_PROGRAMS_PER_SM programs per SM over the kv heads, each a whole
    number of tiles."""
    tiles = triton.cdiv(kv_len, ATTEND_BLOCK_N)
    want = max(1, min(tiles, ATTEND_PROGRAMS_PER_SM * sm_count(device) // kv_heads))
    per = triton.cdiv(tiles, want)
    return triton.cdiv(tiles, per), per


def block_attend(q, cache_k, cache_v, pos, kv_len: int, then: tuple = ()) -> torch.Tensor:
    """Two launches (`_attend_kernel`, `_merge_kernel`); arguments as the reference. kv_len: the rows the
    program grid covers (static per captured graph), at least pos + B. then: up to three weights the kernels
    after this one read, requested into L2 by the attention's programs when their keys are done (with
    ATTEND_PREFETCH_THEN)."""
    b, h, d = q.shape
    kvh = cache_k.shape[1]
    g = h // kvh
    assert _pow2(d) and d >= 16 and cache_k.stride() == cache_v.stride() and cache_k.stride(2) == 1
    rows = max(16, triton.next_power_of_2(g * b))
    splits, tiles = attend_plan(kv_len, kvh, q.device)
    po = torch.empty(splits * kvh * rows * d, dtype=torch.float32, device=q.device)
    pml = torch.empty(splits * kvh * 2 * rows, dtype=torch.float32, device=q.device)
    assert len(then) <= 3 and all(w.is_contiguous() for w in then)
    then = list(then) if q.is_cuda and ATTEND_PREFETCH_THEN and not INTERPRET else []
    lines = [triton.cdiv(w.numel() * w.element_size(), 128) for w in then]
    per = [triton.next_power_of_2(triton.cdiv(n, kvh * splits)) for n in lines]
    args = [x for w, n in zip(then, lines) for x in (w, n)] + [po, 0] * (3 - len(then))
    _attend_kernel[(kvh, splits)](q, cache_k, cache_v, pos, po, pml, cache_k.stride(0), _LOG2E / math.sqrt(d), *args,
                                  B=b, H=h, G=g, D=d, ROWS=rows, BLOCK_N=ATTEND_BLOCK_N, TILES=tiles,
                                  THEN0=(per + [0] * 3)[0], THEN1=(per + [0] * 3)[1], THEN2=(per + [0] * 3)[2],
                                  F32_DOT=INTERPRET, num_warps=4)
    o = torch.empty(b, h * d, dtype=q.dtype, device=q.device)
    _merge_kernel[(b, h)](po, pml, o, B=b, H=h, G=g, D=d, ROWS=rows, SPLITS=splits,
                          SPLITS_PAD=max(2, triton.next_power_of_2(splits)), num_warps=1)
    return o


# ---- Markov-corrected choice -----------------------------------------------------------------------------------
@jit
def _markov_choose_kernel(logits_ptr, prev_ptr, w1_ptr, w2_ptr, part_ptr, cnt_ptr, out_ptr, prev_out_ptr, V, offset,
                          rank, R: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, NB_PAD: tl.constexpr,
                          RANKS: tl.constexpr, PREV_MSG: tl.constexpr):
    """Program block: logits[blk] + markov_w2[blk] @ markov_w1[prev] (each rounded to the logits' dtype, as the
    torch form adds them), its best packed key into part; the last program to arrive writes the token to out
    (RANKS == 1) or the exchange message [2, RANKS, 1] (`sampling.argmax_rows`). prev: a token [1], or with
    PREV_MSG the previous slot's summed exchange message, whose token program 0 also writes to prev_out.
    The markov_w2 tile is requested first (it depends on nothing) and kept in L2 (evict_last): the round's B
    choices read the same shard one after another. One H200, TP=4 shard (spec_flash_dspark_markov_ab.json in
    bench/results): the round 0.356-0.357 ms as here, 0.358-0.359 launched with PDL (the tile requested before
    the wait), 0.360-0.361 without evict_last: a launch takes ~8 us either way, latency rather than bytes. At
    the TP=4 shapes ptxas gives it 96 registers per thread (the sm_90 compile test): 5 programs per SM, the
    614 in one wave. Folding the programs' keys into one int64 cell by atomic max instead of the last arrival's
    614-key reduction made the round slower (0.361-0.362 against 0.354-0.356 ms with the attention's weight
    requests and the attention under PDL, which the same run's sweep puts at -3 and +1 us:
    spec_flash_dspark_sweep.json and spec_flash_dspark_base.json in bench/results)."""
    blk = tl.program_id(0)
    k = tl.arange(0, R)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < V
    w = tl.load(w2_ptr + offs[:, None] * R + k[None, :], mask=m[:, None], other=0.0, eviction_policy="evict_last")
    if PREV_MSG:
        prev = picked(prev_ptr, 0, 1, RANKS)
        if blk == 0:
            tl.store(prev_out_ptr, prev)
    else:
        prev = tl.load(prev_ptr)
    e = tl.load(w1_ptr + prev * R + k).to(tl.float32)
    dt = logits_ptr.dtype.element_ty
    bias = tl.sum(w.to(tl.float32) * e[None, :], axis=1).to(dt).to(tl.float32)
    x = (tl.load(logits_ptr + offs, mask=m, other=0.0).to(tl.float32) + bias).to(dt).to(tl.float32)
    best = tl.max(tl.where(m, make_key(x, offs, 2 ** 31), NO_KEY), axis=0)
    tl.store(part_ptr + blk, best)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if arrived == NB - 1:
        j = tl.arange(0, NB_PAD)
        keys = tl.load(part_ptr + j, mask=j < NB, other=NO_KEY, cache_modifier=".cg")
        key = tl.max(keys, axis=0)
        token = key_index(key, 2 ** 31).to(tl.int64) + offset
        if RANKS == 1:
            tl.store(out_ptr, token)
        else:
            slot = tl.arange(0, RANKS)
            mine = slot == rank
            tl.store(out_ptr + slot, tl.where(mine, key_value(key), 0.0))
            tl.store(out_ptr + RANKS + slot, tl.where(mine, token.to(tl.float32), 0.0))
        tl.atomic_xchg(cnt_ptr, 0)


def markov_corrected_reference(logits_row, prev, w1, w2) -> torch.Tensor:
    """The definition: logits_row [1, V_local] + markov_w2(markov_w1[prev]) [1, V_local], in the logits' dtype."""
    return logits_row + (w1[prev].to(w2.dtype) @ w2.t()).to(logits_row.dtype)


def markov_choose(logits_row, prev, w1, w2, rank: int = 0, ranks: int = 1, out: torch.Tensor | None = None,
                  prev_out: torch.Tensor | None = None):
    """One launch: the greedy token [1] int64 after the Markov correction of logits_row [1, V_local] (this
    rank's vocabulary shard) by prev, or, with ranks > 1, the exchange message [2, ranks, 1] fp32 that
    `runtime.sampling.argmax_shards` all-reduces and `sampling.pick_rows` decides.

    prev: the previous token [1] int64 (device), or the previous slot's all-reduced exchange message
    [2, ranks, 1], decided here as `pick_rows` would, its token written to prev_out [1] int64 (required then):
    so a round of B choices under tensor parallelism is B launches and B all-reduces, and one `pick_rows` for
    the last, each token written once into the drafts buffer."""
    v = logits_row.shape[-1]
    r = w1.shape[1]
    assert _pow2(r) and w2.shape == (v, r) and w1.is_contiguous() and w2.is_contiguous() and logits_row.stride(-1) == 1
    assert _pow2(ranks)
    prev_msg = prev.dtype == torch.float32
    assert not prev_msg or (prev.shape == (2, ranks, 1) and prev.is_contiguous() and prev_out is not None)
    block = max(16, MARKOV_TILE // r)
    nb = triton.cdiv(v, block)
    if out is None:
        out = torch.empty((2, ranks, 1) if ranks > 1 else (1,), dtype=torch.float32 if ranks > 1 else torch.int64,
                          device=logits_row.device)
    part = torch.empty(nb, dtype=torch.int64, device=logits_row.device)
    _markov_choose_kernel[(nb,)](logits_row, prev, w1, w2, part, counters(logits_row.device, 1), out,
                                 prev_out if prev_msg else out, v, rank * v, rank, R=r, BLOCK=block, NB=nb,
                                 NB_PAD=triton.next_power_of_2(nb), RANKS=ranks, PREV_MSG=prev_msg, num_warps=4)
    return out
