"""Token n-gram baseline: greedy next token from the longest context seen in training, backing off to shorter.

Counting runs in torch (on the GPU when there is one: 100M tokens take seconds there); lookup is numpy.
A context of k tokens is reduced to a 50-bit rolling hash, so a table is two sorted arrays per order:
context hashes and the most frequent next token after each.
"""

from __future__ import annotations

import numpy as np
import torch

HASH_MUL = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64 constant
HASH_BITS = 50
TOKEN_BITS = 16  # token ids must be < 65536


def _hash_step(h: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    return h * HASH_MUL + (tok + 1)  # int64 arithmetic wraps, which is all a hash needs


def context_hash(ctx) -> int:
    """The same hash as `_hash_step` folded over `ctx`, in Python integers."""
    h = 0
    for t in ctx:
        h = (h * (HASH_MUL % (1 << 64)) + int(t) + 1) % (1 << 64)
    return h & ((1 << HASH_BITS) - 1)


class NGramModel:
    def __init__(self, tables: dict[int, tuple[np.ndarray, np.ndarray]], order: int):
        self.tables = tables  # context length -> (sorted context hashes, best next token)
        self.order = order

    @classmethod
    def train(cls, ids: torch.Tensor, order: int, device: str | None = None) -> "NGramModel":
        """Count `order`-grams (and every shorter one) over the 1-D id stream."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        ids = ids.to(device=device, dtype=torch.int64)
        mask = (1 << HASH_BITS) - 1
        tables = {}
        h = torch.zeros_like(ids)
        for k in range(1, order):
            # h[i] = hash of ids[i-k : i]  (valid for i >= k)
            prev = torch.roll(h, 1)
            h = _hash_step(prev, torch.roll(ids, 1)) if k > 1 else torch.roll(ids, 1) + 1
            ctx = (h[k:] & mask)
            keys = (ctx << TOKEN_BITS) | ids[k:]
            uniq, counts = torch.unique(keys, return_counts=True)  # sorted: by context, then by token
            ctx_of = uniq >> TOKEN_BITS
            groups, inverse = torch.unique_consecutive(ctx_of, return_inverse=True)
            best = torch.full((groups.numel(),), -1, device=device, dtype=counts.dtype)
            best.scatter_reduce_(0, inverse, counts, reduce="amax")
            winner = counts == best[inverse]
            # the first winner of each context, i.e. the lowest token id on ties
            index = torch.arange(uniq.numel(), device=device)
            first = torch.full_like(best, uniq.numel())
            first.scatter_reduce_(0, inverse[winner], index[winner], reduce="amin")
            tokens = uniq[first] & ((1 << TOKEN_BITS) - 1)
            tables[k] = (groups.cpu().numpy(), tokens.cpu().numpy().astype(np.int32))
        counts = torch.bincount(ids, minlength=1)
        unigram = int(torch.argmax(counts))
        tables[0] = (np.zeros(1, dtype=np.int64), np.array([unigram], dtype=np.int32))
        return cls(tables, order)

    def next_token(self, context: list[int]) -> int:
        for k in range(min(self.order - 1, len(context)), 0, -1):
            keys, best = self.tables[k]
            h = context_hash(context[-k:])
            i = np.searchsorted(keys, h)
            if i < len(keys) and keys[i] == h:
                return int(best[i])
        return int(self.tables[0][1][0])

    def generate(self, context: list[int], max_tokens: int, stop) -> list[int]:
        """Greedy continuation; `stop(generated_ids)` ends it early."""
        ctx, out = list(context), []
        for _ in range(max_tokens):
            t = self.next_token(ctx)
            out.append(t)
            ctx.append(t)
            if stop(out):
                break
        return out
