"""One engine stream for one cursor position, readable by several requests.

A generation keeps running after the request that started it has its answer (up to the end of the block
the cursor is in, or the end of the line when the cursor is mid-line), so the next requests at the same
place — the user typing the suggestion's first characters, accepting it, pressing Enter — read it instead of
asking the model again. It is tied to its place by the text just before and after the cursor.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from lingls.engine.protocol import Engine, GenerateRequest
from lingls.lsp.postprocess import Cleaned, Site, clean

WINDOW = 256  # characters each side of the anchor that must be unchanged for a generation to still apply
_ids = itertools.count(1)


class Generation:
    def __init__(self, uri: str, text: str, anchor: int, site: Site, specials: tuple[str, ...]):
        self.id = next(_ids)
        self.uri = uri
        self.anchor = anchor
        self.before = text[max(0, anchor - WINDOW) : anchor]
        self.after = text[anchor : anchor + WINDOW]
        self.site = site
        self.specials = specials
        self.text = ""  # raw model output so far
        self.done = False
        self.stopped = False  # ended by stop(), so its text may end anywhere
        self.error: BaseException | None = None
        self.readers = 0  # requests waiting on it now
        self.started = time.perf_counter()
        # Time spent inside the engine's stream (awaiting its next chunk): what the LSP does not own.
        self._engine_s = 0.0
        self._engine_since: float | None = None
        self.first_chunk_at: float | None = None
        self._progress = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task | None = None
        self._cleaned: tuple[tuple, Site, Cleaned] | None = None  # the last `cleaned` question and its answer

    def cleaned(self, typed: str, site: Site, final: bool = False, block: bool | None = None) -> Cleaned:
        """`postprocess.clean` of the text past the `typed` characters, at `site`. The stream's own stop rule and
        the request that started it ask the same question after each chunk (mid-line, or where a block may
        start): it is answered once per chunk."""
        block = site.multiline if block is None else block
        key = (len(self.text), typed, final, block)
        if self._cleaned is None or self._cleaned[0] != key or self._cleaned[1] is not site:
            self._cleaned = key, site, clean(self.text[len(typed):], site, self.specials, final=final, block=block)
        return self._cleaned[2]

    def start(self, engine: Engine, request: GenerateRequest) -> None:
        self._task = asyncio.ensure_future(self._run(engine, request))

    def stop(self) -> None:
        """Stop the engine's work for this generation (it ends within one decode step)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def finished(self) -> None:
        """Wait until the stream is closed (after stop(), within one decode step)."""
        if self._task is not None:
            await self._task

    def progress(self) -> asyncio.Future:
        """A future resolved when the text grows or the generation ends."""
        return self._progress

    def match(self, text: str, offset: int) -> str | None:
        """What was typed since the anchor, if this generation still applies at `offset` of `text`: the place
        is unchanged and the typed characters agree with what the model wrote (or it may still write)."""
        a = self.anchor
        if offset < a or a > len(text):
            return None
        if text[max(0, a - WINDOW) : a] != self.before or text[offset : offset + WINDOW] != self.after:
            return None
        typed = text[a:offset]
        if self.text.startswith(typed) or (not self.done and typed.startswith(self.text)):
            return typed
        return None

    def engine_time(self, now: float | None = None) -> float:
        """Seconds spent so far awaiting the engine's stream (up to `now` while a chunk is awaited)."""
        since = self._engine_since
        if since is None:
            return self._engine_s
        return self._engine_s + max(0.0, (time.perf_counter() if now is None else now) - since)

    async def _run(self, engine: Engine, request: GenerateRequest) -> None:
        stream = engine.generate(request)
        clock = time.perf_counter
        try:
            chunks = stream.__aiter__()
            while True:
                self._engine_since = t = clock()
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    now = clock()
                    self._engine_s += now - t
                    self._engine_since = None
                if self.first_chunk_at is None:
                    self.first_chunk_at = now
                self.text += chunk
                self._wake()
                # Enough: the block (or, mid-line, the line) is over.
                if self.cleaned("", self.site, block=not self.site.mid_line).complete:
                    break
        except asyncio.CancelledError:
            self.stopped = True  # on purpose; the readers see `done` and `stopped`
        except Exception as exc:  # an engine failure must not escape into the event loop
            self.error = exc
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    pass
            self.done = True
            self._wake()

    def _wake(self) -> None:
        done, self._progress = self._progress, asyncio.get_running_loop().create_future()
        done.set_result(None)
