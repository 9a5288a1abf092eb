"""Fused Triton kernels for batch-1 decode and verify steps, each with its plain-torch reference.

Triton is optional (torch's CPU wheels come without it): every kernel module imports `triton`, `tl` and `jit`
from here, so each imports and serves its reference wherever Triton is absent. The launch settings measured best
per shape are data (`tuned.json`, written by `bench/tune_gpu.py --ship`), read through `tuned`.
"""

import json
from pathlib import Path

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references serve
    triton = tl = None


def jit(fn):
    """`triton.jit`, or `fn` itself where Triton is absent: the kernels are then never launched (every dispatcher
    takes its reference off CUDA or without Triton), but the modules that define them still import."""
    return fn if triton is None else triton.jit(fn)


def by_tokens(configs: dict, t: int):
    """The launch settings for a step of T tokens from a table keyed by token count: the entry of the smallest
    key >= T (the largest key's beyond them all)."""
    return configs[min((k for k in configs if k >= t), default=max(configs))]


def by_width_and_tokens(configs: dict, width: int, t: int):
    """The launch settings from a table keyed by a kernel's per-rank width (what tensor parallelism splits: heads,
    expert rows), then by token count (`by_tokens`). A width nobody tuned takes the nearest tuned one."""
    return by_tokens(configs.get(width) or configs[min(configs, key=lambda w: abs(w - width))], t)


TUNED = Path(__file__).with_name("tuned.json")


def tuned(kernel: str) -> dict:
    """The launch settings `bench/tune_gpu.py --ship` chose for `kernel`, by shape key (a tuple); each entry of
    tuned.json also names the GPU it was timed on and the commit that shipped it."""
    return {tuple(e["key"]): e["settings"] for e in json.loads(TUNED.read_text())[kernel]}


def by_width(table: dict) -> dict:
    """A table keyed by (width, T bucket) as `by_width_and_tokens` reads it: {width: {T bucket: settings}}."""
    nested: dict = {}
    for (width, t), settings in table.items():
        nested.setdefault(width, {})[t] = tuple(settings) if isinstance(settings, list) else settings
    return nested
