"""Token healing: let the model re-choose the token the cursor cut.

An editor's cursor cuts text where a BPE tokenizer would not: after a line's indentation (byte-level BPE joins
the last space to the next word, so `"\\n        "` then `"return"` is never how the model saw `"\\n       "`
`" return"`), inside a word, or between two characters of an operator. A prompt that ends in such a token
is one the model rarely met in training, and small models answer it with nonsense. Healing drops the prompt's
last prefix token (its text is the tail) and lets the model choose among the tokens that agree with the tail
(start with it, or are a start of it); a chosen start of the tail joins the prompt and the choice repeats for
the rest, until a chosen token covers the tail (LocalEngine); the tail is then removed from the completion.
Measured on ling-nano in training/evaluate.py (which constrains the first token only).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

import torch

REPLACEMENT = "\ufffd"


def cursor_index(ids: list[int], special: set[int], fim_prefix: int | None) -> int | None:
    """Index of the token just left of the cursor: the last of the text run that follows the last
    `fim_prefix` marker (PSM: before `fim_suffix`; SPM: before `fim_middle`), or the prompt's last token
    when there is no marker (left to right). None when that token is special or missing."""
    start = 0
    if fim_prefix is not None and fim_prefix in ids:
        start = len(ids) - ids[::-1].index(fim_prefix)
    i = start
    while i < len(ids) and ids[i] not in special:
        i += 1
    return i - 1 if i > start else None


def heal(ids: list[int], texts: list[str], special: set[int], fim_prefix: int | None) -> tuple[list[int], str]:
    """(the prompt without the cursor's token, that token's text) or (ids, "") when it cannot be healed."""
    at = cursor_index(ids, special, fim_prefix)
    if at is None or at >= len(texts) or len(ids) == 1:  # healing the only token would leave no prompt
        return ids, ""
    tail = texts[ids[at]]
    if not tail or REPLACEMENT in tail:  # a piece of a multi-byte character: leave the prompt as it is
        return ids, ""
    return ids[:at] + ids[at + 1:], tail


class Candidates:
    """Boolean masks over the vocabulary of the tokens a healed completion may start with, cached per tail
    (the same few indentation and word tails come back keystroke after keystroke). A new tail costs a binary
    search in the sorted token texts plus one lookup per prefix of the tail, not a pass over the vocabulary
    (157k texts at Ling-3.0's size)."""

    def __init__(self, texts: list[str], special: set[int], size: int = 256):
        self.texts, self.size = texts, size
        self.ordinary = torch.ones(len(texts), dtype=torch.bool)
        self.ordinary[[i for i in special if i < len(texts)]] = False
        usable = sorted((t, i) for i, t in enumerate(texts) if t and self.ordinary[i])
        self._sorted_texts = [t for t, _ in usable]
        self._sorted_ids = [i for _, i in usable]
        self._ids_of: dict[str, list[int]] = {}
        for t, i in usable:
            self._ids_of.setdefault(t, []).append(i)
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def mask(self, tail: str) -> torch.Tensor:
        if tail in self._cache:
            self._cache.move_to_end(tail)
            return self._cache[tail]
        # texts that start with the tail form one run of the sorted list; texts the tail starts with are its prefixes
        lo = bisect.bisect_left(self._sorted_texts, tail)
        hi = bisect.bisect_left(self._sorted_texts, tail + "\U0010ffff")
        ids = self._sorted_ids[lo:hi] + [i for n in range(1, len(tail)) for i in self._ids_of.get(tail[:n], ())]
        # pinned where a GPU may take it: the runner's copy then queues behind the prefill, not waiting for it
        mask = torch.zeros(len(self.texts), dtype=torch.bool, pin_memory=torch.cuda.is_available())
        mask[ids] = True
        self._cache[tail] = mask
        if len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return mask


def strip_tail(text: str, tail: str) -> str:
    """A healed completion's text after the tail: after what it shares with the tail (all of it, normally;
    one that strays from the tail keeps what follows the point where it strayed)."""
    shared = 0
    while shared < min(len(text), len(tail)) and text[shared] == tail[shared]:
        shared += 1
    return text[shared:]


class TailStripper:
    """`strip_tail` over a stream of text pieces: holds text back until it covers the tail or strays."""

    def __init__(self, tail: str):
        self.tail, self.held, self.done = tail, "", not tail

    def feed(self, text: str) -> str:
        if self.done:
            return text
        self.held += text
        rest = strip_tail(self.held, self.tail)
        if rest or len(self.held) >= len(self.tail):
            self.done = True
            return rest
        return ""
