"""Prefix reuse across requests for one resident sequence state (batch 1).

The state has two parts that rewind differently:
- MLA latent KV is indexed by position, so it truncates anywhere: rows past the new sequence's length are
  masked by position and overwritten before they are read again.
- KDA recurrent + conv state summarise the whole past and cannot be rewound, so the cache keeps snapshots of
  them at chosen positions: every `every` tokens of a prefill, at the end of each prompt (typing appends to
  it) and a few tokens before its end (a keystroke edits the last token; an unchanged prompt re-runs only its
  last token).

A new prompt restores the longest snapshot within its common prefix with the tokens the state has consumed
and prefills only the rest. A snapshot at p is valid while the state's first p tokens are unchanged; those
past the common prefix of a new prompt are dropped, since their KV rows are about to be overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lingls.model.ling import InferenceState


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0  # prompts that reused at least one token
    tokens_saved: int = 0  # prompt tokens not prefilled thanks to reuse


class PrefixCache:
    def __init__(self, state: InferenceState, max_snapshots: int = 24, every: int = 512,
                 tail: tuple[int, ...] = (1, 8)):
        self.state = state
        self.tokens: list[int] = []  # the tokens `state` has consumed, in order
        self.every, self.tail = every, tail
        self._kda = torch.empty((max_snapshots, *state.kda.shape), dtype=state.kda.dtype, device=state.kda.device)
        self._conv = torch.empty((max_snapshots, *state.conv.shape), dtype=state.conv.dtype, device=state.conv.device)
        self._slots: dict[int, int] = {}  # position -> snapshot slot, in the order they were taken
        self.stats = CacheStats()

    def begin(self, prompt: list[int]) -> int:
        """Make the state hold `prompt[:s]` for the largest s available (s < len(prompt), so the last prompt
        token always runs and yields logits); return s. The caller prefills prompt[s:]."""
        self.stats.lookups += 1
        common = _common_prefix(self.tokens, prompt)
        for p in [p for p in self._slots if p > common]:
            del self._slots[p]
        usable = min(common, len(prompt) - 1)
        if usable == len(self.tokens):
            start = usable  # the live state already is the prefix
        else:
            start = max((p for p in self._slots if p <= usable), default=0)
            if start:
                slot = self._slots[start]
                self.state.kda.copy_(self._kda[slot])
                self.state.conv.copy_(self._conv[slot])
            else:
                self.state.kda.zero_()
                self.state.conv.zero_()
        del self.tokens[start:]
        if start:
            self.stats.hits += 1
            self.stats.tokens_saved += start
        return start

    def snapshot_points(self, start: int, end: int) -> list[int]:
        """Positions in (start, end) where a prefill of tokens [start, end) should pause for a snapshot."""
        points = {p for p in range(self.every, end, self.every)} | {end - k for k in self.tail}
        return sorted(p for p in points if start < p < end and p not in self._slots)

    def snapshot(self, position: int, kda: torch.Tensor | None = None, conv: torch.Tensor | None = None) -> None:
        """Remember the KDA + conv state as of `position` consumed tokens: the live state's (position ==
        len(self.tokens)), or the given states of an earlier position (a prefill piece's tail snapshots)."""
        slot = self._slots.pop(position, None)
        if slot is None:
            if len(self._slots) == self._kda.shape[0]:  # full: forget the oldest-taken snapshot
                del self._slots[next(iter(self._slots))]
            slot = min(set(range(self._kda.shape[0])) - set(self._slots.values()))
        self._kda[slot].copy_(self.state.kda if kda is None else kda)
        self._conv[slot].copy_(self.state.conv if conv is None else conv)
        self._slots[position] = slot

    def reset(self) -> None:
        """Forget everything (after a failed step left the state unknown): the live KDA and conv state start
        again from zeros, as `begin` expects of a state that has consumed no tokens."""
        self.tokens.clear()
        self._slots.clear()
        self.state.kda.zero_()
        self.state.conv.zero_()

    @property
    def snapshots(self) -> list[int]:
        return sorted(self._slots)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
