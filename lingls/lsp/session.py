"""The completion core: documents, per-document request sessions, generations, acceptance.

Transport-free (server.py maps LSP messages onto it; oneshot.py calls it directly). Per document:

- a new request supersedes the previous one of the same document, which answers empty at once (Neovim
  never cancels; VS Code's `$/cancelRequest` is handled by pygls and stops the engine here too);
- a request first looks for a generation that still applies (typed-through, in flight, or prefetched after
  an accept) and reads it without a model call;
- otherwise it waits out the optional debounce, builds the prompt and starts one generation; the runtime is
  batch-1, so starting one stops any other that is running.

Answers carry a range from the request's position over the characters typed while the model worked, so those
characters are replaced by the completion (which starts with them) instead of being typed twice.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from lingls.engine.protocol import Engine, GenerateRequest
from lingls.lsp.context import ContextRing
from lingls.lsp.documents import Document, PositionError
from lingls.lsp.engines import EngineHolder, describe_failure
from lingls.lsp.generation import WINDOW, Generation
from lingls.lsp.positions import UTF16
from lingls.lsp.postprocess import Site, clean, lang_for
from lingls.lsp.prompt import TokenCounter, build_prompt
from lingls.lsp.settings import Settings

KEEP_GENERATIONS = 4  # per document, for type-through and reuse
RING_MOVE = 8  # lines the cursor moves before its document offers a fresh chunk to the context ring
RING_AGE = 32  # or generations started since the last offer
SAMPLES = ((0.8, 1), (0.8, 2))  # (temperature, seed) of the extra candidates of an Invoked request
BINARY_PROBE = 4096  # characters each side of the cursor checked for NUL
ACCEPT_COMMAND = "lingls.accept"


class NotInitialized(RuntimeError):
    """A request arrived before `initialize`."""


class Notifier(Protocol):
    def log(self, level: str, message: str) -> None: ...  # level: error, warning, info, log
    def show(self, level: str, message: str) -> None: ...
    # the engine's loading, from its start (what is loading) to its end (how it ended), for a client to show
    def loading(self, what: str) -> None: ...
    def loaded(self, outcome: str) -> None: ...


@dataclass(frozen=True)
class Item:
    text: str
    start: tuple[int, int]  # LSP position, in the negotiated encoding
    end: tuple[int, int]
    accept: dict  # the `lingls.accept` command's argument


@dataclass
class _Request:
    superseded: asyncio.Future
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _DocState:
    doc: Document
    generations: list[Generation] = field(default_factory=list)
    request: _Request | None = None
    ring_line: int = -RING_MOVE  # where this document last offered a context chunk, and how long ago
    ring_age: int = 0


@dataclass
class Counters:
    requests: int = 0
    answered: int = 0
    superseded: int = 0
    cancelled: int = 0
    engine_calls: int = 0
    reused_in_flight: int = 0
    type_through: int = 0
    prefetches: int = 0
    shown: int = 0
    accepted: int = 0
    accepted_chars: int = 0
    errors: int = 0


class Core:
    def __init__(self, notifier: Notifier, settings: Settings | None = None, engines: EngineHolder | None = None):
        self.notifier = notifier
        self.settings = settings or Settings()
        self.engines = engines or EngineHolder()
        self.encoding = UTF16
        self.initialized = False
        self.root = ""
        self.counters = Counters()
        self.timings: deque[dict] = deque(maxlen=512)
        self.accepted_log: deque[dict] = deque(maxlen=256)
        self._docs: dict[str, _DocState] = {}
        self._ring = ContextRing(self.settings.context_chunks)
        self._running: Generation | None = None
        self._counter: TokenCounter | None = None
        self._counter_engine: Engine | None = None
        self._told: set[str] = set()

    # ---- lifecycle -------------------------------------------------------------------------------------

    def initialize(self, options: Any, encoding: str = UTF16, root_uri: str | None = None) -> None:
        self.encoding = encoding
        self.root = _path_of(root_uri) if root_uri else ""
        self.configure(options)
        self.initialized = True

    def configure(self, raw: Any) -> None:
        """Merge editor settings; a change of engine settings starts the new engine."""
        old = self.settings
        self.settings, warnings = self.settings.merged(raw)
        for warning in warnings:
            self._once(warning, "warning", f"lingls: {warning}")
        self._ring.resize(self.settings.context_chunks)
        if self.settings.engine_key() != old.engine_key():
            self._told = {key for key in self._told if not key.startswith("engine")}
            if self.initialized:
                self.warm_up()

    def warm_up(self) -> None:
        """Start loading the engine now, so the first completion does not pay for it."""
        if not self.settings.enable:
            return
        what = self.settings.endpoint or self.settings.model or "the embedded model"
        self.notifier.log("info", f"lingls: starting the engine ({what})")
        task = self.engines.start(self.settings)
        if not task.done():
            self.notifier.loading(f"loading {what}" if not self.settings.endpoint else f"connecting to {what}")
        task.add_done_callback(self._loaded)

    def _loaded(self, task: asyncio.Future) -> None:
        if task.cancelled():
            self.notifier.loaded("stopped (the settings changed)")
            return
        if (exc := task.exception()) is not None:
            self.notifier.loaded("failed: see the log")
            self._once("engine-load", "error", describe_failure(exc, self.settings), show=True)
            return
        engine = task.result()
        fim = "fill-in-the-middle" if engine.fim else "left-to-right"
        self.notifier.loaded(f"{engine.name} ready")
        self.notifier.log("info", f"lingls: engine {engine.name} ready ({fim} prompts)")

    async def shutdown(self) -> None:
        """Stop every generation, wait for their streams to close, then close the engine."""
        generations = [gen for state in self._docs.values() for gen in state.generations]
        for gen in generations:
            gen.stop()
        await asyncio.gather(*(gen.finished() for gen in generations))
        await self.engines.close()

    # ---- documents -------------------------------------------------------------------------------------

    def open(self, uri: str, language_id: str, version: int, text: str) -> None:
        if not self.initialized:
            return
        state = self._docs.get(uri)
        if state is not None:
            self._drop(state)
        doc = Document(uri, text, language_id, version)
        self._docs[uri] = _DocState(doc)
        self._ring.offer(uri, self._label(uri), *doc.window(0))

    def change(self, uri: str, version: int, changes: list[tuple[str, Any, Any]]) -> None:
        """Apply (text, start, end) changes; start/end are (line, column) or None for the whole text."""
        state = self._docs.get(uri)
        if state is None:
            if self.initialized:
                self._once(f"unknown:{uri}", "warning", f"lingls: change to {uri}, which is not open: ignored")
            return
        for text, start, end in changes:
            state.doc.apply_change(text, start, end, self.encoding)
        state.doc.version = version

    def close(self, uri: str) -> None:
        state = self._docs.pop(uri, None)
        if state is not None:
            self._drop(state)

    def _drop(self, state: _DocState) -> None:
        if state.request is not None and not state.request.superseded.done():
            state.request.superseded.set_result(None)
        for gen in state.generations:
            gen.stop()

    # ---- completion ------------------------------------------------------------------------------------

    async def complete(self, uri: str, line: int, column: int, invoked: bool = False,
                       timing: dict | None = None) -> list[Item]:
        """The items for a cursor. `timing` (the transport's record of this request, if any) gets this
        request's timings: engine_ms (inside the engine's stream or loading it), debounce_ms, source,
        total_ms, and perf_counter timestamps of its phases (t_start, t_prompt, t_started, t_answer)."""
        if not self.initialized:
            raise NotInitialized("lingls has not received initialize yet")
        self.counters.requests += 1
        state = self._docs.get(uri)
        if state is None:
            self._once(f"unknown:{uri}", "warning", f"lingls: completion asked for {uri}, which is not open")
            return []
        if not self.settings.language_enabled(state.doc.language_id):
            return []
        req = self._supersede(state)
        if timing is None:
            timing = {}
        timing.update(engine_ms=0.0, debounce_ms=0.0, source="none", t_start=req.started)
        try:
            items = await self._complete(state, req, line, column, invoked, timing)
        except asyncio.CancelledError:
            self.counters.cancelled += 1
            raise
        finally:
            if state.request is req:
                state.request = None
            timing["t_answer"] = now = time.perf_counter()
            timing["total_ms"] = (now - req.started) * 1000
            self.timings.append(timing)
        self.counters.answered += bool(items)
        self.counters.shown += len(items)
        return items

    def _supersede(self, state: _DocState) -> _Request:
        old = state.request
        if old is not None and not old.superseded.done():
            old.superseded.set_result(None)
            self.counters.superseded += 1
        state.request = _Request(asyncio.get_running_loop().create_future())
        return state.request

    async def _complete(self, state: _DocState, req: _Request, line: int, column: int, invoked: bool,
                        timing: dict) -> list[Item]:
        doc = state.doc
        try:
            offset = doc.offset_at(line, column, self.encoding, strict=True)
        except PositionError as exc:
            self._once(f"position:{doc.uri}", "warning", f"lingls: {exc} in {doc.uri}: no completion")
            return []
        if "\0" in doc.text[max(0, offset - BINARY_PROBE) : offset + BINARY_PROBE]:
            self._once(f"binary:{doc.uri}", "info", f"lingls: {doc.uri} looks binary: no completions there")
            return []
        place = _Place.at(doc, offset)
        site = self._site(doc.text, doc.language_id, offset)
        found = await self._reuse(state, req, offset, site, timing)
        if found is None:
            found = await self._generate(state, req, place, site, invoked, timing)
        if not found:
            return []
        gen, typed, text = found
        items = [self._item(state, gen, place, typed, text)]
        if invoked:
            items += await self._samples(state, req, place, site, {text}, timing)
        return [item for item in items if item is not None]

    async def _reuse(self, state: _DocState, req: _Request, offset: int, site: Site,
                     timing: dict) -> tuple[Generation, str, str] | tuple[()] | None:
        """(generation, typed, text) from a generation that still applies here; () when superseded; None
        when there is none or it went another way than the user typed."""
        gen, typed = self._find(state, offset)
        if gen is None:
            return None
        source = "type-through" if gen.done else "reuse"
        status, text = await self._read(req, gen, typed, site, timing)
        if status == "superseded":
            return ()
        if status != "ok":
            return None
        timing["source"] = source
        if source == "reuse":
            self.counters.reused_in_flight += 1
        else:
            self.counters.type_through += 1
        return gen, typed, text

    async def _generate(self, state: _DocState, req: _Request, place: "_Place", site: Site, invoked: bool,
                        timing: dict) -> tuple[Generation, str, str] | tuple[()]:
        """Ask the model, after the debounce (Automatic requests only)."""
        doc = state.doc
        if self.settings.debounce_ms and not invoked:
            t = time.perf_counter()
            ok = await self._wait(req, None, self.settings.debounce_ms / 1000)
            timing["debounce_ms"] = (time.perf_counter() - t) * 1000
            if not ok:
                return ()
        t = time.perf_counter()
        engine = await self._engine(req)
        timing["engine_ms"] += (time.perf_counter() - t) * 1000
        if engine is None or doc.edits != place.edits:
            return ()  # no engine, superseded, or the text moved on: a newer request will come
        # the confidence gate for automatic suggestions only: one the user asked for shows what the model has
        gen = self._start(state, engine, doc.text, place.offset, site, timing=timing,
                          min_line_probability=0.0 if invoked else self.settings.min_line_probability)
        if gen is None:
            return ()
        timing["source"] = "model"
        status, text = await self._read(req, gen, "", site, timing)
        timing["t_first_chunk"] = gen.first_chunk_at
        return (gen, "", text) if status == "ok" else ()

    async def _samples(self, state: _DocState, req: _Request, place: "_Place", site: Site, seen: set[str],
                       timing: dict) -> list[Item | None]:
        """Up to two more distinct items for an Invoked request, sampled one after the other (batch 1)."""
        engine, doc = self.engines.loaded, state.doc
        items = []
        for temperature, seed in SAMPLES:
            if engine is None or req.superseded.done() or doc.edits != place.edits:
                break
            gen = self._start(state, engine, doc.text, place.offset, site, temperature, seed)
            if gen is None:
                break
            status, text = await self._read(req, gen, "", site, timing)
            if status == "ok" and text not in seen:
                seen.add(text)
                items.append(self._item(state, gen, place, "", text))
        return items

    def _find(self, state: _DocState, offset: int) -> tuple[Generation | None, str]:
        for gen in reversed(state.generations):
            typed = gen.match(state.doc.text, offset)
            if typed is not None and not gen.error:
                return gen, typed
        return None, ""

    async def _read(self, req: _Request, gen: Generation, typed: str, site: Site, timing: dict) -> tuple[str, str]:
        """Wait until `gen` has a complete answer for `site`, `typed` characters past its anchor.

        Returns (status, text): ok, empty (nothing worth showing), superseded, diverged (the model wrote
        something else than was typed), stopped (cut off before a complete answer) or failed. A request
        cancelled by the client stops the generation if no other request reads it."""
        gen.readers += 1
        try:
            while True:
                if gen.text.startswith(typed):
                    # A stopped or failed stream's end is not the model's end.
                    final = gen.done and not gen.stopped and gen.error is None
                    cleaned = gen.cleaned(typed, site, final=final)
                    if cleaned.complete:
                        self._told.discard("engine-generate")
                        return ("ok" if cleaned.text else "empty"), cleaned.text
                    if gen.error is not None:
                        return self._failed(gen.error), ""
                    if gen.done:
                        return "stopped", ""
                elif gen.done or not typed.startswith(gen.text):
                    return "diverged", ""
                # Only the part of the wait spent inside the engine's stream is the engine's; the rest
                # (waking this task, the generation's own clean-up per chunk) is the LSP's.
                before = gen.engine_time()
                ok = await self._wait(req, gen.progress())
                timing["engine_ms"] += (gen.engine_time() - before) * 1000
                if not ok:
                    return "superseded", ""
        except asyncio.CancelledError:
            if gen.readers == 1:
                gen.stop()
            raise
        finally:
            gen.readers -= 1

    def _failed(self, exc: BaseException) -> str:
        self.counters.errors += 1
        self._once("engine-generate", "error", describe_failure(exc, self.settings), show=True)
        return "failed"

    async def _wait(self, req: _Request, fut: asyncio.Future | None, timeout: float | None = None) -> bool:
        """Wait for `fut` (or `timeout`); False when the request was superseded meanwhile."""
        waits = {req.superseded} if fut is None else {req.superseded, fut}
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        return not req.superseded.done()

    async def _engine(self, req: _Request) -> Engine | None:
        task = self.engines.start(self.settings)
        if not task.done() and not await self._wait(req, task):
            return None
        if task.cancelled():
            return None
        if (exc := task.exception()) is not None:
            self._once("engine-load", "error", describe_failure(exc, self.settings), show=True)
            return None
        engine = task.result()
        if self._counter_engine is not engine:
            self._counter, self._counter_engine = TokenCounter(engine.count_tokens), engine
        return engine

    def _start(self, state: _DocState, engine: Engine, text: str, offset: int, site: Site,
               temperature: float = 0.0, seed: int | None = None, timing: dict | None = None,
               min_line_probability: float = 0.0) -> Generation | None:
        """Build the prompt and start one generation (stopping any other: the runtime is batch-1).

        None when the prompt is empty (a left-to-right model at the start of an empty file): there is
        nothing to continue, so the answer is empty rather than the engine's error."""
        doc = state.doc
        if timing is not None:
            timing["t_prompt"] = time.perf_counter()
        prompt = build_prompt(text, offset, fim=engine.fim, counter=self._counter, budget=self.settings.prompt_tokens,
                              chunks=self._ring.chunks_for(doc.uri), path=self._label(doc.uri))
        if not prompt.text:
            return None
        if self._running is not None:
            self._running.stop()
        specials = engine.fim.special_tokens() if engine.fim else ()
        gen = Generation(doc.uri, text, offset, site, specials)
        gen.start(engine, GenerateRequest(prompt.text, max_tokens=self.settings.max_tokens,
                                          temperature=temperature, seed=seed, parts=prompt.parts,
                                          min_line_probability=min_line_probability))
        self._running = gen
        if timing is not None:
            timing["t_started"] = time.perf_counter()
        self.counters.engine_calls += 1
        state.generations.append(gen)
        for old in state.generations[:-KEEP_GENERATIONS]:
            old.stop()
        del state.generations[:-KEEP_GENERATIONS]
        if text is doc.text:
            self._offer_chunk(state, offset)
        return gen

    def _offer_chunk(self, state: _DocState, offset: int) -> None:
        """Keep this document's chunk in the context ring near where the user works, without rebuilding it on
        every keystroke."""
        doc = state.doc
        line = doc.position_at(offset)[0]
        state.ring_age += 1
        if abs(line - state.ring_line) >= RING_MOVE or state.ring_age >= RING_AGE:
            self._ring.offer(doc.uri, self._label(doc.uri), *doc.window(line))
            state.ring_line, state.ring_age = line, 0

    def _site(self, text: str, language_id: str, offset: int) -> Site:
        start = text.rfind("\n", 0, offset) + 1
        end = text.find("\n", offset)
        end = len(text) if end < 0 else end
        next_line = ""
        pos = end
        for _ in range(32):  # the first non-blank line after the cursor's, not far
            if pos >= len(text):
                break
            nl = text.find("\n", pos + 1)
            nl = len(text) if nl < 0 else nl
            if text[pos + 1 : nl].strip():
                next_line = text[pos + 1 : nl]
                break
            pos = nl
        prev_line, pos = "", start - 1
        for _ in range(32):  # the last non-blank line before the cursor's, not far: the degeneration guard's anchor
            if pos <= 0:
                break
            begin = text.rfind("\n", 0, pos) + 1
            if text[begin:pos].strip():
                prev_line = text[begin:pos]
                break
            pos = begin - 1
        return Site(text[max(start, offset - 2000) : offset], text[offset:end].rstrip("\r"), next_line.rstrip("\r"),
                    lang_for(language_id), self.settings.max_lines, prev_line=prev_line.rstrip("\r"))

    def _item(self, state: _DocState, gen: Generation, place: "_Place", typed: str, text: str) -> Item | None:
        """The answer with its range: from the request's position over what was typed since the request
        (the completion starts with it, so it is replaced, not doubled). None when the document went
        elsewhere meanwhile; a newer request covers that."""
        doc = state.doc
        late_end = place.late_end(doc.text)
        if late_end is None:
            return None
        late = doc.text[place.offset : late_end]
        if "\n" in late or "\r" in late or not text.startswith(late):
            return None
        accept = {"uri": doc.uri, "generation": gen.id, "offset": place.offset, "raw": len(typed), "text": text}
        return Item(text, doc.position_at(place.offset, self.encoding), doc.position_at(late_end, self.encoding),
                    accept)

    # ---- acceptance ------------------------------------------------------------------------------------

    def accept(self, args: Any) -> None:
        """Record an accepted item (the `lingls.accept` command) and make sure what follows it is coming:
        the generation that produced it usually runs on past it; if not, prefetch the continuation."""
        if not (isinstance(args, dict) and isinstance(args.get("uri"), str) and isinstance(args.get("text"), str)
                and all(isinstance(args.get(k), int) for k in ("generation", "offset", "raw"))):
            self._once("accept-args", "warning", f"lingls: {ACCEPT_COMMAND} with unexpected arguments: ignored")
            return
        uri, text, offset = args["uri"], args["text"], args["offset"]
        self.counters.accepted += 1
        self.counters.accepted_chars += len(text)
        state = self._docs.get(uri)
        language = state.doc.language_id if state else ""
        self.accepted_log.append({"uri": uri, "language": language, "chars": len(text),
                                  "lines": text.count("\n") + 1, "time": time.time()})
        engine = self.engines.loaded
        if state is None or engine is None or not 0 <= offset <= len(state.doc.text):
            return
        cursor = offset + len(text)
        now = state.doc.text
        virtual = now if now[offset:cursor] == text else now[:offset] + text + now[offset:]
        site = self._site(virtual, language, cursor)
        gen = next((g for g in state.generations if g.id == args["generation"]), None)
        if gen is not None and gen.error is None:
            rest = gen.text[args["raw"] + len(text) :]
            if not gen.done or clean(rest, site, gen.specials, final=True).text:
                return
        self.counters.prefetches += 1  # shown without being asked for: gated as an automatic suggestion
        self._start(state, engine, virtual, cursor, site, min_line_probability=self.settings.min_line_probability)

    # ---- status ----------------------------------------------------------------------------------------

    def stats(self) -> dict:
        engine = self.engines.loaded
        return {
            "counters": vars(self.counters).copy(),
            "engine": None if engine is None else {"name": engine.name, **vars(engine.stats)},
            "running": self._running is not None and not self._running.done,
            "documents": len(self._docs),
            "context_chunks": len(self._ring),
            "timings": list(self.timings),
            "accepted": list(self.accepted_log)[-20:],
            "settings": vars(self.settings).copy(),
        }

    def _once(self, key: str, level: str, message: str, show: bool = False) -> None:
        """Tell the user once (per key) rather than on every keystroke."""
        if key in self._told:
            return
        self._told.add(key)
        self.notifier.log(level, message)
        if show:
            self.notifier.show(level, message)

    def _label(self, uri: str) -> str:
        path = _path_of(uri)
        if self.root and path.startswith(self.root.rstrip("/") + "/"):
            return path[len(self.root.rstrip("/")) + 1 :]
        return path.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class _Place:
    """The cursor of a request: its offset and the text around it, to find it again after edits."""

    offset: int
    before: str
    after: str
    length: int
    edits: int  # the document's edit count then

    @classmethod
    def at(cls, doc: Document, offset: int) -> "_Place":
        text = doc.text
        return cls(offset, text[max(0, offset - WINDOW) : offset], text[offset : offset + WINDOW], len(text),
                   doc.edits)

    def late_end(self, text: str) -> int | None:
        """End of the characters inserted at the cursor since, if that is the only change; else None."""
        end = self.offset + len(text) - self.length
        if end < self.offset or text[max(0, self.offset - WINDOW) : self.offset] != self.before:
            return None
        return end if text[end : end + WINDOW] == self.after else None


def _path_of(uri: str) -> str:
    parsed = urllib.parse.urlparse(uri)
    return urllib.parse.unquote(parsed.path) if parsed.scheme in ("file", "") else uri
