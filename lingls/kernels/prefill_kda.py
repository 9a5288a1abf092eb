"""The elementwise work around a KDA layer's chunked recurrence in a prefill, as three launches instead of ~40.

Per KDA layer a prefill step projects q, k, v, f, g and b (GEMMs), then, in torch, ran about forty elementwise
launches over [T, heads * 128] rows: three causal convolutions with SiLU (concatenating the conv state in
front of each input), the L2 norms of q and k, the decay gate, beta, the padding mask, the conv states taken at
the prompt's end, and after the recurrence the gated RMSNorm of its output. Here:
- `prologue`: one program per head and block of tokens: the three convolutions (taps before the first token read the
  conv state), SiLU, q and k normalised (q scaled by d^-0.5), the gate g (per channel) and beta (per head),
  both zero at padded tokens (`valid`), as the recurrence takes them (g and beta fp32; q, k and v in the
  dtype asked for: `recurrence_dtype`);
- `conv_states`: the K-1 inputs before position `end` of each of q, k and v (the new conv state);
- `gated_norm`: RMSNorm of each head's output times sigmoid(gate), rounded once to the activation dtype.
Each rounds where the torch form rounds (the convolution's and SiLU's outputs to the activation dtype), so the
results agree to the last bit of those roundings. `KimiDeltaAttention.forward` is the reference.

A program of `prologue` takes one head of `BLOCK[0]` tokens (`BLOCK[1]` warps), one of `gated_norm` `NORM_BLOCK[0]`.
One token a program (the first form) re-read the conv weights, dt_bias and the gate constants for every token: as
many bytes as the token's own inputs, over 65,536 one-warp programs a layer at 8,192 tokens of a TP=4 rank. A cold
8,192-token prefill on an H200 (`lingls bench prefix --profile`): these three kernels 5.00 ms over 35 layers with
16 tokens a program, 9.76 ms with one. Then the prologue alone at a TP=4 rank's shapes (8,192 tokens, 8 heads; one
H100, graph replays; its bytes take 51.7 us at the copy rate): 122.5 us with 16 tokens and 4 warps; 113.2 us once a
block whose taps all fall on inputs (every block but the first) skips the conv state's addresses, masks and selects
(`_conv_silu_inner`); with that, 103.7 / 83.4 / 101.1 / 79.0 us at (16, 2) / (8, 2) / (8, 1) / (4, 1) tokens and
warps, 103.1 and 142.4 at (32, 4) and (32, 8). The output norm is at its bytes' time with 16 tokens and 4 warps.
"""

from __future__ import annotations

import torch

from lingls.kernels import jit, tl, triton

BLOCK = (4, 1)  # (tokens of one head per program, warps) of `prologue`
NORM_BLOCK = (16, 4)  # the same of `gated_norm`
# q, k and v enter the chunked recurrence in the activation dtype (bf16 in a bf16 model), as SGLang's KDA prefill
# hands fla-core's chunk_kda the short convolution's outputs, where fp32 copies made fla's intra-chunk and output
# stages run tf32 products over twice the bytes; the gate, beta and the state stay fp32. True: fp32 (the form
# before: 103.6 against 92.1 ms for a cold 8,192-token prefill of a TP=4 rank on an H200, docs/kernel-log.md).
FP32_INPUTS = False


def recurrence_dtype(activation: torch.dtype) -> torch.dtype:
    """The dtype of q, k and v handed to a prefill's chunked recurrence (`FP32_INPUTS`)."""
    return torch.float32 if FP32_INPUTS else activation

if triton is not None:
    @jit
    def _conv_silu(x_ptr, sx, state_ptr, w_ptr, t, tmask, cols, K: tl.constexpr, BT: tl.constexpr,
                   D: tl.constexpr):
        """silu(depthwise causal conv) of tokens t [BT] at channels `cols` [D], rounded as torch rounds (the conv
        output and the SiLU output to x's dtype); returned in fp32 [BT, D]. state [C, K-1]: the inputs before
        token 0."""
        acc = tl.zeros((BT, D), tl.float32)
        for k in tl.static_range(K):
            src = t - (K - 1) + k  # ext[t + k] of the torch form: state columns first, then the inputs
            from_x = tl.load(x_ptr + tl.maximum(src, 0).to(tl.int64)[:, None] * sx + cols[None, :],
                             mask=(tmask & (src >= 0))[:, None], other=0.0)
            from_state = tl.load(state_ptr + cols[None, :] * (K - 1) + tl.maximum(src + K - 1, 0)[:, None],
                                 mask=(tmask & (src < 0))[:, None], other=0.0)
            v = tl.where((src >= 0)[:, None], from_x.to(tl.float32), from_state.to(tl.float32))
            acc += tl.load(w_ptr + cols * K + k).to(tl.float32)[None, :] * v
        y = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        return (y / (1.0 + tl.exp(-y))).to(x_ptr.dtype.element_ty).to(tl.float32)

    @jit
    def _conv_silu_inner(x_ptr, sx, w_ptr, t, tmask, cols, K: tl.constexpr, BT: tl.constexpr, D: tl.constexpr):
        """`_conv_silu` of a block whose taps all fall on inputs (its first token >= K-1): no conv state read, one
        row pointer per token and a scalar step per tap (the general form spends a 64-bit address, a masked load and
        a select per element and tap on the state's columns as well)."""
        rows = x_ptr + t.to(tl.int64)[:, None] * sx + cols[None, :]
        acc = tl.zeros((BT, D), tl.float32)
        for k in tl.static_range(K):
            v = tl.load(rows - (K - 1 - k) * sx, mask=tmask[:, None], other=0.0)
            acc += tl.load(w_ptr + cols * K + k).to(tl.float32)[None, :] * v.to(tl.float32)
        y = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        return (y / (1.0 + tl.exp(-y))).to(x_ptr.dtype.element_ty).to(tl.float32)

    @jit
    def _prologue_kernel(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, sx, sb, state_ptr, w_ptr, a_log_ptr, dt_bias_ptr,
                         valid_ptr, q_out, k_out, v_out, g_out, beta_out, T, scale, lower_bound,
                         H: tl.constexpr, D: tl.constexpr, K: tl.constexpr, HAS_VALID: tl.constexpr,
                         BLOCK_T: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.program_id(1)
        tmask = t < T
        C: tl.constexpr = H * D
        cols = h * D + tl.arange(0, D)
        out = t.to(tl.int64)[:, None] * C + cols[None, :]
        m = tmask[:, None]
        if tl.program_id(0) * BLOCK_T >= K - 1:  # every block but the first: no tap reaches the conv state
            q = _conv_silu_inner(q_ptr, sx, w_ptr, t, tmask, cols, K, BLOCK_T, D)
            k = _conv_silu_inner(k_ptr, sx, w_ptr + C * K, t, tmask, cols, K, BLOCK_T, D)
            v = _conv_silu_inner(v_ptr, sx, w_ptr + 2 * C * K, t, tmask, cols, K, BLOCK_T, D)
        else:
            q = _conv_silu(q_ptr, sx, state_ptr, w_ptr, t, tmask, cols, K, BLOCK_T, D)
            k = _conv_silu(k_ptr, sx, state_ptr + C * (K - 1), w_ptr + C * K, t, tmask, cols, K, BLOCK_T, D)
            v = _conv_silu(v_ptr, sx, state_ptr + 2 * C * (K - 1), w_ptr + 2 * C * K, t, tmask, cols, K, BLOCK_T,
                           D)
        qkv = q_out.dtype.element_ty
        tl.store(q_out + out, (q / tl.sqrt(tl.sum(q * q, 1) + 1e-6)[:, None] * scale).to(qkv), mask=m)
        tl.store(k_out + out, (k / tl.sqrt(tl.sum(k * k, 1) + 1e-6)[:, None]).to(qkv), mask=m)
        tl.store(v_out + out, v.to(qkv), mask=m)
        x = tl.load(f_ptr + t.to(tl.int64)[:, None] * sx + cols[None, :], mask=m, other=0.0).to(tl.float32) \
            + tl.load(dt_bias_ptr + cols)[None, :]
        g = lower_bound * tl.sigmoid(tl.exp(tl.load(a_log_ptr + h)) * x)  # the safe (bounded) gate
        beta = tl.sigmoid(tl.load(b_ptr + t.to(tl.int64) * sb + h, mask=tmask, other=0.0).to(tl.float32))
        if HAS_VALID:
            keep = tl.load(valid_ptr + t, mask=tmask, other=0).to(tl.float32)
            g = g * keep[:, None]
            beta = beta * keep
        tl.store(g_out + out, g, mask=m)
        tl.store(beta_out + t * H + h, beta, mask=tmask)

    @jit
    def _state_rows(x_ptr, sx, state_ptr, new_ptr, end, cols, m, K: tl.constexpr):
        """new[c, j] = ext[c, end + j] of one convolution: its input at end + j - (K-1), or the old state's column
        end + j where that lies before the first input."""
        for j in tl.static_range(K - 1):
            src = end + j - (K - 1)
            from_x = tl.load(x_ptr + tl.maximum(src, 0).to(tl.int64) * sx + cols, mask=m & (src >= 0), other=0.0)
            from_state = tl.load(state_ptr + cols * (K - 1) + tl.minimum(end + j, K - 2), mask=m & (src < 0),
                                 other=0.0)
            tl.store(new_ptr + cols * (K - 1) + j, tl.where(src >= 0, from_x, from_state), mask=m)

    @jit
    def _conv_state_kernel(q_ptr, k_ptr, v_ptr, sx, state_ptr, end_ptr, new_ptr, C: tl.constexpr,
                           K: tl.constexpr, BLOCK: tl.constexpr):
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = cols < C
        end = tl.load(end_ptr + tl.program_id(1))
        new_ptr += tl.program_id(1) * 3 * C * (K - 1)
        _state_rows(q_ptr, sx, state_ptr, new_ptr, end, cols, m, K)
        _state_rows(k_ptr, sx, state_ptr + C * (K - 1), new_ptr + C * (K - 1), end, cols, m, K)
        _state_rows(v_ptr, sx, state_ptr + 2 * C * (K - 1), new_ptr + 2 * C * (K - 1), end, cols, m, K)

    @jit
    def _gated_norm_kernel(o_ptr, gate_ptr, sg, w_ptr, out_ptr, T, eps, H: tl.constexpr, D: tl.constexpr,
                           BLOCK_T: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.program_id(1)
        m = (t < T)[:, None]
        d = tl.arange(0, D)
        rows = t.to(tl.int64)[:, None]
        o = tl.load(o_ptr + rows * H * D + h * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        o = o * tl.rsqrt(tl.sum(o * o, 1) / D + eps)[:, None] * tl.load(w_ptr + d).to(tl.float32)[None, :]
        gate = tl.sigmoid(tl.load(gate_ptr + rows * sg + h * D + d[None, :], mask=m, other=0.0).to(tl.float32))
        tl.store(out_ptr + rows * H * D + h * D + d[None, :], (o * gate).to(out_ptr.dtype.element_ty), mask=m)

def prologue(q, k, v, f, b, conv_state, conv_w, a_log, dt_bias, valid, lower_bound: float,
             dtype: torch.dtype = torch.float32):
    """q, k, v, f: [T, H*D] projections (rows of one stride); b: [T, H]; conv_state: [3, C, K-1] (q, k, v);
    conv_w: [3, C, K]; a_log: [H]; dt_bias: [H*D]; valid: [T] bool or None; the safe gate's lower bound (the
    other gate form has no kernel). Returns the recurrence's inputs (q, k, v: [T, H, D] in `dtype`, rounded once
    from fp32; g: [T, H, D] fp32; beta: [T, H] fp32)."""
    t, c = q.shape
    h = a_log.shape[0]
    d = c // h
    if not (q.stride() == k.stride() == v.stride() == f.stride()) or q.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("q, k, v and f must share one row stride with contiguous columns")
    outs = [torch.empty(t, h, d, dtype=dt, device=q.device) for dt in (dtype, dtype, dtype, torch.float32)]
    beta = torch.empty(t, h, dtype=torch.float32, device=q.device)
    tokens, warps = BLOCK
    _prologue_kernel[(triton.cdiv(t, tokens), h)](
        q, k, v, f, b, q.stride(0), b.stride(0), conv_state.contiguous(), conv_w.contiguous(),
        a_log.float().contiguous(), dt_bias.float().contiguous(), valid if valid is not None else q, *outs, beta, t,
        float(d ** -0.5), float(lower_bound), H=h, D=d, K=conv_w.shape[-1], HAS_VALID=valid is not None,
        BLOCK_T=tokens, num_warps=warps)
    return (*outs, beta)


def conv_states(q, k, v, conv_state, end: torch.Tensor, out: torch.Tensor | None = None):
    """The new conv state [3, C, K-1] after the first `end` (device scalar) of the T inputs q, k, v [T, C]; for
    ends [S], the S states after each [S, 3, C, K-1] (into `out` when given)."""
    c, km1 = conv_state.shape[-2:]
    shape = (*end.shape, 3, c, km1)
    new = torch.empty(shape, dtype=conv_state.dtype, device=q.device) if out is None else out
    assert new.shape == shape and new.is_contiguous(), (new.shape, shape)
    block = 1024
    _conv_state_kernel[(triton.cdiv(c, block), end.numel())](q, k, v, q.stride(0), conv_state.contiguous(), end, new,
                                                             C=c, K=km1 + 1, BLOCK=block, num_warps=4)
    return new


def gated_norm(o, gate, weight, eps: float, dtype):
    """RMSNorm over each head's D channels of o [T, H, D], times sigmoid(gate [T, H*D]), as [T, H*D] in dtype."""
    t, h, d = o.shape
    out = torch.empty(t, h * d, dtype=dtype, device=o.device)
    tokens, warps = NORM_BLOCK
    _gated_norm_kernel[(triton.cdiv(t, tokens), h)](o.contiguous(), gate, gate.stride(0), weight, out, t, float(eps),
                                                    H=h, D=d, BLOCK_T=tokens, num_warps=warps)
    return out
