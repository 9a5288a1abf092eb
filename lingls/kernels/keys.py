"""Packed (value, index) keys: an argmax in one max reduction.

A key is an int64: the fp32 value's bits made order-preserving as a signed int in the high half, and
(N_PAD - 1 - index) in the low half. The max of keys is then the best value and, among equal values, the
lowest index (the first maximum, as torch.argmax), where a float max would need a second reduction for the
index. NaN orders above every number, as torch.argmax treats it. Used by the MoE routing's picks and the
greedy token choice.
"""

from __future__ import annotations

from lingls.kernels import jit, tl

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
