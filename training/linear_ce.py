"""Mean cross-entropy of `h @ weight.T` against targets, computed in row chunks without keeping the logits.

The training step's eager form (`lm_head(h)`, `.float()`, `F.cross_entropy`) materialises the logits twice per
head (bf16, then fp32: [batch x 2048, 8192], 1 GB + 2 GB at batch 32) and keeps them for the backward, and the
model has two heads (next token, MTP). Here each chunk of rows computes its logits in fp32, their log-sum-exp,
the loss and, at once, the gradients with respect to h and weight (softmax minus one-hot, over the row count);
only those gradients are kept. The backward then only scales them by the incoming gradient. The same function
as `F.cross_entropy(F.linear(h, weight).float(), targets)` (tests/nano/test_train_step.py checks values and both
gradients against it).

A chunk's passes over its fp32 logits ([8192, 8192]: 268 MB) were six in eager torch (the log-sum-exp, the
subtraction, exp, the one-hot's scatter, the division, the cast to bf16), ~20 ms of a 160 ms training step on the
H200 at batch 64 (its profile: an fp32 elementwise kernel 12.7 ms and exp 8.1 ms, 64 launches each).
`compile_chunks` (the compiled training step turns it on) compiles `chunk_loss_and_grad` so that they are a
reduction and one elementwise pass that writes the bf16 gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ROWS = 8192  # 8192 x 8192-token logits in fp32: 268 MB per chunk


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 a @ b: for bf16 operands (CUDA autocast) one GEMM with fp32 output, without rounding to bf16 between."""
    if a.is_cuda and a.dtype == torch.bfloat16:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, n: int, dtype: torch.dtype):
    """(sum over the chunk's rows of their cross-entropy, (softmax - one-hot) / n in `dtype`) of fp32 logits
    [rows, vocab] against targets [rows]; n: the rows of the whole batch (the loss is their mean)."""
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, targets[:, None]).squeeze(1)).sum()
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    return loss, ((torch.exp(logits - lse[:, None]) - onehot.to(logits.dtype)) / n).to(dtype)


_chunk = chunk_loss_and_grad  # what a chunk runs: this function, or its compiled form (`compile_chunks`)


def compile_chunks(on: bool = True, backend: str = "inductor") -> None:
    """Run each chunk's loss and gradient through torch.compile (static shapes: a batch's chunks are one or two
    shapes), or eagerly again (on=False)."""
    global _chunk
    _chunk = torch.compile(chunk_loss_and_grad, backend=backend, dynamic=False) if on else chunk_loss_and_grad


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_rows):
        n = h.shape[0]
        w = weight.to(h.dtype) if h.is_cuda else weight
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, n, chunk_rows):
            hc, tc = h[s:s + chunk_rows], targets[s:s + chunk_rows]
            loss, g = _chunk(_product(hc, w.t()), tc, n, h.dtype)
            total += loss
            grad_h[s:s + chunk_rows] = g @ w
            grad_w += _product(g.t(), hc)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), (grad_w * grad_out).to(ctx.weight_dtype), None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """Mean over the N rows of cross_entropy(h @ weight.T, targets). h: [N, hidden] (under CUDA autocast: bf16
    operands, fp32 logits), weight: [vocab, hidden], targets: [N] int64."""
    if h.is_cuda and torch.is_autocast_enabled("cuda"):
        h = h.to(torch.get_autocast_dtype("cuda"))
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, targets, chunk_rows)
    w = weight.to(h.dtype) if h.is_cuda else weight  # no gradient wanted (an evaluation): the loss alone
    total = sum(F.cross_entropy(_product(h[s:s + chunk_rows], w.t()), targets[s:s + chunk_rows], reduction="sum")
                for s in range(0, h.shape[0], chunk_rows))
    return total / h.shape[0]
