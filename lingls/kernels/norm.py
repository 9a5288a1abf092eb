"""Fused residual add + RMSNorm for the batch-1 step.

Every layer does `h = h + attn_out; x = RMSNorm(h)` twice (before attention and before the MLP), and the step
ends with one more before lm_head. In torch that is an add, a pass for the mean of squares and one for the
scale: three launches and three trips through memory for a [T, 2560] row. Here it is one launch per call that
reads x, the residual and the weight once and writes the new residual (in place) and the normed row.

The residual stays in the activation dtype (bf16), exactly as the model's `h + a` does: the sum is formed in
fp32, rounded once to the residual's dtype, and the norm reads that rounded sum, so the kernel reproduces the
torch form bit for bit rather than a more precise fp32 stream that would drift from the reference model.

At one token the norm need not be a launch of its own: `defer_add_rms_norm` returns a `PreNorm`, which the
consumer kernels (`gemv.gemv`, `moe.fused_moe`) accept in place of their input rows. Each of their programs
then adds and norms the row itself (`_pre_rstd`, `_pre_cols`: the same arithmetic as `_add_rms_norm_row`), and
one program writes the new residual. A 2560-wide row is 10 KB from L2 per program, cheaper than the launch
boundary it removes (two per layer). At T > 1 every program would read T rows, so verify steps keep the launch.

The KDA output norm (RMSNorm per head times sigmoid(z)) is not here: it is fused into the KDA step kernel
(lingls.kernels.kda), which saves one launch per KDA layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lingls.kernels import reference as ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch wheels ship without Triton: the references serve there
    triton = tl = None

_jit = triton.jit if triton is not None else (lambda fn: fn)


NUM_WARPS = 8  # one row of 2560 per program; the fused all-reduce kernel uses the same, for the same sum order


@_jit
def _add_rms_norm_row(x, r_ptr, w, out_ptr, offs, m, N, eps, HAS_RESIDUAL: tl.constexpr):
    """One row's arithmetic: h = x + r (rounded to r's dtype, written back to r), out = w * (h / rms(h)).
    Shared with the peer all-reduce's fused kernel, which must produce the same bits."""
    h = x
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs, mask=m, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(r_ptr.dtype.element_ty)
        tl.store(r_ptr + offs, h, mask=m)
    hf = h.to(tl.float32)
    rms = tl.rsqrt(tl.sum(hf * hf, 0) / N + eps)
    y = (hf * rms).to(h.dtype).to(tl.float32)  # the reference rounds the normed row before the weight multiply
    tl.store(out_ptr + offs, (w * y).to(out_ptr.dtype.element_ty), mask=m)


@_jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sx, sr, so, N, eps,
                         BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per row (`_add_rms_norm_row`)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)  # a weight: safe before the previous kernel ends
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0)
    _add_rms_norm_row(x, r_ptr + row * sr, w, out_ptr + row * so, offs, m, N, eps, HAS_RESIDUAL)


@_jit
def _pre_h(src, offs, m, PRE: tl.constexpr):
    """The new residual at columns offs, for src = (residual, delta, weight) pointers: the residual itself
    (PRE == 1) or residual + delta rounded to its dtype (PRE == 2), as `_add_rms_norm_row` forms it."""
    r_ptr, d_ptr, _ = src
    h = tl.load(r_ptr + offs, mask=m, other=0.0)
    if PRE == 2:
        h = (tl.load(d_ptr + offs, mask=m, other=0.0).to(tl.float32) + h.to(tl.float32)).to(r_ptr.dtype.element_ty)
    return h


@_jit
def _pre_rstd(src, out_ptr, write, N, eps, BLOCK: tl.constexpr, PRE: tl.constexpr):
    """1 / rms of the one-token row (`_pre_h`); where `write` (one program of the consumer) and a delta was
    added, the new residual is stored to out_ptr as well."""
    offs = tl.arange(0, BLOCK)
    m = offs < N
    h = _pre_h(src, offs, m, PRE)
    if PRE == 2:
        tl.store(out_ptr + offs, h, mask=m & write)
    hf = h.to(tl.float32)
    return tl.rsqrt(tl.sum(hf * hf, 0) / N + eps)


@_jit
def _pre_cols(src, rstd, offs, m, PRE: tl.constexpr):
    """The normed row at columns offs (fp32 holding the values `_add_rms_norm_row` writes, 0 where ~m)."""
    _, _, w_ptr = src
    h = _pre_h(src, offs, m, PRE)
    y = (h.to(tl.float32) * rstd).to(h.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    return (w * y).to(h.dtype).to(tl.float32)


class PreNorm(NamedTuple):
    """rms_norm(residual + delta) * weight of one token, left to the kernels that read it (see the module note).

    `new_residual` receives residual + delta from the first consumer kernel; until one has run it holds nothing
    (`materialize` computes both where a consumer cannot take a PreNorm)."""
    delta: torch.Tensor | None  # [1, N], None: the residual is the stream itself (the first layer's input)
    residual: torch.Tensor  # [1, N]
    weight: torch.Tensor  # [N]
    eps: float
    new_residual: torch.Tensor  # [1, N]

    def kernel_args(self) -> tuple:
        """(residual, delta, weight, new residual, eps, PRE, BLOCK) for the consumer kernels."""
        delta = self.residual if self.delta is None else self.delta
        return (self.residual, delta, self.weight, self.new_residual, float(self.eps), 1 if self.delta is None else 2,
                triton.next_power_of_2(self.residual.shape[1]))


def defer_add_rms_norm(x, residual, weight, eps: float) -> tuple[PreNorm, torch.Tensor]:
    """`add_rms_norm`'s (normed, new_residual) for one token, the norm left to its consumers: the PreNorm and the
    tensor that will hold the new residual (a new one: consumer programs read the old one while one writes)."""
    if x.shape[0] != 1 or x.stride(1) != 1 or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"a deferred norm takes one contiguous row, got {tuple(x.shape)}")
    if residual is None:
        return PreNorm(None, x, weight, eps, x), x
    new = torch.empty_like(residual)
    return PreNorm(x, residual, weight, eps, new), new


def materialize(x):
    """A consumer's input rows: x itself, or a PreNorm computed (one `add_rms_norm` launch, new residual written)."""
    if not isinstance(x, PreNorm):
        return x
    if x.delta is None:
        return add_rms_norm(x.residual, None, x.weight, x.eps)[0]
    x.new_residual.copy_(x.residual)
    return add_rms_norm(x.delta, x.new_residual, x.weight, x.eps)[0]


def fused_add_rms_norm(x, residual, weight, eps: float, *, out=None, pdl: bool = False, num_warps: int = NUM_WARPS):
    """The Triton form (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). Arguments as `add_rms_norm`."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, N] with contiguous rows, got {tuple(x.shape)}")
    t, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"residual must match x ({tuple(x.shape)} {x.dtype}), got {tuple(residual.shape)} {residual.dtype}")
    if out is None:
        out = torch.empty(t, n, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    r = residual if residual is not None else x
    kwargs = {"launch_pdl": True} if pdl and x.is_cuda else {}
    _add_rms_norm_kernel[(t,)](x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), n, float(eps),
                               BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
                               USE_PDL=bool(kwargs), num_warps=num_warps, **kwargs)
    return out, r


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
