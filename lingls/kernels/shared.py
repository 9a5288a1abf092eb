"""The Triton pieces several kernels share: the MMA, arrival counters, the SM count, packed argmax keys.

Triton's interpreter (CPU tests) computes bf16 `tl.dot` wrongly (Triton 3.6), so under TRITON_INTERPRET (`INTERPRET`)
the operands are widened to fp32 first; on a GPU the MMA takes bf16 directly. Both give the exact bf16 products.

Packed (value, index) keys: an argmax in one max reduction.

A key is an int64: the fp32 value's bits made order-preserving as a signed int in the high half, and
(N_PAD - 1 - index) in the low half. The max of keys is then the best value and, among equal values, the
lowest index (the first maximum, as torch.argmax), where a float max would need a second reduction for the
index. NaN orders above every number, as torch.argmax treats it. Used by the MoE routing's picks and the
greedy token choice.
"""

from __future__ import annotations

import os

import torch

from lingls.kernels import jit, tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@jit
def mma(acc, a, b, F32_DOT: tl.constexpr):
    """acc += a @ b with fp32 accumulation (see the module note on the interpreter). fp32 operands (models run
    in fp32, as the tests' small ones) are multiplied in full fp32 precision, not rounded to TF32."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters shared by this package's 'last program finishes' kernels.

    Every kernel that uses them resets the ones it touched before it exits, so one buffer serves all kernels
    issued on one stream, and graph replays find them at zero. Call each kernel once before capturing a graph
    (the warm-up run allocates the buffer outside the capture). Not safe for kernels running concurrently on
    two streams.
    """
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill (a small stand-in under the interpreter, to exercise split-K)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4



NO_KEY = -(2 ** 63) + 1  # below every key, -inf's included
if tl is not None:
    NO_KEY = tl.constexpr(NO_KEY)  # as the kernels read it


@jit
def make_key(value, index, N_PAD: tl.constexpr):
    """The key of fp32 `value` at `index` (0 <= index < N_PAD, N_PAD a power of two <= 2**31)."""
    bits = value.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: larger magnitude, smaller int
    return (ordered.to(tl.int64) << 32) | (N_PAD - 1 - index).to(tl.int64)


@jit
def key_value(key):
    ordered = (key >> 32).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@jit
def key_index(key, N_PAD: tl.constexpr):
    return N_PAD - 1 - (key & (N_PAD - 1)).to(tl.int32)
