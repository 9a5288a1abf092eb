"""Requests cancelled as fast as a client can send them leave no generation running on the server."""

from __future__ import annotations

import asyncio

from lsprotocol import types as lsp

from .harness import complete, language_server, lsp_stats, metrics, open_doc, params, type_text

STORM = 200


async def settled(url: str, quiet: float = 1.0, within: float = 30.0) -> dict[str, float]:
    """/metrics once the generated-token count has stopped moving for `quiet` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    before = await metrics(url)
    while loop.time() < deadline:
        await asyncio.sleep(quiet)
        now = await metrics(url)
        if now["lingls_generated_tokens_total"] == before["lingls_generated_tokens_total"]:
            return now
        before = now
    raise AssertionError("the server kept generating")


async def test_cancel_storm_leaves_the_server_idle(server):
    start = await metrics(server.url)
    async with language_server(server.url) as client:
        open_doc(client, "def main():\n    total = ")
        col = len("    total = ")
        await complete(client, 1, col)  # the engine is up: from here on, requests reach the server
        futures = []
        for i in range(STORM):
            type_text(client, 1, col + i, "x", version=2 + i)
            msg_id = f"storm-{i}"
            futures.append(asyncio.ensure_future(client.protocol.send_request_async(
                lsp.TEXT_DOCUMENT_INLINE_COMPLETION, params(1, col + i + 1), msg_id=msg_id)))
            await asyncio.sleep(0.004 * (i % 4))  # some cancels before the request reaches the engine, some after
            client.cancel_request(lsp.CancelParams(id=msg_id))
        answers = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 60)
        assert len(answers) == STORM  # every request answered: cancelled (-32800) or a (possibly empty) result
        idle = await settled(server.url)
        stats = await lsp_stats(client)
        assert not stats["running"]
        engine = stats["engine"]
        # Every stream the client opened was closed before its end, and the server saw each one stop.
        opened = idle["lingls_requests_total"] - start["lingls_requests_total"]
        stopped = idle["lingls_cancelled_total"] - start["lingls_cancelled_total"]
        assert 0 < opened <= engine["requests"]
        # every generation that started there was stopped early (the warm-up may have run to its end)
        assert stopped >= opened - 1, (engine["requests"], opened, stopped)
        # and the server is free: a normal request is answered
        type_text(client, 1, col + STORM, "\n", version=2 + STORM)
        assert isinstance(await complete(client, 2, 0), list)
