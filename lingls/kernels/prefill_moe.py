"""Routed experts of a long step (a prefill): two grouped GEMMs over the (token, expert) pairs sorted by expert.

The pairs are laid out by expert, each expert's run padded to a multiple of BLOCK_M rows, in a buffer whose size
is an upper bound known on the host (N*k + E*(BLOCK_M - 1) rows): the launch grids are fixed by that bound and
no count is read back. A program takes one BLOCK_M-row block (one expert's rows: it reads the block's expert
from a table and leaves at once where the block lies past the last expert's run) and one column tile:
- `_gate_up_kernel`: act = swiglu(x Wg^T, x Wu^T) of its rows, the x rows gathered by token, gate and up of a
  column in the same program (the checkpoint's [gate; up] stacking), Ling's optional clamp in the epilogue;
- `_down_kernel`: y = act Wd^T, written to the pair's own row (token-major, [N*k, H]), so the weighted sum over
  a token's k experts is a plain reduction afterwards, in a fixed order;
- `_combine_kernel`: that reduction, sum_j w_j * y_j in fp32 rounded once, in one pass over y (torch's upcast,
  multiply and sum wrote and read fp32 copies of y: ~2 GB a layer at 8,192 tokens).
Products round to bf16 where torch's grouped GEMM rounds them (gate and up before the activation, y before the
routing weight), so the kernels compute what `moe_prefill_reference` computes.

Where a short prompt touches every expert (1,536 tokens x 8 of 512), the whole expert shard crosses HBM once per
layer: ~1.5 GB at a TP=4 rank of Ling-3.0-flash, which bounds a layer at ~0.37 ms whatever the arithmetic.
"""

from __future__ import annotations

import torch

from lingls.kernels import jit, tl, triton
from lingls.kernels import reference as ref

BLOCK_M = 64  # rows of one expert per program: the pairs of an expert are padded to a multiple of this


def moe_prefill_reference(x, weights, idx, gate_up, down, inter: int, limit: float = 0.0):
    """The definition: sum over each token's chosen experts of weight * down(swiglu(gate x, up x)), every
    product summed in fp32 and rounded to x's dtype (as a GPU's GEMM does). x [N, H]; weights, idx [N, k];
    gate_up [E, 2I, H]; down [E, H, I]."""
    gu = torch.einsum("nh,nkoh->nko", x.float(), gate_up[idx].float()).to(x.dtype)
    act = ref.swiglu(gu[..., :inter], gu[..., inter:], limit)
    y = torch.einsum("nki,nkhi->nkh", act.float(), down[idx].float()).to(x.dtype)
    return (y.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def sort_pairs(idx: torch.Tensor, n_experts: int, block_m: int = BLOCK_M):
    """The (token, slot) pairs grouped by expert, each expert's run padded to whole blocks, on the device only.

    Returns (rows [R] int32: the pair index t*k + slot at each padded row, -1 in padding; block_expert [R / block_m]
    int32: the expert of each block, n_experts past the last run), R = N*k + E*(block_m - 1) rounded up to blocks."""
    flat = idx.flatten()
    pairs = flat.numel()
    blocks = -(-(pairs + n_experts * (block_m - 1)) // block_m)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=idx.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # not bincount: CUDA's reads the max back to the host
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # each expert's first pair in the sorted order
    order = flat.argsort(stable=True)
    expert = flat[order]
    dest = (padded_end - padded)[expert] + torch.arange(pairs, device=idx.device) - first[expert]
    rows = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=idx.device)
    rows[dest] = order.to(torch.int32)
    starts = torch.arange(blocks, device=idx.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return rows, block_expert


if triton is not None:
    @jit
    def _dot(acc, a, b, F32_DOT: tl.constexpr):
        """acc + a @ b; under the interpreter in fp32 (its bf16 dot is wrong in Triton 3.6): the same exact products."""
        if F32_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        return tl.dot(a, b, acc)

    @jit
    def _gate_up_kernel(x_ptr, w_ptr, rows_ptr, bexp_ptr, act_ptr, TOP_K: tl.constexpr, E: tl.constexpr,
                        H: tl.constexpr, INTER: tl.constexpr, LIMIT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
        b = tl.program_id(0)
        nt = tl.program_id(1)
        e = tl.load(bexp_ptr + b)
        if e < E:
            m = b * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(rows_ptr + m)
            valid = pair >= 0
            token = tl.where(valid, pair, 0) // TOP_K
            n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < INTER
            kk = tl.arange(0, BLOCK_K)
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            w_e = w_ptr + e.to(tl.int64) * (2 * INTER * H)
            for k0 in range(0, H, BLOCK_K):
                kmask = (k0 + kk) < H
                xt = tl.load(x_ptr + token[:, None].to(tl.int64) * H + k0 + kk[None, :],
                             mask=valid[:, None] & kmask[None, :], other=0.0)
                wg = tl.load(w_e + n[:, None] * H + k0 + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
                wu = tl.load(w_e + (INTER + n[:, None]) * H + k0 + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                             other=0.0)
                acc_g = _dot(acc_g, xt, tl.trans(wg), F32_DOT)
                acc_u = _dot(acc_u, xt, tl.trans(wu), F32_DOT)
            g = acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference's GEMM output
            u = acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(act_ptr.dtype.element_ty).to(tl.float32)  # silu, rounded as torch's
            if LIMIT > 0:
                s = tl.minimum(s, LIMIT)
                u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
            tl.store(act_ptr + m[:, None].to(tl.int64) * INTER + n[None, :], (s * u).to(act_ptr.dtype.element_ty),
                     mask=valid[:, None] & nmask[None, :])

    @jit
    def _down_kernel(act_ptr, w_ptr, rows_ptr, bexp_ptr, y_ptr, E: tl.constexpr, H: tl.constexpr,
                     INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     F32_DOT: tl.constexpr):
        b = tl.program_id(0)
        nt = tl.program_id(1)
        e = tl.load(bexp_ptr + b)
        if e < E:
            m = b * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(rows_ptr + m)
            valid = pair >= 0
            n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < H
            kk = tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            w_e = w_ptr + e.to(tl.int64) * (H * INTER)
            for k0 in range(0, INTER, BLOCK_K):
                kmask = (k0 + kk) < INTER
                a = tl.load(act_ptr + m[:, None].to(tl.int64) * INTER + k0 + kk[None, :],
                            mask=valid[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_e + n[:, None] * INTER + k0 + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                            other=0.0)
                acc = _dot(acc, a, tl.trans(w), F32_DOT)
            tl.store(y_ptr + tl.where(valid, pair, 0)[:, None].to(tl.int64) * H + n[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


    @jit
    def _combine_kernel(y_ptr, w_ptr, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        """out[t] = sum over j < TOP_K of w[t, j] * y[t * TOP_K + j], in fp32 in the order of j, rounded once."""
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros((BLOCK,), tl.float32)
        for j in range(TOP_K):
            w = tl.load(w_ptr + t * TOP_K + j)
            y = tl.load(y_ptr + (t * TOP_K + j).to(tl.int64) * H + cols, mask=mask, other=0.0)
            acc += w * y.to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the two kernels
GATE_UP_CONFIG = (64, 64, 4, 3)
DOWN_CONFIG = (128, 64, 4, 3)
COMBINE_BLOCK = 1024  # columns of one token's weighted sum per program


def moe_prefill_triton(x, weights, idx, gate_up, down, inter: int, limit: float = 0.0, block_m: int = BLOCK_M):
    """`moe_prefill_reference` by the two grouped kernels (any device Triton runs on; the interpreter on a CPU)."""
    from lingls.kernels.gemv import INTERPRET

    n, k = idx.shape
    n_exp, _, hidden = gate_up.shape
    rows, block_expert = sort_pairs(idx, n_exp, block_m)
    act = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = GATE_UP_CONFIG
    _gate_up_kernel[(block_expert.shape[0], triton.cdiv(inter, bn))](
        x.contiguous(), gate_up, rows, block_expert, act, TOP_K=k, E=n_exp, H=hidden, INTER=inter, LIMIT=float(limit),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, F32_DOT=INTERPRET, num_warps=warps, num_stages=stages)
    y = torch.empty(n * k, hidden, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = DOWN_CONFIG
    _down_kernel[(block_expert.shape[0], triton.cdiv(hidden, bn))](
        act, down, rows, block_expert, y, E=n_exp, H=hidden, INTER=inter, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        F32_DOT=INTERPRET, num_warps=warps, num_stages=stages)
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    _combine_kernel[(n, triton.cdiv(hidden, COMBINE_BLOCK))](y, weights.float().contiguous(), out, H=hidden, TOP_K=k,
                                                            BLOCK=COMBINE_BLOCK, num_warps=4)
    return out


def moe_prefill(x, weights, idx, gate_up, down, inter: int, limit: float = 0.0):
    """The routed experts of many tokens: the grouped kernels on CUDA with Triton, the reference elsewhere."""
    if triton is not None and x.is_cuda:
        return moe_prefill_triton(x, weights, idx, gate_up, down, inter, limit)
    return moe_prefill_reference(x, weights, idx, gate_up, down, inter, limit)
