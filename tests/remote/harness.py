"""Helpers for the remote-engine tests: a real `lingls serve` subprocess, a fault-injecting proxy in front of it,
and a real `lingls --stdio --endpoint URL` process driven by pytest-lsp's client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
from aiohttp import web
from lsprotocol import types as lsp
from pytest_lsp import ClientServerConfig

REPO = Path(__file__).resolve().parent.parent.parent
URI = "file:///work/demo.py"
# One thread per process: the same floating-point reduction order in the server and in the test process (so
# greedy choices match exactly), and no thread oversubscription on a small, loaded CI machine.
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
ENV.pop("LINGLS_TEST_ENGINE", None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`lingls serve` with the embedded ling-nano on CPU, on a fixed port so that it can come back there."""

    def __init__(self, log: Path, port: int | None = None):
        self.log, self.port = log, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> "Serve":
        with open(self.log, "a") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "lingls.cli", "serve", "--device", "cpu",
                                          "--port", str(self.port)], stderr=err, env=ENV, cwd=REPO)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lingls serve exited: {self.log.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"lingls serve did not become healthy: {self.log.read_text()}")

    def kill(self) -> None:
        """SIGKILL: no goodbye to open connections, like a crash or an OOM kill."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


async def metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(lingls_\w+) (\S+)$", text, re.M)}


class FaultProxy:
    """An HTTP proxy in front of a real server that can misbehave on /v1/completions, for faults a real
    server does not produce on demand. Modes:
    pass       forward everything
    drip       forward the stream one event per `drip_s`; if the upstream dies, drop the client's connection
               mid-body (what a client of a crashed server sees)
    stall      accept the completion request and never answer
    http500    answer HTTP 500 with an OpenAI-style error body
    garbage    answer 200 with an event stream whose event is not JSON
    alien      answer 200 with JSON events of an unknown shape
    truncated  forward the first event, then end the body without the last event
    """

    def __init__(self, upstream: str):
        self.upstream, self.mode, self.drip_s = upstream, "pass", 0.05
        self.forwarded = 0  # completion events relayed to clients
        self.completions = 0  # completion requests seen
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    async def __aenter__(self) -> "FaultProxy":
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        completion = request.path.endswith("/completions")
        if completion:
            self.completions += 1
            if self.mode == "stall":
                await asyncio.Event().wait()
            if self.mode == "http500":
                return web.json_response({"error": {"message": "CUDA error: an illegal memory access",
                                                     "type": "server_error"}}, status=500)
            if self.mode in ("garbage", "alien"):
                event = b"{not json" if self.mode == "garbage" else json.dumps({"tokens": [1, 2]}).encode()
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b"data: " + event + b"\n\n")
                await resp.write_eof()
                return resp
        try:
            upstream = await self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                                   headers={"Content-Type": "application/json"})
        except aiohttp.ClientError:
            return web.json_response({"error": "upstream unreachable"}, status=502)
        async with upstream:
            resp = web.StreamResponse(status=upstream.status,
                                      headers={"Content-Type": upstream.headers.get("Content-Type", "")})
            await resp.prepare(request)
            try:
                async for line in upstream.content:
                    await resp.write(line)
                    if completion and line.startswith(b"data:"):
                        self.forwarded += 1
                        if self.mode == "truncated":
                            break
                        if self.mode == "drip":
                            await asyncio.sleep(self.drip_s)
            except aiohttp.ClientError:  # the upstream died mid-body: so does the client's connection
                request.transport.abort()
                return resp
            await resp.write_eof()
        return resp


def capabilities() -> lsp.ClientCapabilities:
    """pytest-lsp's presets lack inlineCompletion: added by hand."""
    return lsp.ClientCapabilities(
        text_document=lsp.TextDocumentClientCapabilities(
            inline_completion=lsp.InlineCompletionClientCapabilities(),
            synchronization=lsp.TextDocumentSyncClientCapabilities()),
        window=lsp.WindowClientCapabilities(show_message=lsp.ShowMessageRequestClientCapabilities()))


@contextlib.asynccontextmanager
async def language_server(endpoint: str, read_timeout: float | None = None, options: dict | None = None):
    """An initialized client of a fresh `lingls --stdio --endpoint URL` process."""
    env = dict(ENV)
    if read_timeout is not None:
        env["LINGLS_READ_TIMEOUT"] = str(read_timeout)
    config = ClientServerConfig(server_command=[sys.executable, "-m", "lingls.cli", "--stdio", "--endpoint", endpoint],
                                server_env=env)
    client = await config.start()
    try:
        await client.initialize_session(lsp.InitializeParams(capabilities=capabilities(), root_uri="file:///work",
                                                             initialization_options=options))
        yield client
        assert client._server.returncode is None, "the language server died"
        await asyncio.wait_for(client.shutdown_session(), 15)
    finally:
        if client._server.returncode is None:
            client._server.kill()
        await client.stop()


def open_doc(client, text: str, uri: str = URI) -> None:
    client.text_document_did_open(lsp.DidOpenTextDocumentParams(lsp.TextDocumentItem(uri, "python", 1, text)))


def type_text(client, line: int, col: int, text: str, version: int, uri: str = URI) -> None:
    pos = lsp.Position(line, col)
    client.text_document_did_change(lsp.DidChangeTextDocumentParams(
        lsp.VersionedTextDocumentIdentifier(version=version, uri=uri),
        [lsp.TextDocumentContentChangePartial(range=lsp.Range(pos, pos), text=text)]))


def params(line: int, col: int, uri: str = URI) -> lsp.InlineCompletionParams:
    return lsp.InlineCompletionParams(
        context=lsp.InlineCompletionContext(trigger_kind=lsp.InlineCompletionTriggerKind.Automatic),
        text_document=lsp.TextDocumentIdentifier(uri), position=lsp.Position(line, col))


async def complete(client, line: int, col: int, uri: str = URI, timeout: float = 60) -> list[str]:
    """The texts of the answer; every request must be answered (the timeout is only a hang detector)."""
    result = await asyncio.wait_for(client.text_document_inline_completion_async(params(line, col, uri)), timeout)
    items = result.items if isinstance(result, lsp.InlineCompletionList) else (result or [])
    return [item.insert_text for item in items]


async def lsp_stats(client) -> dict:
    return await client.workspace_execute_command_async(lsp.ExecuteCommandParams(command="lingls.stats"))


def shown(client) -> list[str]:
    """window/showMessage texts received so far."""
    return [m.message for m in client.messages]
