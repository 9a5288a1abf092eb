"""The text of one open document, kept in sync from didOpen/didChange, addressed by LSP positions.

lingls keeps its own copy instead of pygls' workspace so that a keystroke costs one string splice and the
line table is rebuilt only when a position is next needed (pygls re-splits the whole text on every change).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from lingls.lsp.positions import UTF16, column_to_index, index_to_column

# LSP line endings: \n, \r\n and \r (not the other separators str.splitlines knows).
_EOL = re.compile(r"\r\n?|\n")


class PositionError(ValueError):
    """A position outside the document."""


@dataclass
class Document:
    uri: str
    text: str
    language_id: str = ""
    version: int = 0
    edits: int = 0  # bumped by every change; the client's `version` cannot be trusted to move
    _starts: list[int] | None = field(default=None, repr=False)

    def line_starts(self) -> list[int]:
        if self._starts is None:
            self._starts = [0] + [m.end() for m in _EOL.finditer(self.text)]
        return self._starts

    def line_count(self) -> int:
        return len(self.line_starts())

    def line_span(self, line: int) -> tuple[int, int]:
        """Offsets of the start and end (before the line ending) of `line`."""
        starts = self.line_starts()
        start = starts[line]
        end = starts[line + 1] if line + 1 < len(starts) else len(self.text)
        while end > start and self.text[end - 1] in "\r\n":
            end -= 1
        return start, end

    def window(self, center: int, size: int = 64) -> tuple[int, list[str]]:
        """First line number and text of the `size` lines around line `center` (for the context ring)."""
        count = self.line_count()
        first = max(0, min(center - size // 2, count - size))
        lines = [self.text[slice(*self.line_span(i))] for i in range(first, min(count, first + size))]
        return first, lines

    def offset_at(self, line: int, column: int, encoding: str = UTF16, *, strict: bool = False) -> int:
        """Offset in `text` of an LSP position.

        Lenient (the default, used for edits, as the LSP spec asks): a line past the end means the end of the
        document and a column past the end of its line means the end of that line. Strict (used for
        completion requests): raise PositionError instead, so a client bug is reported, not papered over.
        """
        if line < 0 or column < 0:
            raise PositionError(f"negative position {line}:{column}")
        if line >= self.line_count():
            if strict:
                raise PositionError(f"line {line} is past the end ({self.line_count()} lines)")
            return len(self.text)
        start, end = self.line_span(line)
        text = self.text[start:end]
        index = column_to_index(text, column, encoding)
        if strict and index == len(text) and index_to_column(text, index, encoding) < column:
            raise PositionError(f"column {column} is past the end of line {line}")
        return start + index

    def position_at(self, offset: int, encoding: str = UTF16) -> tuple[int, int]:
        """LSP (line, column) of an offset in `text`."""
        starts = self.line_starts()
        lo, hi = 0, len(starts) - 1
        while lo < hi:  # last line start <= offset
            mid = (lo + hi + 1) // 2
            if starts[mid] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo, index_to_column(self.text[starts[lo] : offset], offset - starts[lo], encoding)

    def apply_change(self, text: str, start: tuple[int, int] | None = None, end: tuple[int, int] | None = None,
                     encoding: str = UTF16) -> None:
        """Apply one content change: the whole text when `start` is None, else replace [start, end)."""
        self.edits += 1
        if start is None or end is None:
            self.text = text
            self._starts = None
            return
        a = self.offset_at(*start, encoding)
        b = max(a, self.offset_at(*end, encoding))
        old = self.text
        self.text = old[:a] + text + old[b:]
        if self._starts is not None and "\r" not in text and "\r" not in old[max(0, a - 1) : b + 1]:
            self._shift_starts(a, b, text)
        else:
            self._starts = None

    def _shift_starts(self, a: int, b: int, text: str) -> None:
        """Update the line table for [a, b) replaced by `text` instead of rescanning the whole document (no
        \r near the edit, so no \r\n pair can form or split)."""
        starts = self._starts
        first = bisect.bisect_right(starts, a)  # line starts <= a stay
        last = bisect.bisect_right(starts, b)  # line starts > b shift
        delta = len(text) - (b - a)
        new = [a + m.end() for m in _EOL.finditer(text)]
        tail = starts[last:]
        starts[first:] = new + ([s + delta for s in tail] if delta else tail)
