"""The prompt for one cursor: the model's FIM template around prefix and suffix windows, plus context chunks
from other documents, within a token budget, in the template's order (PSM, or SPM where the model's card asks for
it). Models without FIM tokens get the prefix alone (left to right).

Budget: the suffix may take a fifth and the context chunks a quarter; the prefix gets the rest, including
whatever those two left unused. Windows grow a whole line at a time, so a model never sees half a line
except the cursor's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

from lingls.engine.protocol import FimParts, FimTemplate
from lingls.lsp.context import Chunk

_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_SUFFIX_LINES = 64
WINDOW_STEP = 16  # the prefix window of a long document starts on a multiple of this many lines


@dataclass(frozen=True)
class Prompt:
    text: str
    prefix_chars: int  # how much of the document before the cursor the model sees
    suffix_chars: int
    tokens: int  # the budget's estimate (sum of per-line counts)
    parts: FimParts  # the same pieces, for servers that apply a FIM template themselves


class TokenCounter:
    """`Engine.count_tokens` one line at a time, cached.

    While the user types, only the edited line is new, so keeping a 1.5k-token prompt within budget costs a
    few dictionary lookups per keystroke instead of tokenising the whole window. A sum of per-line counts
    can differ from the count of the joined text by a few tokens where merges cross a line ending; the
    budget is a policy, not the model's hard limit, so that is close enough.
    """

    def __init__(self, count: Callable[[str], int], capacity: int = 50_000):
        self._count = count
        self._cache: dict[str, int] = {}
        self._capacity = capacity
        # The last walk up from a line start: (start, region start, region text, [(line start, cost)], whole).
        self._above: tuple[int, int, str, list[tuple[int, int]], bool] | None = None

    def lines_above(self, text: str, start: int, budget: int) -> list[tuple[int, int]]:
        """(line start, token count) of the lines above offset `start`, nearest first, until their sum exceeds
        `budget` or the text begins. Typing changes the cursor's line only, so the last walk is reused when
        the text above `start` that it covered is unchanged (one string comparison instead of ~150 lines)."""
        memo = self._above
        if memo is not None and memo[0] == start:
            _, top, region, lines, whole = memo
            if ((whole or sum(c for _, c in lines) > budget) and text.startswith(region, top)
                    and (top == 0 or text[top - 1] == "\n")):
                return lines
        lines, used, top = [], 0, start
        while top > 0 and used <= budget:
            prev = text.rfind("\n", 0, top - 1) + 1
            cost = self.line(text[prev:top])
            lines.append((prev, cost))
            used += cost
            top = prev
        self._above = (start, top, text[top:start], lines, top == 0)
        return lines

    def line(self, line: str) -> int:
        n = self._cache.get(line)
        if n is None:
            if len(self._cache) >= self._capacity:
                self._cache.clear()
            n = self._cache[line] = self._count(line)
        return n

    def text(self, text: str) -> int:
        return sum(self.line(line) for line in text.splitlines(keepends=True))


def sanitize(text: str, specials: Iterable[str] = ()) -> str:
    """Text safe to send to a tokenizer: lone surrogates become U+FFFD (same length, so offsets hold), and a
    special token written literally in a document is broken with a zero-width space so that the model
    never reads it as the real control token."""
    if not text.isascii():
        text = _SURROGATE.sub("\ufffd", text)
    for special in specials:
        if special in text:
            text = text.replace(special, special[:1] + "\u200b" + special[1:])
    return text


def build_prompt(
    text: str,
    offset: int,
    *,
    fim: FimTemplate | None,
    counter: TokenCounter,
    budget: int,
    chunks: list[Chunk] = (),  # oldest first
    path: str = "",
) -> Prompt:
    specials = fim.special_tokens() if fim else ()
    suffix_end, suffix_tokens = _suffix_window(text, offset, counter, budget // 5)
    picked, chunk_tokens = _pick_chunks(chunks, counter, budget // 4)
    if fim is None:  # left to right: the whole budget goes to the prefix
        suffix_tokens = chunk_tokens = 0
    prefix_start, prefix_tokens = _prefix_window(text, offset, counter, budget - suffix_tokens - chunk_tokens)

    prefix = sanitize(text[prefix_start:offset], specials)
    suffix = sanitize(text[offset:suffix_end], specials)
    context = tuple((c.label, sanitize(c.text, specials)) for c in picked)
    parts = FimParts(prefix, suffix, context)
    if fim is None:
        return Prompt(prefix, offset - prefix_start, 0, prefix_tokens, parts)
    pieces = [f"{fim.file_sep}{label}\n{body}\n" for label, body in context] if fim.file_sep else []
    if pieces and path:
        pieces.append(f"{fim.file_sep}{path}\n")
    if fim.order == "spm":  # the prefix next to the middle: what small models learn more easily
        pieces.append(f"{fim.suffix}{suffix}{fim.prefix}{prefix}{fim.middle}")
    else:
        pieces.append(f"{fim.prefix}{prefix}{fim.suffix}{suffix}{fim.middle}")
    tokens = prefix_tokens + suffix_tokens + (chunk_tokens if pieces[:-1] else 0)
    return Prompt("".join(pieces), offset - prefix_start, suffix_end - offset, tokens, parts)


def _prefix_window(text: str, offset: int, counter: TokenCounter, budget: int) -> tuple[int, int]:
    """Start offset and token count of the lines before the cursor that fit `budget`.

    The cursor's own line always goes in; a monster line (minified code) keeps only its last ~3 characters
    per token of budget. When the budget cuts the document, the window starts on a line whose index is a
    multiple of `WINDOW_STEP`: typing at the end of a long file then moves the start once every
    `WINDOW_STEP` lines instead of at nearly every line, and every request in between shares the prompt's
    whole beginning with the one before it, which the engine's prefix reuse turns into a short re-prefill
    instead of a cold one (seconds on a CPU). The price is up to `WINDOW_STEP - 1` lines of budget unused,
    never more than half of the window's lines (where so few fit, the start is the one chosen afresh)."""
    start = text.rfind("\n", 0, offset) + 1
    if offset - start > budget * 3:
        start = offset - budget * 3
    used = counter.line(text[start:offset])
    if start == 0 or used > budget or text[start - 1] != "\n":
        return start, used
    taken = []  # (line start, cost) of the lines above taken, nearest first
    for prev, cost in counter.lines_above(text, start, budget - used):
        if used + cost > budget:
            break
        used += cost
        taken.append((prev, cost))
    if not taken or taken[-1][0] == 0:  # the whole document above the cursor fits
        return (taken[-1][0] if taken else start), used
    top = text.count("\n", 0, taken[-1][0])  # the window's first line index
    drop = -top % WINDOW_STEP
    if 2 * drop > len(taken):  # lines so long that few fit: every one counts more than a stable start
        drop = 0
    for _ in range(drop):
        used -= taken.pop()[1]
    return (taken[-1][0] if taken else start), used


def _suffix_window(text: str, offset: int, counter: TokenCounter, budget: int) -> tuple[int, int]:
    end = offset
    used = 0
    for _ in range(MAX_SUFFIX_LINES):
        if end >= len(text):
            break
        nl = text.find("\n", end)
        stop = len(text) if nl < 0 else nl + 1
        cost = counter.line(text[end:stop])
        if used + cost > budget:
            break
        used += cost
        end = stop
    return end, used


def _pick_chunks(chunks: list[Chunk], counter: TokenCounter, budget: int) -> tuple[list[Chunk], int]:
    """The newest chunks that fit, kept in ring order."""
    picked, used = [], 0
    for chunk in reversed(chunks):
        cost = counter.text(chunk.text) + counter.line(chunk.label + "\n") + 1
        if used + cost <= budget:
            picked.append(chunk)
            used += cost
    return picked[::-1], used
