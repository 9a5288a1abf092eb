"""Ring buffer of text chunks from other open or recently edited documents, for the prompt's extra context.

A chunk is a window of lines (64 by default) around where the user opened or last asked for a completion in a document.
A new chunk from the same document that overlaps an older one replaces it (so the ring follows the edits
instead of filling up with near-copies); the oldest chunk leaves when the ring is full.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    uri: str
    label: str  # path shown to the model, e.g. "pkg/util.py"
    first_line: int
    line_count: int
    text: str

    def overlaps(self, other: "Chunk") -> bool:
        """Same document and at least half of the smaller window shared."""
        if self.uri != other.uri:
            return False
        shared = min(self.first_line + self.line_count, other.first_line + other.line_count) - max(
            self.first_line, other.first_line
        )
        return shared * 2 >= min(self.line_count, other.line_count)


class ContextRing:
    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._chunks: deque[Chunk] = deque()

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        while len(self._chunks) > capacity:
            self._chunks.popleft()

    def offer(self, uri: str, label: str, first_line: int, lines: list[str]) -> None:
        """Take a window of lines (see `Document.window`) of a document."""
        text = "\n".join(lines).rstrip()
        if self.capacity <= 0 or not text.strip():
            return
        chunk = Chunk(uri, label, first_line, len(lines), text)
        self._chunks = deque(c for c in self._chunks if not c.overlaps(chunk) and c.text != text)
        self._chunks.append(chunk)
        while len(self._chunks) > self.capacity:
            self._chunks.popleft()

    def chunks_for(self, uri: str) -> list[Chunk]:
        """Chunks of other documents, oldest first (the newest ends up nearest the cursor in the prompt)."""
        return [c for c in self._chunks if c.uri != uri]

    def __len__(self) -> int:
        return len(self._chunks)
