"""Token healing: let the model re-choose the token the cursor cut.

An editor's cursor cuts text where a BPE tokenizer would not: after a line's indentation (byte-level BPE joins
the last space to the next word, so `"\\n        "` then `"return"` is never how the model saw `"\\n       "`
`" return"`), inside a word, or between two characters of an operator. A prompt that ends in such a token
is one the model rarely met in training, and small models answer it with nonsense. Healing drops the prompt's
last prefix token, and the tokens before it of a half-typed word with the whitespace before that word (their text
is the tail), and lets the model choose among the tokens that agree with the tail (start with it, or are a start
of it); a chosen start of the tail joins the prompt and the choice repeats for the rest, until a chosen token
covers the tail (LocalEngine, and training/evaluate.py alike); the tail is then removed from the completion.
Healing the whole word rather than its last token: mid-line exact match 0.235 -> 0.295 for ling-nano on 200
cursors in code it never saw (docs/performance.md).
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


MAX_TAIL_CHARS = 24  # a healed tail: the word being typed and the indentation before it, at most this long


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def heal(ids: list[int], texts: list[str], special: set[int], fim_prefix: int | None,
         whole_word: bool = True) -> tuple[list[int], str]:
    """(the prompt without the tokens of the tail, the tail's text) or (ids, "") when it cannot be healed. The
    tail is the cursor's token and, with `whole_word`, the tokens before it of the same word (`ret` `u` of a
    half-typed `return`, which the tokenizer never cut so) and whitespace just before that word (BPE joins a
    space to the word after it), within MAX_TAIL_CHARS."""
    at = cursor_index(ids, special, fim_prefix)
    if at is None or at >= len(texts) or len(ids) == 1:  # healing the only token would leave no prompt
        return ids, ""
    start, tail = at, texts[ids[at]]
    if not tail or REPLACEMENT in tail:  # a piece of a multi-byte character: leave the prompt as it is
        return ids, ""
    while whole_word and start > 1 and _is_word(tail[0]) and ids[start - 1] not in special:
        before = texts[ids[start - 1]] if ids[start - 1] < len(texts) else ""
        if not before or REPLACEMENT in before or len(before) + len(tail) > MAX_TAIL_CHARS:
            break
        if _is_word(before[-1]):  # the word goes on to the left
            start, tail = start - 1, before + tail
        elif before.isspace() and before.endswith(" "):  # the indentation or space before it, then stop
            start, tail = start - 1, before + tail
            break
        else:
            break
    return ids[:start] + ids[at + 1:], tail


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
