"""Skinny bf16 GEMM for batch-1 decode and verify: y = x @ W^T with T <= 16 rows, fp32 accumulation.

At T <= 16 a projection is a pass over W and nothing else: the arithmetic is free and the time is the bytes of
W over the memory bandwidth, if enough of them are in flight. So the kernel is laid out for streaming: each
program owns a block of W's rows (BLOCK_N) and walks a range of its columns (the K dimension) in BLOCK_K tiles,
multiplying them with the whole x tile on the tensor cores (x is padded to 16 rows, the smallest MMA shape;
the padding costs no memory traffic). For one token the `FMA` path skips the tensor cores: a program requests
all of its W tiles at once, before it waits for the previous kernel (they never depend on it), straight into
registers, multiplies them with x on the FMA units into a [BLOCK_N, BLOCK_K] fp32 tile, and reduces that over K
once at the end (no shared-memory staging or operand shuffles for an MMA whose 15 other rows are padding).
Loaded inside the K loop instead, each tile had waited a memory round trip of its own. For verify steps the
`TMA` path (`_gemv_tma_kernel`) streams W and x through tensor-memory-accelerator descriptors into shared memory
and multiplies W x^T on Hopper's warpgroup MMA (W's rows as the tall operand): the register-tile loop reached
a third of the copy rate on its own at TP=4 (bench/results/ncu_step_tp4_t9.json). When N is small there
are too few row blocks to keep every SM streaming, so K is split too (split-K): each program writes an fp32
partial, bumps the row block's counter, and the program that arrives last sums the partials in a fixed order
(deterministic), applies the epilogue and writes y. One launch either way; the counters reset themselves, so
CUDA-graph replays need no memset.

Epilogues fused here because the model needs them right after a projection:
- `residual`: y = x @ W^T + residual (o_proj / down_proj straight into the residual stream, at TP=1).
- `swiglu`: W holds [gate rows; up rows] (2N x K, gate first, as the checkpoint's gate_up stacking), and
  y = swiglu(x Wg^T, x Wu^T) with Ling's optional clamp; gate and up of a column live in the same program.

The MMA, the arrival counters and the SM count are `kernels.shared`'s; the tile loads and products here are
also the MoE experts' (`kernels.moe`).
"""

from __future__ import annotations

import torch

from lingls.kernels import jit, tl, triton, tuned
from lingls.kernels import reference as ref
from lingls.kernels.pdl import mode as pdl_mode
from lingls.kernels.pdl import wait_previous
from lingls.kernels.shared import INTERPRET, counters, mma, sm_count

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

# Loop trip counts are compile-time constants in this package's kernels (shapes are fixed per captured graph):
# Triton 3.6's interpreter cannot run a loop with a run-time bound under NumPy >= 2.4.
MAX_T = 16  # rows handled by one MMA tile; decode (T=1) and verify (T<=16)


@jit
def swiglu_act(gate, up, limit):
    """silu(gate) * up, clamped as min(silu(gate), L) * clamp(up, -L, L) when limit > 0 (fp32 in, fp32 out)."""
    act = gate * tl.sigmoid(gate)
    if limit > 0:
        act = tl.minimum(act, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return act * up


@jit
def load_w(w_ptr, rn, kk, N, K, stride_w, SWIGLU: tl.constexpr):
    """A [rows, K tile] of W (and of its up half with SWIGLU; otherwise the same tile twice, unused)."""
    wmask = (rn[:, None] < N) & (kk[None, :] < K)
    wt = tl.load(w_ptr + rn[:, None] * stride_w + kk[None, :], mask=wmask, other=0.0)
    wu = wt
    if SWIGLU:
        wu = tl.load(w_ptr + (rn[:, None] + N) * stride_w + kk[None, :], mask=wmask, other=0.0)
    return wt, wu


@jit
def load_tiles(w_ptr, rn, k_lo, N, K, stride_w, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
                SWIGLU: tl.constexpr):
    """All K_ITERS tiles of W's rows rn from column k_lo (each a `load_w` pair), requested at once. No tile
    depends on another, so a program's whole slice is in flight together; loaded inside the multiply loop,
    each tile cost a memory round trip of its own (the loop's FMAs wait for it before the next load issues)."""
    tiles = ()
    for i in tl.static_range(K_ITERS):
        tiles = tiles + (load_w(w_ptr, rn, k_lo + i * BLOCK_K + tl.arange(0, BLOCK_K), N, K, stride_w, SWIGLU),)
    return tiles


@jit
def fma_rows(x_ptr, tiles, rn, k_lo, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
              SWIGLU: tl.constexpr):
    """One token through `load_tiles`' tiles on the FMA units: [16, ROWS] fp32 sums (every row the same) for W's
    rows and their up rows. x is read in the tiles' own 2D layout (each row's copy from L1): read as a
    [BLOCK_K] vector it was moved into that layout through shared memory, two barriers per tile."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((ROWS, BLOCK_K), tl.float32)
    acc_up = tl.zeros((ROWS, BLOCK_K), tl.float32)
    for i in tl.static_range(K_ITERS):
        kk = k_lo + i * BLOCK_K + rk
        xv = tl.load(x_ptr + kk[None, :] + 0 * rn[:, None], mask=kk[None, :] < K, other=0.0).to(tl.float32)
        wt, wu = tiles[i]
        acc += wt * xv
        if SWIGLU:
            acc_up += wu * xv
    return (tl.zeros((16, ROWS), tl.float32) + tl.sum(acc, axis=1)[None, :],
            tl.zeros((16, ROWS), tl.float32) + tl.sum(acc_up, axis=1)[None, :])


@jit
def accumulate(acc, acc_up, x_ptr, wt, wu, rt, kk, T, K, stride_x, SWIGLU: tl.constexpr, F32_DOT: tl.constexpr):
    """One K tile of the T tokens on the tensor cores, into [16, rows] sums."""
    xt = tl.load(x_ptr + rt[:, None] * stride_x + kk[None, :], mask=(rt[:, None] < T) & (kk[None, :] < K), other=0.0)
    acc = mma(acc, xt, tl.trans(wt), F32_DOT)
    if SWIGLU:
        acc_up = mma(acc_up, xt, tl.trans(wu), F32_DOT)
    return acc, acc_up


@jit
def _dot_rows(x_ptr, w_ptr, wt, wu, rn, k_lo, T, N, K, stride_x, stride_w, ROWS: tl.constexpr,
              BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, SWIGLU: tl.constexpr, F32_DOT: tl.constexpr):
    """x[:T] @ W[rn]^T over the K_ITERS tiles from column k_lo on the tensor cores, (wt, wu) being the first
    tile, already loaded (callers request it before waiting on the previous kernel where they can): [16, ROWS]
    fp32 sums for W's rows (and for its up rows with SWIGLU). Triton pipelines the loop's loads into the MMA."""
    rt = tl.arange(0, 16)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((16, ROWS), tl.float32)
    acc_up = tl.zeros((16, ROWS), tl.float32)
    acc, acc_up = accumulate(acc, acc_up, x_ptr, wt, wu, rt, k_lo + rk, T, K, stride_x, SWIGLU, F32_DOT)
    for i in range(1, K_ITERS):
        kk = k_lo + i * BLOCK_K + rk
        wt, wu = load_w(w_ptr, rn, kk, N, K, stride_w, SWIGLU)
        acc, acc_up = accumulate(acc, acc_up, x_ptr, wt, wu, rt, kk, T, K, stride_x, SWIGLU, F32_DOT)
    return acc, acc_up


@jit
def rows_after_wait(x_ptr, w_ptr, rn, k_lo, T, N, K, stride_x, stride_w, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                     K_ITERS: tl.constexpr, SWIGLU: tl.constexpr, FMA: tl.constexpr, USE_PDL: tl.constexpr,
                     F32_DOT: tl.constexpr):
    """x[:T] @ W[rn]^T (and its up rows with SWIGLU) in a kernel that follows another: W is requested before
    waiting for the previous kernel (PDL: weights never depend on it), at one token the program's whole slice
    (`load_tiles`, `fma_rows`), else the first tile (`_dot_rows` pipelines the rest into the MMA); x after."""
    if FMA:
        tiles = load_tiles(w_ptr, rn, k_lo, N, K, stride_w, BLOCK_K, K_ITERS, SWIGLU)
    else:
        wt, wu = load_w(w_ptr, rn, k_lo + tl.arange(0, BLOCK_K), N, K, stride_w, SWIGLU)
    wait_previous(USE_PDL)
    if FMA:
        acc, acc_up = fma_rows(x_ptr, tiles, rn, k_lo, K, ROWS, BLOCK_K, K_ITERS, SWIGLU)
    else:
        acc, acc_up = _dot_rows(x_ptr, w_ptr, wt, wu, rn, k_lo, T, N, K, stride_x, stride_w, ROWS, BLOCK_K, K_ITERS,
                                SWIGLU, F32_DOT)
    return acc, acc_up


@jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, part_ptr, cnt_ptr,
                 T, N, K, K_PER, stride_x, stride_w, stride_o, stride_r, limit,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, SPLIT_K: tl.constexpr,
                 SWIGLU: tl.constexpr, HAS_RES: tl.constexpr, FMA: tl.constexpr, USE_PDL: tl.constexpr,
                 F32_DOT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rt = tl.arange(0, 16)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_k * K_PER  # the last range may run past K: its tail is masked, never read
    acc, acc_up = rows_after_wait(x_ptr, w_ptr, rn, k_lo, T, N, K, stride_x, stride_w, BLOCK_N, BLOCK_K, K_ITERS,
                                   SWIGLU, FMA, USE_PDL, F32_DOT)
    _finish(acc, acc_up, out_ptr, res_ptr, part_ptr, cnt_ptr, pid_n, pid_k, rt, rn, T, N, stride_o, stride_r, limit,
            BLOCK_N, SPLIT_K, SWIGLU, HAS_RES)


@jit
def _gemv_tma_kernel(x_desc, w_desc, out_ptr, res_ptr, part_ptr, cnt_ptr,
                     T, N, K_PER, stride_o, stride_r, limit,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, SPLIT_K: tl.constexpr,
                     SWIGLU: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr, F32_DOT: tl.constexpr):
    """Verify steps (T > 1) with the operands swapped: W's [BLOCK_N, BLOCK_K] tiles (and x's [16, BLOCK_K], its
    rows past T zero-filled) come through the tensor memory accelerator into shared memory, and the product
    is W x^T, BLOCK_N rows tall: Hopper's warpgroup MMA (`wgmma`) reads both from shared memory while the next
    tiles stream in (Triton pipelines the descriptor loads), where the register-tile path runs `mma.sync`
    with 16 token rows. The split-K finish and epilogue are `_gemv_kernel`'s."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rt = tl.arange(0, 16)
    n0 = pid_n * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    k_lo = pid_k * K_PER
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    acc_up = tl.zeros((BLOCK_N, 16), tl.float32)
    wait_previous(USE_PDL)
    for i in range(K_ITERS):
        kk = k_lo + i * BLOCK_K
        xt = tl.trans(x_desc.load([0, kk]))
        acc = mma(acc, w_desc.load([n0, kk]), xt, F32_DOT)
        if SWIGLU:
            acc_up = mma(acc_up, w_desc.load([n0 + N, kk]), xt, F32_DOT)
    _finish(tl.trans(acc), tl.trans(acc_up), out_ptr, res_ptr, part_ptr, cnt_ptr, pid_n, pid_k, rt, rn, T, N, stride_o,
            stride_r, limit, BLOCK_N, SPLIT_K, SWIGLU, HAS_RES)


@jit
def _finish(acc, acc_up, out_ptr, res_ptr, part_ptr, cnt_ptr, pid_n, pid_k, rt, rn, T, N, stride_o, stride_r, limit,
            BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, SWIGLU: tl.constexpr, HAS_RES: tl.constexpr):
    """A program's [16, BLOCK_N] sums to y: directly, or with split-K through the row block's partials."""
    if SPLIT_K > 1:
        # Publish this K range's partial, then let the last arriving program of the row block finish it.
        n_parts: tl.constexpr = 2 if SWIGLU else 1
        pofs = rt[:, None] * N + rn[None, :]
        pmask = (rt[:, None] < T) & (rn[None, :] < N)
        part = part_ptr + pid_k * (n_parts * 16 * N)
        tl.store(part + pofs, acc, mask=pmask)
        if SWIGLU:
            tl.store(part + 16 * N + pofs, acc_up, mask=pmask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((16, BLOCK_N), tl.float32)
            acc_up = tl.zeros((16, BLOCK_N), tl.float32)
            for s in tl.static_range(SPLIT_K):
                part = part_ptr + s * (n_parts * 16 * N)
                acc += tl.load(part + pofs, mask=pmask, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    acc_up += tl.load(part + 16 * N + pofs, mask=pmask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
            _gemv_epilogue(acc, acc_up, out_ptr, res_ptr, rt, rn, T, N, stride_o, stride_r, limit, SWIGLU, HAS_RES)
    else:
        _gemv_epilogue(acc, acc_up, out_ptr, res_ptr, rt, rn, T, N, stride_o, stride_r, limit, SWIGLU, HAS_RES)


@jit
def _gemv_epilogue(acc, acc_up, out_ptr, res_ptr, rt, rn, T, N, stride_o, stride_r, limit,
                   SWIGLU: tl.constexpr, HAS_RES: tl.constexpr):
    mask = (rt[:, None] < T) & (rn[None, :] < N)
    y = acc
    if SWIGLU:
        y = swiglu_act(acc, acc_up, limit)
    if HAS_RES:
        y += tl.load(res_ptr + rt[:, None] * stride_r + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rt[:, None] * stride_o + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _plan(n: int, k: int, device: torch.device, block_n: int | None, split_k: int | None, block_k: int):
    """Row block and K split: enough programs for ~2 waves over the SMs, each K range at least one tile."""
    block_n = block_n or (64 if n >= 64 * 4 * sm_count(device) else 32 if n >= 32 * sm_count(device) else 16)
    if split_k is None:
        split_k, blocks = 1, triton.cdiv(n, block_n)
        while blocks * split_k < 2 * sm_count(device) and k // (2 * split_k) >= block_k:
            split_k *= 2
    k_per = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return block_n, triton.cdiv(k, k_per), k_per


# Launch settings measured best per shape (N, K, swiglu, T bucket: 1 for decode, 16 for verify steps), from
# tuned.json (bench/tune_gpu.py times the candidates); shapes not listed take `_plan`'s choice. One row through a
# shape not listed (a head over a vocabulary shard whose rows per rank a vocabulary list decides) takes the setting
# every tuned one-token shape took, for K up to the 3,072 the tuned shapes span. `_plan`'s default is the
# tensor-core path.
ONE_ROW = dict(block_n=8, block_k=256, num_warps=4, num_stages=3, fma=True)
ONE_ROW_MAX_K = 3072
CONFIGS: dict[tuple[int, int, bool, int], dict] = tuned("gemv")


def gemv(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, swiglu: bool = False,
         limit: float = 0.0, out: torch.Tensor | None = None, block_n: int | None = None,
         split_k: int | None = None, block_k: int | None = None, num_warps: int | None = None,
         num_stages: int | None = None, fma: bool | None = None, tma: bool | None = None,
         pdl: bool = False) -> torch.Tensor:
    """y = x @ w^T (+ residual), or swiglu over w's [gate; up] row halves; one launch.

    x: [T, K] bf16 (T <= 16, last dim contiguous); w: [N, K] bf16 row-major, or [2N, K] with swiglu=True;
    residual: [T, N] or None. Returns [T, N] in x's dtype (or written into `out`). fp32 accumulation; the
    epilogue math is fp32 and rounds once. The launch settings come from `CONFIGS` for tuned shapes, else
    from `_plan`; arguments override both (benchmarks). `fma` (T=1 only) takes the FMA-unit path, `tma` (T > 1,
    16-bit operands) the descriptor-load, warpgroup-MMA path (`_gemv_tma_kernel`). `pdl`: programmatic dependent
    launch (CUDA): the launch and the first weight tile overlap the previous kernel.
    """
    t, k = x.shape
    assert 1 <= t <= MAX_T, f"gemv handles 1..{MAX_T} rows, got {t}"
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    tuned = CONFIGS.get((n, k, swiglu, 1 if t == 1 else 16)) or (ONE_ROW if t == 1 and k <= ONE_ROW_MAX_K else {})
    block_n, split_k = block_n or tuned.get("block_n"), split_k or tuned.get("split_k")
    block_k = block_k or tuned.get("block_k", 256)
    num_warps, num_stages = num_warps or tuned.get("num_warps", 4), num_stages or tuned.get("num_stages", 3)
    fma = t == 1 and (tuned.get("fma", False) if fma is None else fma)
    tma = t > 1 and (tuned.get("tma", False) if tma is None else tma) and _descriptors_fit(x, w)
    out = torch.empty(t, n, dtype=x.dtype, device=x.device) if out is None else out
    block_n, split, k_per = _plan(n, k, x.device, block_n, split_k, block_k)
    blocks = triton.cdiv(n, block_n)
    part = torch.empty(split * (2 if swiglu else 1) * 16 * n if split > 1 else 1, dtype=torch.float32, device=x.device)
    res = residual if residual is not None else out
    launch = {"launch_pdl": True} if pdl and x.is_cuda else {}
    if tma:
        _gemv_tma_kernel[(blocks, split)](
            TensorDescriptor.from_tensor(x, [16, block_k]), TensorDescriptor.from_tensor(w, [block_n, block_k]),
            out, res, part, counters(x.device, blocks), t, n, k_per, out.stride(0), res.stride(0), float(limit),
            BLOCK_N=block_n, BLOCK_K=block_k, K_ITERS=k_per // block_k, SPLIT_K=split, SWIGLU=swiglu,
            HAS_RES=residual is not None, USE_PDL=pdl_mode(bool(launch), "gemv", t), F32_DOT=INTERPRET,
            num_warps=num_warps, num_stages=num_stages, **launch)
        return out
    _gemv_kernel[(blocks, split)](
        x, w, out, res, part, counters(x.device, blocks), t, n, k, k_per,
        x.stride(0), w.stride(0), out.stride(0), res.stride(0), float(limit),
        BLOCK_N=block_n, BLOCK_K=block_k, K_ITERS=k_per // block_k, SPLIT_K=split, SWIGLU=swiglu,
        HAS_RES=residual is not None, FMA=fma, USE_PDL=pdl_mode(bool(launch), "gemv", t), F32_DOT=INTERPRET,
        num_warps=num_warps, num_stages=num_stages, **launch)
    return out


def _descriptors_fit(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Tensor-memory-accelerator descriptors need 16-bit operands (the warpgroup MMA's bf16/fp16) on 16-byte
    aligned addresses and row strides."""
    return all(a.dtype in (torch.bfloat16, torch.float16) and a.data_ptr() % 16 == 0
               and a.stride(0) * a.element_size() % 16 == 0 for a in (x, w))


def gemv_reference(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, swiglu: bool = False,
                   limit: float = 0.0) -> torch.Tensor:
    """The definition: fp32 products of the bf16 inputs, epilogue in fp32, one rounding to x's dtype."""
    y = x.float() @ w.float().t()
    if swiglu:
        n = w.shape[0] // 2
        y = ref.swiglu(y[:, :n], y[:, n:], limit)
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, swiglu: bool = False,
           limit: float = 0.0) -> torch.Tensor:
    """Dispatcher: the kernel for CUDA tensors with at most 16 rows, the reference otherwise."""
    if x.is_cuda and x.shape[0] <= MAX_T:
        return gemv(x, w, residual, swiglu, limit)
    return gemv_reference(x, w, residual, swiglu, limit)
