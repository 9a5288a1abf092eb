"""L2 prefetch: a kernel of the step asks the memory for weights that a later kernel will read.

At batch 1 every kernel reads its weights once, in a burst that reaches only part of the memory bandwidth
(too few bytes in flight, then a ramp-down), and while a small kernel runs (a norm, the routing, the KDA
recurrence) the memory idles. A kernel given `prefetch=tensor` has its programs issue Hopper's bulk L2
prefetch (`cp.async.bulk.prefetch.L2`: one instruction per chunk, no registers, nothing to wait for) for that
tensor as they start, so the bytes of a later projection stream in underneath this kernel and the later one
finds them in L2. What any kernel computes is unchanged; `FusedStep` decides which tensor each launch warms.
Under the interpreter (CPU) and for `prefetch=None` the code is compiled out.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # inline PTX has no CPU form: compiled out there
CHUNK = tl.constexpr(16384)  # bytes per prefetch instruction
LANES = tl.constexpr(128)  # chunks one program issues per round
# one bulk prefetch of $2 bytes at $1, skipped where $2 <= 0 (the lanes past the end); $0 is a dummy result
_ASM = tl.constexpr("{ .reg .pred p; setp.gt.s32 p, $2, 0; "
                   "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")


@triton.jit
def prefetch_l2(ptr, nbytes, pid, nprog, ENABLE: tl.constexpr):
    """Programs pid = 0..nprog-1 together prefetch bytes [0, nbytes) from ptr into L2 (16-byte granules)."""
    if ENABLE:
        base = ptr.to(tl.pointer_type(tl.int8))
        lanes = tl.arange(0, LANES)
        chunks = tl.cdiv(nbytes, CHUNK)
        for first in range(pid * LANES, chunks, nprog * LANES):
            c = first + lanes
            size = tl.minimum(nbytes - c.to(tl.int64) * CHUNK, CHUNK).to(tl.int32) // 16 * 16
            tl.inline_asm_elementwise(_ASM, "=r,l,r", [base + c.to(tl.int64) * CHUNK, size], dtype=tl.int32,
                                      is_pure=False, pack=1)


def prefetch_args(tensor: torch.Tensor | None, like: torch.Tensor) -> dict:
    """The kernel arguments for warming `tensor` (None: nothing), as keyword arguments pf_ptr / pf_bytes /
    PREFETCH; `like` stands in as the pointer when there is nothing to prefetch."""
    on = tensor is not None and tensor.is_cuda and not INTERPRET
    if on and not tensor.is_contiguous():
        raise ValueError("prefetch takes a contiguous tensor")
    return dict(pf_ptr=tensor if on else like, pf_bytes=tensor.numel() * tensor.element_size() if on else 0,
                PREFETCH=on)

