"""Fused Triton kernels for batch-1 decode and verify steps, each with its plain-torch reference."""


def by_tokens(configs: dict, t: int):
    """The launch settings for a step of T tokens from a table keyed by token count: the entry of the smallest
    key >= T (the largest key's beyond them all)."""
    return configs[min((k for k in configs if k >= t), default=max(configs))]


def by_width_and_tokens(configs: dict, width: int, t: int):
    """The launch settings from a table keyed by a kernel's per-rank width (what tensor parallelism splits: heads,
    expert rows), then by token count (`by_tokens`). A width nobody tuned takes the nearest tuned one."""
    return by_tokens(configs.get(width) or configs[min(configs, key=lambda w: abs(w - width))], t)
