"""Helpers for the LSP end-to-end tests: a real `lingls --stdio` process driven by pytest-lsp's client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from lsprotocol import types as lsp
from pytest_lsp import ClientServerConfig

HERE = Path(__file__).parent
REPO = HERE.parent.parent
URI = "file:///work/demo.py"


def capabilities(encodings: list[str] | None = None) -> lsp.ClientCapabilities:
    """A client that can show inline completions (pytest-lsp's presets cannot: added by hand)."""
    return lsp.ClientCapabilities(
        general=lsp.GeneralClientCapabilities(position_encodings=encodings) if encodings else None,
        text_document=lsp.TextDocumentClientCapabilities(
            inline_completion=lsp.InlineCompletionClientCapabilities(),
            synchronization=lsp.TextDocumentSyncClientCapabilities(),
        ),
        workspace=lsp.WorkspaceClientCapabilities(configuration=False),
        window=lsp.WindowClientCapabilities(show_message=lsp.ShowMessageRequestClientCapabilities()),
    )


def server_env(script: dict | None, engine: str | None = "scripted_engine:make_engine") -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), env.get("PYTHONPATH", "")])
    if engine:
        env["LINGLS_TEST_ENGINE"] = engine
    else:
        env.pop("LINGLS_TEST_ENGINE", None)
    env["LINGLS_SCRIPT"] = json.dumps(script or {})
    return env


@contextlib.asynccontextmanager
async def serve(script: dict | None = None, options: dict | None = None, encodings: list[str] | None = None,
                engine: str | None = "scripted_engine:make_engine", initialize: bool = True):
    """An initialized client connected to a fresh `lingls --stdio` process."""
    config = ClientServerConfig(server_command=[sys.executable, "-m", "lingls.cli", "--stdio"],
                                server_env=server_env(script, engine))
    client = await config.start()
    try:
        if initialize:
            client.init_result = await client.initialize_session(
                lsp.InitializeParams(capabilities=capabilities(encodings), initialization_options=options,
                                     root_uri="file:///work"))
        yield client
        if initialize:
            await asyncio.wait_for(client.shutdown_session(), 10)
    finally:
        if client._server.returncode is None:  # a failed test: do not wait for a clean exit
            client._server.kill()
        await client.stop()


def open_doc(client, text: str, uri: str = URI, language: str = "python") -> None:
    client.text_document_did_open(lsp.DidOpenTextDocumentParams(lsp.TextDocumentItem(uri, language, 1, text)))


def type_text(client, line: int, col: int, text: str, version: int = 2, uri: str = URI) -> None:
    """Insert `text` at (line, col) with an incremental change."""
    pos = lsp.Position(line, col)
    client.text_document_did_change(lsp.DidChangeTextDocumentParams(
        lsp.VersionedTextDocumentIdentifier(version=version, uri=uri),
        [lsp.TextDocumentContentChangePartial(range=lsp.Range(pos, pos), text=text)]))


def params(line: int, col: int, invoked: bool = False, uri: str = URI) -> lsp.InlineCompletionParams:
    kind = lsp.InlineCompletionTriggerKind.Invoked if invoked else lsp.InlineCompletionTriggerKind.Automatic
    return lsp.InlineCompletionParams(context=lsp.InlineCompletionContext(trigger_kind=kind),
                                      text_document=lsp.TextDocumentIdentifier(uri),
                                      position=lsp.Position(line, col))


async def complete(client, line: int, col: int, invoked: bool = False, uri: str = URI):
    result = await client.text_document_inline_completion_async(params(line, col, invoked, uri))
    return result.items if isinstance(result, lsp.InlineCompletionList) else (result or [])


async def stats(client) -> dict:
    return await client.workspace_execute_command_async(lsp.ExecuteCommandParams(command="lingls.stats"))


async def eventually(predicate, timeout: float = 2.0):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.01)


class RawClient:
    """Bare JSON-RPC over a server's stdio, for what a well-behaved client never sends."""

    def __init__(self, proc):
        self.proc = proc
        self._ids = iter(range(1, 10**6))

    @classmethod
    async def start(cls, script: dict | None = None, stderr: bool = False):
        """`stderr`: keep the server's stderr (read it with `stderr()`) instead of discarding it."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "lingls.cli", "--stdio", env=server_env(script), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE if stderr else asyncio.subprocess.DEVNULL)
        return cls(proc)

    def send_bytes(self, body: bytes) -> None:
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def write(self, data: bytes) -> None:
        """Raw bytes, framed or not."""
        self.proc.stdin.write(data)

    async def initialize(self) -> dict:
        init = await self.request("initialize", {"processId": None, "rootUri": None, "capabilities": {}})
        self.send({"method": "initialized", "params": {}})
        return init

    async def until_answered(self, msg_id, timeout: float = 10) -> tuple[dict, list[dict]]:
        """The response to `msg_id` and every message the server sent before it."""
        before = []
        while True:
            message = await asyncio.wait_for(self.receive(), timeout)
            if message.get("id") == msg_id and "method" not in message:
                return message, before
            before.append(message)

    async def exit_code(self, timeout: float = 10) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def stderr(self) -> str:
        """All of the server's stderr; call once it has exited."""
        return (await self.proc.stderr.read()).decode(errors="replace")

    def send(self, message: dict) -> None:
        self.send_bytes(json.dumps({"jsonrpc": "2.0", **message}).encode())

    async def receive(self) -> dict:
        length = 0
        while True:
            line = await self.proc.stdout.readline()
            if not line.strip():
                break
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        return json.loads(await self.proc.stdout.readexactly(length))

    async def request(self, method: str, params) -> dict:
        msg_id = next(self._ids)
        self.send({"id": msg_id, "method": method, "params": params})
        while True:
            message = await asyncio.wait_for(self.receive(), 10)
            if message.get("id") == msg_id and "method" not in message:
                return message

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
