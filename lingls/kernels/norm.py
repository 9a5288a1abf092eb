"""Fused residual add + RMSNorm for the batch-1 step.

Every layer does `h = h + attn_out; x = RMSNorm(h)` twice (before attention and before the MLP), and the step
ends with one more before lm_head. In torch that is an add, a pass for the mean of squares and one for the
scale: three launches and three trips through memory for a [T, 2560] row. Here it is one launch per call that
reads x, the residual and the weight once and writes the new residual (in place) and the normed row.

The residual stays in the activation dtype (bf16), exactly as the model's `h + a` does: the sum is formed in
fp32, rounded once to the residual's dtype, and the norm reads that rounded sum, so the kernel reproduces the
torch form bit for bit rather than a more precise fp32 stream that would drift from the reference model.

Two more kernels each replace launches that ran one after another: the step's embedding lookup and its first
norm (`fused_embed_rms_norm`), and the MTP layer's input, its embedding rows and three norms (`fused_mtp_input`).

The KDA output norm (RMSNorm per head times sigmoid(z)) is not here: it is fused into the KDA step kernel
(lingls.kernels.kda), which saves one launch per KDA layer.
"""

from __future__ import annotations

import torch

from lingls.kernels import jit, tl, triton
from lingls.kernels import reference as ref
from lingls.kernels.pdl import mode as pdl_mode
from lingls.kernels.pdl import wait_previous

NUM_WARPS = 8  # one row of 2560 per program; the fused all-reduce kernel uses the same, for the same sum order


@jit
def add_rms_norm_row(x, r_ptr, w, out_ptr, offs, m, N, eps, HAS_RESIDUAL: tl.constexpr):
    """One row's arithmetic: h = x + r (rounded to r's dtype, written back to r), out = w * (h / rms(h)).
    Shared with the peer all-reduce's fused kernel, which must produce the same bits."""
    h = x
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs, mask=m, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(r_ptr.dtype.element_ty)
        tl.store(r_ptr + offs, h, mask=m)
    tl.store(out_ptr + offs, rms_norm_row(h, w, N, eps).to(out_ptr.dtype.element_ty), mask=m)


@jit
def rms_norm_row(h, w, N, eps):
    """w * h / rms(h) in fp32 (w fp32; h's lanes past N are 0), the normed row rounded to h's dtype before the
    weight multiply, as the reference rounds it."""
    hf = h.to(tl.float32)
    rms = tl.rsqrt(tl.sum(hf * hf, 0) / N + eps)
    return w * (hf * rms).to(h.dtype).to(tl.float32)


@jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sx, sr, so, N, eps,
                         BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per row (`add_rms_norm_row`)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)  # a weight: safe before the previous kernel ends
    wait_previous(USE_PDL)
    x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0)
    add_rms_norm_row(x, r_ptr + row * sr, w, out_ptr + row * so, offs, m, N, eps, HAS_RESIDUAL)


def fused_add_rms_norm(x, residual, weight, eps: float, *, out=None, pdl: bool = False, num_warps: int = NUM_WARPS):
    """The Triton form (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). Arguments as `add_rms_norm`."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, N] with contiguous rows, got {tuple(x.shape)}")
    t, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"residual must match x ({tuple(x.shape)} {x.dtype}), "
                         f"got {tuple(residual.shape)} {residual.dtype}")
    if out is None:
        out = torch.empty(t, n, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    r = residual if residual is not None else x
    kwargs = {"launch_pdl": True} if pdl and x.is_cuda else {}
    _add_rms_norm_kernel[(t,)](x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), n, float(eps),
                               BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
                               USE_PDL=pdl_mode(bool(kwargs), "norm", t), num_warps=num_warps, **kwargs)
    return out, r


@jit
def _embedding_row(ids_ptr, table_ptr, row, offs, m, N):
    """The table's row for token ids[row] (lanes past N are 0)."""
    token = tl.load(ids_ptr + row).to(tl.int64)
    return tl.load(table_ptr + token * N + offs, mask=m, other=0.0)


@jit
def _embed_rms_norm_kernel(ids_ptr, table_ptr, w_ptr, res_ptr, out_ptr, N, eps, BLOCK: tl.constexpr,
                           USE_PDL: tl.constexpr):
    """One program per row: the embedding row table[ids[row]] to res[row] (the residual stream) and its norm to
    out[row]."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    wait_previous(USE_PDL)
    x = _embedding_row(ids_ptr, table_ptr, row, offs, m, N)
    tl.store(res_ptr + row * N + offs, x, mask=m)
    tl.store(out_ptr + row * N + offs, rms_norm_row(x, w, N, eps).to(out_ptr.dtype.element_ty), mask=m)


@jit
def _mtp_input_kernel(ids_ptr, table_ptr, h_ptr, we_ptr, wf_ptr, wh_ptr, out_ptr, sh, so, N, eps,
                      BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row, half): half 0 writes enorm(table[ids[row]]) to out[row, :N], half 1 hnorm(norm(h[row])) to
    out[row, N:], each norm's output rounded to out's dtype as a norm launch would write it."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    dtype = out_ptr.dtype.element_ty
    if tl.program_id(1) == 0:
        w = tl.load(we_ptr + offs, mask=m, other=0.0).to(tl.float32)
        wait_previous(USE_PDL)
        x = _embedding_row(ids_ptr, table_ptr, row, offs, m, N)
        tl.store(out_ptr + row * so + offs, rms_norm_row(x, w, N, eps).to(dtype), mask=m)
    else:
        wf = tl.load(wf_ptr + offs, mask=m, other=0.0).to(tl.float32)
        wh = tl.load(wh_ptr + offs, mask=m, other=0.0).to(tl.float32)
        wait_previous(USE_PDL)
        x = tl.load(h_ptr + row * sh + offs, mask=m, other=0.0)
        y = rms_norm_row(x, wf, N, eps).to(dtype)
        tl.store(out_ptr + row * so + N + offs, rms_norm_row(y, wh, N, eps).to(dtype), mask=m)


def fused_embed_rms_norm(ids, table, weight, eps: float, *, pdl: bool = False, num_warps: int = NUM_WARPS):
    """The Triton form of `embed_rms_norm_reference` (CUDA tensors, or CPU under TRITON_INTERPRET=1): the step's
    embedding lookup and its first norm in one launch, where they were two."""
    if ids.dim() != 1 or table.dim() != 2 or not table.is_contiguous() or weight.shape != (table.shape[1],):
        raise ValueError(f"ids [T] into a contiguous table [V, N] with weight [N], got {tuple(ids.shape)}, "
                         f"{tuple(table.shape)}, {tuple(weight.shape)}")
    t, n = ids.shape[0], table.shape[1]
    ids = ids.contiguous()
    residual = torch.empty(t, n, device=table.device, dtype=table.dtype)
    out = torch.empty(t, n, device=table.device, dtype=torch.promote_types(weight.dtype, table.dtype))
    kwargs = {"launch_pdl": True} if pdl and table.is_cuda else {}
    _embed_rms_norm_kernel[(t,)](ids, table, weight, residual, out, n, float(eps), BLOCK=triton.next_power_of_2(n),
                                 USE_PDL=pdl_mode(bool(kwargs), "norm", t), num_warps=num_warps, **kwargs)
    return out, residual


def embed_rms_norm_reference(ids, table, weight, eps: float):
    """(rms_norm(table[ids]), table[ids]): a step's first norm and the residual stream it starts."""
    residual = table.index_select(0, ids)
    return ref.rms_norm(residual, weight, eps), residual


def fused_mtp_input(ids, table, h, enorm, final_norm, hnorm, eps: float, *, pdl: bool = False,
                    num_warps: int = NUM_WARPS):
    """The Triton form of `mtp_input_reference` (CUDA tensors, or CPU under TRITON_INTERPRET=1): one launch for
    the embedding rows and the three norms, where the launches one after another were four (each a hop of the
    draft step's chain)."""
    t, n = h.shape
    ids = ids.contiguous()
    if ids.shape != (t,) or table.shape[1] != n or h.stride(1) != 1 or not table.is_contiguous():
        raise ValueError(f"ids [{t}] into a contiguous table [V, {n}] and h [{t}, {n}], got {tuple(ids.shape)}, "
                         f"{tuple(table.shape)}, {tuple(h.shape)}")
    if len({table.dtype, h.dtype, enorm.dtype, final_norm.dtype, hnorm.dtype}) != 1:
        raise ValueError("the MTP input's table, hidden states and norm weights must share one dtype")
    out = torch.empty(t, 2 * n, device=h.device, dtype=h.dtype)
    kwargs = {"launch_pdl": True} if pdl and h.is_cuda else {}
    _mtp_input_kernel[(t, 2)](ids, table, h, enorm, final_norm, hnorm, out, h.stride(0), out.stride(0), n,
                              float(eps), BLOCK=triton.next_power_of_2(n), USE_PDL=pdl_mode(bool(kwargs), "norm", t),
                              num_warps=num_warps, **kwargs)
    return out


def mtp_input_reference(ids, table, h, enorm, final_norm, hnorm, eps: float):
    """The MTP layer's input [T, 2N] before eh_proj: [enorm(table[ids]); hnorm(final_norm(h))], each norm as the
    model computes it (`reference.rms_norm`)."""
    emb = ref.rms_norm(table.index_select(0, ids), enorm, eps)
    return torch.cat([emb, ref.rms_norm(ref.rms_norm(h, final_norm, eps), hnorm, eps)], dim=-1)


def add_rms_norm_reference(x, residual, weight, eps: float, *, out=None):
    """The torch form: the model's `h = h + a` then `rms_norm(h)`, with the same in-place contract."""
    if residual is not None:
        residual.copy_(residual + x)
    h = residual if residual is not None else x
    y = ref.rms_norm(h, weight, eps)
    return (y if out is None else out.copy_(y)), h


def add_rms_norm(x, residual, weight, eps: float, *, out=None, pdl: bool = False):
    """(normed, new_residual) for rows x [T, N].

    residual: [T, N] of x's dtype, updated in place to residual + x and returned as new_residual; or None,
    meaning x is the residual stream itself (the first layer's input norm), returned unchanged.
    weight: [N]; normed: [T, N] in promote(weight, x) dtype (bf16 for the checkpoint), = rms_norm(new_residual).
    The Triton kernel on CUDA tensors, the reference otherwise. pdl: programmatic dependent launch.
    """
    if x.is_cuda:
        return fused_add_rms_norm(x, residual, weight, eps, out=out, pdl=pdl)
    return add_rms_norm_reference(x, residual, weight, eps, out=out)
