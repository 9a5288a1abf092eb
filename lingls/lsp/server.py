"""The pygls 2 language server: thin handlers that map LSP messages onto `session.Core`."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from typing import Any

from lsprotocol import types as lsp
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams, JsonRpcServerNotInitialized
from pygls.io_ import StdoutWriter, run_async
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

    def structure_message(self, data: dict):
        try:
            return super().structure_message(data)
        except JsonRpcException:
            if "id" in data and "method" in data:
                error = JsonRpcInvalidParams(f"lingls: invalid params for {data['method']}")
                self._send_response(data["id"], error=error.to_response_error())
            raise


class _Server(LanguageServer):
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


def _range(item) -> lsp.Range:
    return lsp.Range(lsp.Position(*item.start), lsp.Position(*item.end))


def build_server(settings: Settings | None = None) -> LanguageServer:
    server = _Server("lingls", __version__, protocol_cls=_Protocol,
                     text_document_sync_kind=lsp.TextDocumentSyncKind.Incremental)
    core = Core(_Notifier(server), settings)

    @server.feature(lsp.INITIALIZE)
    def initialize(params: lsp.InitializeParams) -> None:
        encoding = server.workspace.position_encoding or "utf-16"
        folders = params.workspace_folders or []
        root = params.root_uri or (folders[0].uri if folders else None)
        core.initialize(params.initialization_options, getattr(encoding, "value", encoding), root)

    @server.feature(lsp.INITIALIZED)
    def initialized(params: lsp.InitializedParams) -> None:
        core.warm_up()

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
    async def inline_completion(params: lsp.InlineCompletionParams) -> list[lsp.InlineCompletionItem]:
        invoked = params.context.trigger_kind == lsp.InlineCompletionTriggerKind.Invoked
        pos = params.position
        try:
            items = await core.complete(params.text_document.uri, pos.line, pos.character, invoked)
        except NotInitialized as exc:
            raise JsonRpcServerNotInitialized(str(exc)) from None
        return [
            lsp.InlineCompletionItem(insert_text=i.text, range=_range(i),
                                     command=lsp.Command(title="Accept completion", command=ACCEPT_COMMAND,
                                                         arguments=[i.accept]))
            for i in items
        ]

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


def start_stdio(server: LanguageServer) -> None:
    """Serve over stdin/stdout, reading stdin with an asyncio pipe reader.

    pygls' own start_io reads through a thread pool, one thread hop per header line and body: about a
    millisecond per keystroke (didChange + request) on a busy machine, half of the LSP's latency budget.
    Falls back to it when stdin is not a pipe (a file, a terminal)."""
    loop = asyncio.new_event_loop()
    reader = asyncio.StreamReader(loop=loop)
    try:
        loop.run_until_complete(loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                       sys.stdin.buffer))
    except (ValueError, OSError):
        loop.close()
        server.start_io()
        return
    server._stop_event = threading.Event()  # what pygls' shutdown() sets to end the loop below
    server.protocol.set_writer(StdoutWriter(sys.stdout.buffer))
    try:
        loop.run_until_complete(run_async(stop_event=server._stop_event, reader=reader, protocol=server.protocol,
                                          logger=log, error_handler=server.report_server_error))
    except BrokenPipeError:
        log.error("the client went away")
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.shutdown()
        loop.close()
