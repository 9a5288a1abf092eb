"""The pygls 2 language server: thin handlers that map LSP messages onto `session.Core`."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import re
import sys
import threading
import time
from functools import partial
from typing import Any

from lsprotocol import types as lsp
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams, JsonRpcServerNotInitialized
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method

from lingls import __version__
from lingls.lsp.session import ACCEPT_COMMAND, Core, NotInitialized
from lingls.lsp.settings import Settings, from_cli

STATS_COMMAND = "lingls.stats"
log = logging.getLogger("lingls")

_LEVELS = {"error": lsp.MessageType.Error, "warning": lsp.MessageType.Warning, "info": lsp.MessageType.Info,
           "log": lsp.MessageType.Log}


class _Protocol(LanguageServerProtocol):
    """pygls' protocol with two changes.

    Document sync goes only to lingls' store (documents.py): pygls' workspace copy would re-split the whole
    text on every keystroke. And a request whose params do not parse gets an InvalidParams answer: pygls
    would log it and leave the client waiting forever."""

    def _user(self, method: str, params: Any):
        if (handler := self.fm.features.get(method)) is not None:
            yield handler, (params,), None

    @lsp_method(lsp.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: lsp.DidOpenTextDocumentParams):
        yield from self._user(lsp.TEXT_DOCUMENT_DID_OPEN, params)

    @lsp_method(lsp.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: lsp.DidChangeTextDocumentParams):
        yield from self._user(lsp.TEXT_DOCUMENT_DID_CHANGE, params)

    @lsp_method(lsp.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: lsp.DidCloseTextDocumentParams):
        yield from self._user(lsp.TEXT_DOCUMENT_DID_CLOSE, params)

    # ---- per-request timestamps (perf_counter seconds), for `lingls.stats` and `lingls bench lsp` --------
    # t_recv: when the request's first bytes were read from the client; t_parsed: after JSON parsing; t_result:
    # the handler's result handed to pygls; t_write: serialized, the write to the client starts; t_sent: the
    # write returned (it can return late: waking the client may let it run first on a busy machine).
    # change_*: the same for the last didChange before the request (a keystroke is a didChange + a request).
    traces: dict
    _arrival: tuple[float, float] | None = None
    _last_change: tuple[float, float, float] | None = None

    def handle_message(self, message: Any) -> None:
        arrival, self._arrival = self._arrival, None
        if arrival is None:  # a transport without the framer below: no read timestamp
            now = time.perf_counter()
            arrival = (now, now)
        method = getattr(message, "method", None)
        if method == lsp.TEXT_DOCUMENT_INLINE_COMPLETION and getattr(message, "id", None) is not None:
            traces = self.__dict__.setdefault("traces", {})
            if len(traces) > 1024:  # answers that were never sent (should not happen): forget the oldest
                traces.pop(next(iter(traces)))
            trace = traces[message.id] = {"t_recv": arrival[0], "t_parsed": arrival[1]}
            if self._last_change is not None:
                trace["change_recv"], trace["change_parsed"], trace["change_done"] = self._last_change
        super().handle_message(message)
        if method == lsp.TEXT_DOCUMENT_DID_CHANGE:
            self._last_change = (*arrival, time.perf_counter())

    def trace_of_current_request(self) -> dict | None:
        return self.__dict__.get("traces", {}).get(self.msg_id)

    def _send_response(self, msg_id: Any, result: Any = None, error: Any = None) -> None:
        trace = self.__dict__.get("traces", {}).pop(msg_id, None)
        if trace is not None:
            trace["t_result"] = time.perf_counter()
        if error is None and type(result) is _Json and self.writer is not None:
            body = json.dumps({"jsonrpc": "2.0", "id": msg_id, "result": result}, separators=(",", ":")).encode()
            data = b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
            if trace is not None:
                trace["t_write"] = time.perf_counter()  # serialized; the write (waking the client) starts
            self.writer.write(data)
        else:
            if trace is not None:
                trace["t_write"] = trace["t_result"]
            super()._send_response(msg_id, result, error)
        if trace is not None:
            trace["t_sent"] = time.perf_counter()

    # ---- the keystroke's hot path, without cattrs ------------------------------------------------------
    # A keystroke is a didChange and an inlineCompletion request. pygls turns each into lsprotocol objects
    # through cattrs and runs it through its generic handler machinery (a generator, two uuids, a context
    # copy): on a 2-core VM that is most of the LSP's time per keystroke. Messages of the usual shape take
    # this direct path to the same handlers; anything else (or odd) goes the generic way.

    def dispatch_fast(self, data: dict, arrival: tuple[float, float]) -> bool:
        """Handle a parsed message directly if it is a well-formed didChange or inlineCompletion; False if
        it must go pygls' way."""
        method = data.get("method")
        if self._shutdown or data.get("jsonrpc") != "2.0" or type(params := data.get("params")) is not dict:
            return False
        doc = params.get("textDocument")
        if type(doc) is not dict or type(uri := doc.get("uri")) is not str:
            return False
        core = self._server.core
        if method == lsp.TEXT_DOCUMENT_DID_CHANGE:
            version = doc.get("version")
            if "id" in data or type(version) is not int or (changes := _changes(params.get("contentChanges"))) is None:
                return False
            try:
                core.change(uri, version, changes)
            except Exception as exc:
                log.exception("didChange failed")
                self._server.report_server_error(exc, JsonRpcException)
            self._last_change = (*arrival, time.perf_counter())
            return True
        if method == lsp.TEXT_DOCUMENT_INLINE_COMPLETION:
            msg_id = data.get("id")
            context = params.get("context")
            if (type(msg_id) not in (int, str) or (pos := _position(params.get("position"))) is None
                    or type(context) is not dict or context.get("triggerKind") not in (1, 2)):
                return False
            traces = self.__dict__.setdefault("traces", {})
            trace = traces[msg_id] = {"t_recv": arrival[0], "t_parsed": arrival[1]}
            if self._last_change is not None:
                trace["change_recv"], trace["change_parsed"], trace["change_done"] = self._last_change
            task = asyncio.ensure_future(self._server.complete_json(uri, *pos, context["triggerKind"] == 1, trace))
            self._request_futures[msg_id] = task  # for $/cancelRequest
            task.add_done_callback(partial(self._send_handler_result, msg_id=msg_id))
            return True
        return False

    def structure_message(self, data: dict):
        try:
            return super().structure_message(data)
        except JsonRpcException:
            if "id" in data and "method" in data:
                error = JsonRpcInvalidParams(f"lingls: invalid params for {data['method']}")
                self._send_response(data["id"], error=error.to_response_error())
            raise


class _Server(LanguageServer):
    core: Core

    async def complete_json(self, uri: str, line: int, character: int, invoked: bool, trace: dict | None) -> _Json:
        try:
            items = await self.core.complete(uri, line, character, invoked, trace)
        except NotInitialized as exc:
            raise JsonRpcServerNotInitialized(str(exc)) from None
        return _items_json(items)

    def report_server_error(self, error: Exception, source: Any) -> None:
        """Errors outside a request go to the log, not to a pop-up per bad message."""
        log.error("%s", error)
        self.window_log_message(lsp.LogMessageParams(lsp.MessageType.Error, f"lingls: {error}"))


class _Notifier:
    def __init__(self, server: LanguageServer):
        self._server = server

    def log(self, level: str, message: str) -> None:
        getattr(log, "debug" if level == "log" else level)(message)
        self._server.window_log_message(lsp.LogMessageParams(_LEVELS[level], message))

    def show(self, level: str, message: str) -> None:
        self._server.window_show_message(lsp.ShowMessageParams(_LEVELS[level], message))


class _Json(list):
    """A result that is already plain JSON (lists, dicts, str, int): written as is, no cattrs round trip."""


def _items_json(items) -> _Json:
    """InlineCompletionItem[] as the JSON lsprotocol would write for them."""
    return _Json({"insertText": i.text,
                  "range": {"start": {"line": i.start[0], "character": i.start[1]},
                            "end": {"line": i.end[0], "character": i.end[1]}},
                  "command": {"title": "Accept completion", "command": ACCEPT_COMMAND, "arguments": [i.accept]}}
                 for i in items)


def _position(p: Any) -> tuple[int, int] | None:
    """(line, character) of a JSON position with non-negative ints, else None."""
    if type(p) is dict:
        line, character = p.get("line"), p.get("character")
        if type(line) is int and type(character) is int and line >= 0 and character >= 0:
            return line, character
    return None


def _changes(raw: Any) -> list | None:
    """didChange's contentChanges as (text, start, end) tuples, or None if they are not the usual shape."""
    if type(raw) is not list:
        return None
    out = []
    for c in raw:
        if type(c) is not dict or type(c.get("text")) is not str:
            return None
        if "range" not in c:
            if len(c) != 1:
                return None
            out.append((c["text"], None, None))
            continue
        r = c["range"]
        if type(r) is not dict or (start := _position(r.get("start"))) is None or (end := _position(r.get("end"))) is None:
            return None
        out.append((c["text"], start, end))
    return out


def build_server(settings: Settings | None = None) -> LanguageServer:
    server = _Server("lingls", __version__, protocol_cls=_Protocol,
                     text_document_sync_kind=lsp.TextDocumentSyncKind.Incremental)
    core = server.core = Core(_Notifier(server), settings)

    @server.feature(lsp.INITIALIZE)
    def initialize(params: lsp.InitializeParams) -> None:
        encoding = server.workspace.position_encoding or "utf-16"
        folders = params.workspace_folders or []
        root = params.root_uri or (folders[0].uri if folders else None)
        core.initialize(params.initialization_options, getattr(encoding, "value", encoding), root)

    @server.feature(lsp.INITIALIZED)
    def initialized(params: lsp.InitializedParams) -> None:
        core.warm_up()
        if core.settings.enable:
            core.engines.start(core.settings).add_done_callback(_freeze_heap)

    @server.feature(lsp.SHUTDOWN)
    async def shutdown(params: None) -> None:
        await core.shutdown()

    @server.feature(lsp.TEXT_DOCUMENT_DID_OPEN)
    def did_open(params: lsp.DidOpenTextDocumentParams) -> None:
        d = params.text_document
        core.open(d.uri, d.language_id, d.version, d.text)

    @server.feature(lsp.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(params: lsp.DidChangeTextDocumentParams) -> None:
        changes = []
        for c in params.content_changes:
            if isinstance(c, lsp.TextDocumentContentChangePartial):
                r = c.range
                changes.append((c.text, (r.start.line, r.start.character), (r.end.line, r.end.character)))
            else:
                changes.append((c.text, None, None))
        core.change(params.text_document.uri, params.text_document.version, changes)

    @server.feature(lsp.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(params: lsp.DidCloseTextDocumentParams) -> None:
        core.close(params.text_document.uri)

    @server.feature(lsp.WORKSPACE_DID_CHANGE_CONFIGURATION)
    def did_change_configuration(params: lsp.DidChangeConfigurationParams) -> None:
        core.configure(params.settings)

    @server.feature(lsp.TEXT_DOCUMENT_INLINE_COMPLETION, lsp.InlineCompletionOptions())
    async def inline_completion(params: lsp.InlineCompletionParams) -> _Json:
        # Usually answered by _Protocol.dispatch_fast; this is the way for other transports and odd messages.
        invoked = params.context.trigger_kind == lsp.InlineCompletionTriggerKind.Invoked
        pos = params.position
        return await server.complete_json(params.text_document.uri, pos.line, pos.character, invoked,
                                          server.protocol.trace_of_current_request())

    @server.command(ACCEPT_COMMAND)
    def accept(*args: Any) -> None:
        core.accept(args[0] if args else None)

    @server.command(STATS_COMMAND)
    def stats(*args: Any) -> dict:
        return core.stats()

    return server


# How often a thread holding the GIL is asked to hand it over. An in-process model's worker thread runs long
# stretches of Python between GIL releases; at the default 5 ms the event loop could wait that long to answer
# a keystroke. 0.5 ms keeps the editor's messages prompt at a small cost to the worker.
GIL_SWITCH_INTERVAL_S = 0.0005


def main(args: Any) -> int:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    if getattr(args, "log_file", None):
        logging.basicConfig(filename=args.log_file, level=logging.WARNING,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        log.setLevel(logging.DEBUG)
    server = build_server(from_cli(args))
    if getattr(args, "tcp", False):
        server.start_tcp(args.host, args.port)
    else:
        start_stdio(server)
    return 0


_HEADER_END = b"\r\n\r\n"
_CONTENT_LENGTH = re.compile(rb"(?:^|\n)content-length:[ \t]*(\d+)", re.IGNORECASE)
MAX_HEADER = 8192  # bytes of headers without their blank line: not a client speaking LSP; dropped


class _FdWriter:
    """Writes straight to a file descriptor (stdout), without a buffer to flush."""

    def __init__(self, fd: int):
        self._fd = fd

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        pass


def _freeze_heap(_: Any = None) -> None:
    """Once the engine is loaded: collect, then move everything alive to the permanent generation, so later
    collections (every few keystrokes) do not walk the model's and the libraries' objects."""
    gc.collect()
    gc.freeze()


class _Framer(asyncio.Protocol):
    """Reads JSON-RPC messages from a pipe and hands each to the protocol from the read callback itself.

    pygls' start_io reads through a thread pool (one thread hop per header line and body), and its asyncio
    loop (run_async over a StreamReader) wakes a coroutine per header line and body: several event-loop
    iterations per message, each a chance to sleep. Here a message is dispatched in the same callback that
    read its last byte. It also records when each message's first bytes were read (the request's t_recv)."""

    def __init__(self, server: "_Server", done: asyncio.Future):
        self._server = server
        self._protocol: _Protocol = server.protocol
        self._done = done
        self._buf = bytearray()
        self._arrived = 0.0

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        buf = self._buf
        if not buf:
            self._arrived = now
        buf += data
        while buf:
            end = buf.find(_HEADER_END)
            if end < 0:
                if len(buf) > MAX_HEADER:
                    log.error("dropped %d bytes of input that are not an LSP header", len(buf))
                    buf.clear()
                return
            match = _CONTENT_LENGTH.search(buf, 0, end)
            start = end + len(_HEADER_END)
            if match is None:
                log.error("dropped a header without Content-Length: %r", bytes(buf[: min(end, 200)]))
                del buf[:start]
                continue
            stop = start + int(match.group(1))
            if len(buf) < stop:
                return
            body = bytes(buf[start:stop])
            del buf[:stop]
            arrived, self._arrived = self._arrived, now
            self._dispatch(body, arrived)
            if self._server._stop_event.is_set():
                self._finish()
                return

    def _dispatch(self, body: bytes, arrived: float) -> None:
        protocol = self._protocol
        try:
            data = json.loads(body)
            if type(data) is dict and protocol.dispatch_fast(data, (arrived, time.perf_counter())):
                return
            message = json.loads(body, object_hook=protocol.structure_message)
            protocol._arrival = (arrived, time.perf_counter())
            protocol.handle_message(message)
        except BrokenPipeError:
            self._finish(BrokenPipeError())
        except Exception as exc:
            protocol._arrival = None
            log.exception("Unable to handle message")
            self._server.report_server_error(exc, JsonRpcException)

    def eof_received(self) -> bool:
        self._finish()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish()

    def _finish(self, exc: BaseException | None = None) -> None:
        if not self._done.done():
            if exc is None:
                self._done.set_result(None)
            else:
                self._done.set_exception(exc)


def start_stdio(server: LanguageServer) -> None:
    """Serve over stdin/stdout, reading stdin as an asyncio pipe (see _Framer).

    Falls back to pygls' start_io when stdin is not a pipe (a file, a terminal)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    server._stop_event = threading.Event()  # what pygls' shutdown() sets (on exit)
    done = loop.create_future()
    sys.stdout.flush()
    server.protocol.set_writer(_FdWriter(sys.stdout.fileno()))
    try:
        loop.run_until_complete(loop.connect_read_pipe(lambda: _Framer(server, done), sys.stdin.buffer))
    except (ValueError, OSError):
        loop.close()
        server.start_io()
        return
    try:
        loop.run_until_complete(done)
    except BrokenPipeError:
        log.error("the client went away")
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.shutdown()
        loop.close()
