"""RemoteEngine against a real local socket server: a completion request that is accepted and never answered
costs one POST and one read timeout (a retry would only wait again), while a refused connection is retried
briefly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from lingls.engine.protocol import EngineError, GenerateRequest
from lingls.engine.remote import RemoteEngine, RemoteSettings

MODELS = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": "stub"}]}).encode()


class SilentServer:
    """A plain asyncio socket server: GETs (/v1/models, /health) get a small JSON answer; a POST is read,
    counted and never answered (the connection stays open until the client gives up)."""

    def __init__(self):
        self.posts = 0
        self._server: asyncio.base_events.Server | None = None
        self._open: dict[asyncio.StreamWriter, asyncio.Task] = {}
        self.url = ""

    async def __aenter__(self) -> "SilentServer":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            handlers = list(self._open.values())
            for w in list(self._open):
                w.close()  # each handler sees its connection end and returns
            await asyncio.gather(*handlers, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open[writer] = asyncio.current_task()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method = head.split(b" ", 1)[0]
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if method == b"POST":
                    self.posts += 1
                    await reader.read()  # accepted, never answered: until the client gives up
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(MODELS), MODELS))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._open.pop(writer, None)
            writer.close()


async def test_a_silent_server_costs_one_post_and_one_read_timeout():
    settings = RemoteSettings(read_timeout=0.5, retries=2, backoff=0.2)
    async with SilentServer() as server:
        engine = await asyncio.to_thread(RemoteEngine, server.url, settings=settings)
        try:
            assert engine.healthy
            t0 = time.monotonic()
            with pytest.raises(EngineError, match="did not answer in time"):
                await anext(engine.generate(GenerateRequest("x = ", max_tokens=4)))
            elapsed = time.monotonic() - t0
            assert server.posts == 1, f"{server.posts} POSTs: a read timeout was retried"
            assert engine.stats.extra["retries"] == 0
            assert elapsed < 2 * settings.read_timeout, elapsed
            assert not engine.healthy
        finally:
            await engine.close()


async def test_a_refused_connection_is_retried_briefly():
    settings = RemoteSettings(read_timeout=0.5, retries=2, backoff=0.05)
    server = SilentServer()
    await server.__aenter__()
    engine = await asyncio.to_thread(RemoteEngine, server.url, settings=settings)
    try:
        await server.close()  # the port now refuses connections
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="cannot reach"):
            await anext(engine.generate(GenerateRequest("x = ", max_tokens=4)))
        assert engine.stats.extra["retries"] == settings.retries
        assert time.monotonic() - t0 < 2
    finally:
        with contextlib.suppress(Exception):
            await server.close()
        await engine.close()
