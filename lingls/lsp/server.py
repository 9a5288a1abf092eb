"""The pygls 2 language server: thin handlers that map LSP messages onto `session.Core`."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import re
import signal
import stat
import sys
import threading
import time
from functools import partial
from typing import Any

from lsprotocol import types as lsp
from pygls.exceptions import (
    JsonRpcException,
    JsonRpcInvalidParams,
    JsonRpcInvalidRequest,
    JsonRpcParseError,
    JsonRpcServerNotInitialized,
)
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

    exit_code = 0  # the process's, set by `exit`: 1 unless `shutdown` came first (the LSP's rule)

    @lsp_method(lsp.EXIT)
    def lsp_exit(self, *args):
        self.exit_code = 0 if self._shutdown else 1
        yield from super().lsp_exit(*args)

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
            if "id" in data:
                return False
            version = doc.get("version")
            if type(version) is not int or (changes := _changes(params.get("contentChanges"))) is None:
                # pygls' converter would read it anyway (`"text": 5` as "5") and corrupt the document
                self._server.report_server_error(ValueError(f"didChange of {uri} with malformed params: ignored"),
                                                 JsonRpcException)
                return True
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


class _ClientMistakes(logging.Filter):
    """Keeps pygls' traceback for a message whose params do not parse out of the log (stderr, by default):
    it is the client's mistake, answered with InvalidParams and logged in one line by lingls."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unable to deserialize message")


logging.getLogger("pygls.protocol.json_rpc").addFilter(_ClientMistakes())


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
        self._loads = 0  # progress tokens made so far (one per engine load)
        self._begun: asyncio.Future | None = None  # the current load's progress begin: its token, or None

    def log(self, level: str, message: str) -> None:
        getattr(log, "debug" if level == "log" else level)(message)
        self._server.window_log_message(lsp.LogMessageParams(_LEVELS[level], message))

    def show(self, level: str, message: str) -> None:
        self._server.window_show_message(lsp.ShowMessageParams(_LEVELS[level], message))

    # The engine's loading as LSP work-done progress, for a client that shows it (window.workDoneProgress): a
    # token the server creates (window/workDoneProgress/create), `$/progress` begin, then end. An editor's
    # "ready" then means the model is loaded, not only that the server process runs.
    def loading(self, what: str) -> None:
        window = self._server.client_capabilities.window
        if not (window and window.work_done_progress):
            return
        self._loads += 1
        token = f"lingls/loading/{self._loads}"
        self._begun = asyncio.ensure_future(self._begin(token, what))

    async def _begin(self, token: str, what: str) -> str | None:
        progress = self._server.work_done_progress
        try:
            await progress.create_async(token)
        except Exception as exc:  # a client that refuses the token shows no progress; loading goes on
            log.info("the client refused a progress token: %s", exc)
            return None
        progress.begin(token, lsp.WorkDoneProgressBegin(title="lingls", message=what))
        return token

    def loaded(self, outcome: str) -> None:
        begun, self._begun = self._begun, None
        if begun is not None:
            begun.add_done_callback(partial(self._end, outcome))

    def _end(self, outcome: str, begun: asyncio.Future) -> None:
        token = None if begun.cancelled() or begun.exception() else begun.result()
        if token is not None:
            self._server.work_done_progress.end(token, lsp.WorkDoneProgressEnd(message=outcome))


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
    """didChange's contentChanges as (text, start, end) tuples, or None if they are malformed."""
    if type(raw) is not list:
        return None
    out = []
    for c in raw:
        if type(c) is not dict or type(c.get("text")) is not str:
            return None
        if "range" not in c:
            out.append((c["text"], None, None))
            continue
        r = c["range"]
        if (type(r) is not dict or (start := _position(r.get("start"))) is None
                or (end := _position(r.get("end"))) is None):
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
    """Serve until the client exits (0 after `shutdown`, 1 without, as the LSP asks), stdin ends, stdout is
    closed, or SIGTERM/SIGINT arrives (0)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    if getattr(args, "log_file", None):
        logging.basicConfig(filename=args.log_file, level=logging.WARNING,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        log.setLevel(logging.DEBUG)
    server = build_server(from_cli(args))
    if getattr(args, "tcp", False):
        return start_tcp(server, args.host, args.port)
    return start_stdio(server)


# A message's Content-Length line. A raw CR LF right after the digits cannot occur inside a JSON body (a string
# holds no raw CR; outside strings `content-length:` is no JSON token), so wherever this turns up it starts a
# message's headers: the framer finds the next message through it after any fault in the framing.
_CONTENT_LENGTH = re.compile(rb"content-length:[ \t]*(\d+)[ \t]*\r\n", re.IGNORECASE)
_HEADER_LINE = re.compile(rb"[!-9;-~]+:[^\r\n]*\r\n")  # another header (Content-Type): skipped
_HEADER_LINES = re.compile(rb"(?:[!-9;-~]+:[^\r\n]*\r\n)*")
MAX_HEADER = 8192  # bytes without a header in them: not a client speaking LSP; dropped
BODY_STALL_S = 1.0  # a declared body still short this long after the last read, holding a whole JSON value: misframed
SHUTDOWN_S = 5.0  # how long the engine gets to stop when the client leaves without `shutdown`


class _FdWriter:
    """Writes straight to a file descriptor (stdout), without a buffer to flush.

    A client that closed its end (an editor quitting) ends the server through `on_closed`, quietly: what was
    left to say is for nobody."""

    def __init__(self, fd: int, on_closed):
        self._fd = fd
        self._on_closed = on_closed
        self.closed = False

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view and not self.closed:
                view = view[os.write(self._fd, view) :]
        except (BrokenPipeError, ConnectionResetError):
            self.closed = True
            log.info("the client closed the server's stdout")
            self._on_closed()

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
    read its last byte. It also records when each message's first bytes were read (the request's t_recv).

    A framing fault (a wrong Content-Length, a missing or non-numeric header, garbage between messages) costs
    that message only: it is answered with a parse error and reading goes on at the next Content-Length line
    (see _CONTENT_LENGTH), even one that turns up inside a body whose declared length runs past it."""

    def __init__(self, server: "_Server", done: asyncio.Future):
        self._server = server
        self._protocol: _Protocol = server.protocol
        self._done = done
        self._buf = bytearray()
        self._arrived = 0.0
        self._scanned = 0  # how far the body being waited for was searched for a next header
        self._stall: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        buf = self._buf
        if not buf:
            self._arrived = now
        buf += data
        while buf and not self._done.done():
            header = _find_header(buf, 0)
            if header is None:
                if len(buf) > MAX_HEADER:  # keep a tail that may be the start of a header
                    self._drop(len(buf) - 64, "bytes without a Content-Length header")
                return
            if header.start() and _HEADER_LINES.fullmatch(buf, 0, header.start()) is None:
                self._drop(header.start(), "bytes outside any message")
                continue
            start = _headers_end(buf, header.end())
            if start is None:
                return  # the rest of the headers is still to come
            if start < 0:
                self._drop(header.end(), "a malformed header")
                continue
            length = int(header.group(1))
            stop = start + length
            cut = _find_header(buf, max(header.end(), self._scanned))
            if cut is not None and cut.start() < start:  # a second Content-Length among the headers
                self._drop(cut.start(), "a header cut short by another")
                continue
            if cut is not None and cut.start() < stop:
                body, stop = bytes(buf[start : cut.start()]), cut.start()
                error = (f"Content-Length {length} does not frame the message: "
                         f"the next one starts after {len(body)} bytes")
            elif len(buf) < stop:
                self._scanned = max(start, len(buf) - 64)
                self._stall = asyncio.get_running_loop().call_later(BODY_STALL_S, self._stalled, start, length)
                return
            else:
                body, error = bytes(buf[start:stop]), None
            del buf[:stop]
            self._scanned = 0
            arrived, self._arrived = self._arrived, now
            if error is None:
                self._dispatch(body, arrived)
            else:
                log.warning("%s", error)
                _reply_error(self._protocol, _id_of(body), JsonRpcParseError(f"lingls: {error}"))
            if self._server._stop_event.is_set():
                self._finish()
                return

    def _stalled(self, start: int, length: int) -> None:
        """Nothing came for BODY_STALL_S and the body so far is a whole JSON value: the Content-Length is too
        large and no message follows to show it (a client waiting for the answer would wait for ever)."""
        self._stall = None
        body = bytes(self._buf[start:])
        try:
            json.loads(body)
        except (ValueError, RecursionError):
            return  # a message still being written
        self._buf.clear()
        self._scanned = 0
        error = f"Content-Length {length} but the message ended after {len(body)} bytes"
        log.warning("%s", error)
        _reply_error(self._protocol, _id_of(body), JsonRpcParseError(f"lingls: {error}"))

    def _drop(self, count: int, what: str) -> None:
        """Drop `count` bytes that belong to no message, answering a parse error (the id is unknown: null)."""
        dropped = bytes(self._buf[:count])
        del self._buf[:count]
        self._scanned = 0
        log.warning("dropped %d %s: %r", count, what, dropped[:200])
        _reply_error(self._protocol, None, JsonRpcParseError(f"lingls: dropped {count} {what}"))

    def _dispatch(self, body: bytes, arrived: float) -> None:
        protocol = self._protocol
        try:
            try:
                data = json.loads(body)
            except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested beyond reason
                reason = "not valid UTF-8" if isinstance(exc, UnicodeDecodeError) else "not valid JSON"
                _reply_error(protocol, _id_of(body), JsonRpcParseError(f"lingls: the message is {reason}: {exc}"))
                return
            if (problem := _invalid(data)) is not None:
                for msg_id in _ids_of(data):
                    _reply_error(protocol, msg_id, JsonRpcInvalidRequest(f"lingls: {problem}"))
                return
            if protocol._shutdown and data.get("method") != lsp.EXIT:
                if "method" in data and "id" in data:
                    _reply_error(protocol, data["id"], JsonRpcInvalidRequest("lingls: the server is shutting down"))
                return
            if protocol.dispatch_fast(data, (arrived, time.perf_counter())):
                return
            try:
                message = json.loads(body, object_hook=protocol.structure_message)
            except JsonRpcException as exc:  # params of the wrong shape; a request was answered (structure_message)
                log.warning("%s: %s", data.get("method"), exc)
                return
            protocol._arrival = (arrived, time.perf_counter())
            protocol.handle_message(message)
        except SystemExit:  # `exit` (pygls' way out; the code is in protocol.exit_code)
            self._finish()
        except Exception as exc:
            protocol._arrival = None
            log.exception("Unable to handle message")
            self._server.report_server_error(exc, JsonRpcException)

    def eof_received(self) -> bool:
        self._finish()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish()

    def _finish(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
        if not self._done.done():
            self._done.set_result(None)


def _find_header(buf: bytearray, pos: int) -> re.Match | None:
    """The first Content-Length line at or after `pos`, looked for only before each CR LF (a body rarely has
    one: a 10 MB didOpen is scanned at memchr speed)."""
    while (crlf := buf.find(b"\r\n", pos)) >= 0:
        if (found := _CONTENT_LENGTH.search(buf, max(pos, crlf - 80), crlf + 2)) is not None:
            return found
        pos = crlf + 2
    return None


def _headers_end(buf: bytearray, pos: int) -> int | None:
    """Where the body starts, for headers whose Content-Length line ends at `pos`: after more header lines
    and the blank line; None if they are not all here yet; -1 if they are not headers."""
    while not buf.startswith(b"\r\n", pos):
        if len(buf) - pos < 2:
            return None
        line = _HEADER_LINE.match(buf, pos)
        if line is None:
            newline = buf.find(b"\n", pos)
            return None if newline < 0 and len(buf) - pos < MAX_HEADER else -1
        pos = line.end()
    return pos + 2


def _valid_id(msg_id: Any) -> bool:
    return type(msg_id) in (int, str)


def _invalid(data: Any) -> str | None:
    """Why a parsed message is not a JSON-RPC 2.0 message the LSP allows, or None if it is one."""
    if type(data) is list:
        return "JSON-RPC batches are not part of the LSP: send each message on its own"
    if type(data) is not dict:
        return "a message must be a JSON object"
    if data.get("jsonrpc") != "2.0":
        return f'"jsonrpc" must be "2.0", not {data.get("jsonrpc")!r}'
    if "method" in data:
        if type(data["method"]) is not str:
            return '"method" must be a string'
        if "id" in data and not _valid_id(data["id"]):
            return f'a request id must be an integer or a string, not {data["id"]!r}'
        if data.get("params") is not None and type(data["params"]) not in (dict, list):
            return '"params" must be an object or an array'  # null passes: clients send it for `shutdown`
        return None
    if "id" in data and ("result" in data or "error" in data):
        return None  # a response to one of the server's requests
    return "neither a request, a notification nor a response"


def _ids_of(data: Any) -> list:
    """The ids to answer an invalid message with: each request's own when it has a usable one, else null."""
    items = data if type(data) is list else [data]
    ids = [m["id"] for m in items if type(m) is dict and "method" in m and _valid_id(m.get("id"))]
    return ids or [None]


def _id_of(body: bytes) -> Any:
    """The id of a request that could not be read as it is (broken UTF-8, wrong framing), if it can be found."""
    try:
        data = json.loads(body.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None
    return data["id"] if type(data) is dict and "method" in data and _valid_id(data.get("id")) else None


def _reply_error(protocol: _Protocol, msg_id: Any, error: JsonRpcException) -> None:
    """An error response, written directly: pygls would leave out an `"id": null`, which JSON-RPC requires."""
    e = error.to_response_error()
    body = json.dumps({"jsonrpc": "2.0", "id": msg_id, "error": {"code": e.code, "message": e.message}}).encode()
    protocol.writer.write(b"Content-Length: %d\r\n\r\n%b" % (len(body), body))


class _SocketFramer(_Framer):
    """The framer over a TCP connection: answers go back through the same socket; `on_connect` runs once the
    connection is made (the listener may be closed only then: asyncio attaches the connection to it first)."""

    def __init__(self, server: "_Server", done: asyncio.Future, on_connect):
        super().__init__(server, done)
        self._on_connect = on_connect

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._protocol.set_writer(transport)
        self._on_connect()


def _event_loop(server: LanguageServer) -> tuple[asyncio.AbstractEventLoop, asyncio.Future]:
    """A loop for one client session and the future that ends it (exit, the client gone, SIGTERM, SIGINT)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    server._stop_event = threading.Event()  # what pygls' shutdown() sets (on exit)
    done = loop.create_future()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, _end, done)
    return loop, done


def _end(done: asyncio.Future) -> None:
    if not done.done():
        done.set_result(None)


def start_stdio(server: LanguageServer) -> int:
    """Serve over stdin/stdout, reading stdin as an asyncio pipe (see _Framer); returns the exit code.

    Falls back to pygls' start_io when stdin is not a pipe or socket (a file, /dev/null, a terminal)."""
    if not stat.S_ISFIFO(mode := os.fstat(sys.stdin.fileno()).st_mode) and not stat.S_ISSOCK(mode):
        server.start_io()
        return server.protocol.exit_code
    loop, done = _event_loop(server)
    sys.stdout.flush()
    server.protocol.set_writer(_FdWriter(sys.stdout.fileno(), partial(_end, done)))
    try:
        loop.run_until_complete(loop.connect_read_pipe(lambda: _Framer(server, done), sys.stdin.buffer))
        loop.run_until_complete(done)
    finally:
        _close(server, loop)
    return server.protocol.exit_code


def start_tcp(server: LanguageServer, host: str, port: int) -> int:
    """Serve one client over TCP with the same framing as stdio (see _Framer); returns the exit code.

    Like a stdio server, the process belongs to one client: it stops listening once that client connects, and
    the session ends when the client sends `exit`, disconnects, or on SIGTERM/SIGINT."""
    loop, done = _event_loop(server)
    listener: asyncio.AbstractServer | None = None

    def stop_listening() -> None:
        listener.close()

    listener = loop.run_until_complete(loop.create_server(lambda: _SocketFramer(server, done, stop_listening), host,
                                                          port))
    log.info("listening on %s:%d", host, port)
    try:
        loop.run_until_complete(done)
    finally:
        listener.close()
        _close(server, loop)
    return server.protocol.exit_code


def _close(server: "_Server", loop: asyncio.AbstractEventLoop) -> None:
    """Stop the engine (the client may have left without `shutdown`), then every task still pending."""
    try:
        loop.run_until_complete(asyncio.wait_for(server.core.shutdown(), SHUTDOWN_S))
    except Exception:
        log.exception("the engine did not stop cleanly")
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    server.shutdown()
    loop.close()
