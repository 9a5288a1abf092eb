"""Fused Triton kernels for batch-1 decode and verify steps, each with its plain-torch reference."""


def by_tokens(configs: dict, t: int):
    """The launch settings for a step of T tokens from a table keyed by token count: the entry of the smallest
    key >= T (the largest key's beyond them all)."""
    return configs[min((k for k in configs if k >= t), default=max(configs))]
