"""A language server with a remote engine survives every way a server can fail: each request is answered
(empty while the server cannot serve), the user sees one message per outage, and completions come back by
themselves when the server does. Real `lingls --stdio --endpoint URL` and `lingls serve` processes; faults a
real server does not produce on demand come from a proxy between them."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from lingls.engine.protocol import EngineError, GenerateRequest
from lingls.engine.remote import RemoteEngine

from .harness import FaultProxy, Serve, complete, language_server, open_doc, shown

DOC = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = \n"
CURSOR = (3, 17)
# every fresh document gets the same prompt, so the same greedy answer; no confidence gate, so that the server
# streams token by token (a gated line arrives whole, and a stream cut after it would have a complete answer)
OPTIONS = {"contextChunks": 0, "minLineProbability": 0}
_docs = itertools.count()


async def fresh(client) -> list[str]:
    """The answer at CURSOR in a newly opened copy of DOC: always a model call, never a reused answer."""
    uri = f"file:///work/doc{next(_docs)}.py"
    open_doc(client, DOC, uri)
    return await complete(client, *CURSOR, uri=uri)


async def recovered(client, want: list[str], within: float = 30.0) -> bool:
    """Requests come back empty until the server serves again, then with the answer it gave before."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await fresh(client) == want:
            return True
        await asyncio.sleep(0.2)
    return False


@pytest.mark.parametrize("mode", ["stall", "http500", "garbage", "alien", "truncated"])
async def test_faulty_server_then_recovery(server, mode):
    async with FaultProxy(server.url) as proxy, language_server(proxy.url, read_timeout=1.0, options=OPTIONS) as client:
        want = await fresh(client)
        assert want and want[0], "ling-nano answers this prompt"
        proxy.mode = mode
        for _ in range(3):
            assert await fresh(client) == []
        assert len(shown(client)) == 1, shown(client)
        assert "completion server" in shown(client)[0]
        proxy.mode = "pass"
        assert await recovered(client, want)
        assert len(shown(client)) == 1


async def test_server_killed_mid_stream_then_back(own_server):
    async with FaultProxy(own_server.url) as proxy, language_server(proxy.url, options=OPTIONS) as client:
        want = await fresh(client)
        assert want
        proxy.mode, before = "drip", proxy.forwarded
        pending = asyncio.ensure_future(fresh(client))
        while proxy.forwarded == before:  # the stream has begun
            await asyncio.sleep(0.01)
        own_server.kill()
        assert await pending == []
        proxy.mode = "pass"
        for _ in range(3):
            assert await fresh(client) == []  # fast: the engine knows the server is down
        assert len(shown(client)) == 1, shown(client)
        own_server.start()
        assert await recovered(client, want)
        assert len(shown(client)) == 1


async def test_server_down_at_start_comes_up_later(tmp_path):
    later = Serve(tmp_path / "serve.log")
    try:
        async with language_server(later.url, options=OPTIONS) as client:
            for _ in range(3):
                assert await fresh(client) == []
            assert len(shown(client)) == 1 and "cannot reach" in shown(client)[0], shown(client)
            await asyncio.to_thread(later.start)
            assert await recovered(client, await _direct_answer(later.url))
            assert len(shown(client)) == 1
    finally:
        later.stop()


async def _direct_answer(url: str) -> list[str]:
    """What a language server answers at CURSOR when the server is up from the start."""
    async with language_server(url, options=OPTIONS) as client:
        return await fresh(client)


async def test_engine_sees_a_killed_server_and_its_return(own_server):
    """Without a proxy: the stream of a SIGKILLed server ends in an EngineError, not a hang or a short text."""
    engine = await asyncio.to_thread(RemoteEngine, own_server.url)
    try:
        request = GenerateRequest("def add(a, b):\n    ", max_tokens=400)
        stream = engine.generate(request)
        await anext(stream)
        own_server.kill()
        with pytest.raises(EngineError, match="broke off"):
            async for _ in stream:
                pass
        assert not engine.healthy
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="completions are off"):
            await anext(engine.generate(request))
        assert time.monotonic() - t0 < 2  # fails fast while down
        await asyncio.to_thread(own_server.start)
        await asyncio.sleep(0.2)
        text = "".join([t async for t in engine.generate(GenerateRequest("x = ", max_tokens=4))])
        assert engine.healthy and text
        assert engine.stats.extra["outages"] == 1 and engine.stats.extra["recoveries"] == 1
    finally:
        await engine.close()
