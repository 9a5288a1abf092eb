"""End-to-end: a real `lingls --stdio` process driven over stdio by pytest-lsp's client, with a scripted engine
injected into the server process (LINGLS_TEST_ENGINE) so that model calls can be counted."""

import asyncio
import time

import pytest
from lsprotocol import types as lsp
from pygls.exceptions import JsonRpcRequestCancelled

from lingls.lsp.positions import index_to_column
from lsp_harness import URI, complete, eventually, open_doc, params, serve, stats, type_text

ADD = "def add(a, b):\n    "


async def engine_stats(client) -> dict:
    return (await stats(client))["engine"]


async def test_capabilities_are_advertised():
    async with serve() as client:
        caps = client.init_result.capabilities
        assert caps.inline_completion_provider is not None
        assert "lingls.accept" in caps.execute_command_provider.commands
        assert caps.position_encoding == "utf-16"
        assert caps.text_document_sync.change == lsp.TextDocumentSyncKind.Incremental


async def test_python_block_completion_with_accept_command():
    script = {"rules": [[ADD, "return a + b\n\n\ndef sub(a, b):\n    return a - b\n"]]}
    async with serve(script) as client:
        open_doc(client, ADD + "\n")
        [item] = await complete(client, 1, 4)
        assert item.insert_text == "return a + b"
        assert item.range == lsp.Range(lsp.Position(1, 4), lsp.Position(1, 4))
        assert item.command.command == "lingls.accept"
        info = [m.message for m in client.log_messages]
        assert any("ready" in m for m in info)


async def test_prompt_carries_context_from_other_open_documents():
    async with serve({"default": "x"}) as client:
        open_doc(client, "def helper():\n    return 42\n", uri="file:///work/pkg/util.py")
        open_doc(client, "import pkg.util\nvalue = ")
        await complete(client, 1, 8)
        prompt = (await engine_stats(client))["extra"]["prompts"][-1]
        assert prompt.startswith("<|file_sep|>pkg/util.py\ndef helper():\n    return 42\n<|file_sep|>demo.py\n")
        assert prompt.endswith("<|fim_prefix|>import pkg.util\nvalue = <|fim_suffix|><|fim_middle|>")


async def test_model_without_fim_gets_a_left_to_right_prompt():
    async with serve({"default": "1", "fim": False}) as client:
        open_doc(client, "x = \ny = 2\n")
        [item] = await complete(client, 0, 4)
        assert item.insert_text == "1"
        assert (await engine_stats(client))["extra"]["prompts"][-1] == "x = "


@pytest.mark.parametrize("encoding", ["utf-16", "utf-8"])
async def test_emoji_and_cjk_ranges_are_exact_with_late_typed_characters(encoding):
    line = 'label = "😀中文" + '
    script = {"rules": [[line, "name.upper()\n"]], "delay": 0.05, "chunk": 3}
    async with serve(script, encodings=[encoding]) as client:
        assert client.init_result.capabilities.position_encoding == encoding
        col = index_to_column(line, len(line), encoding)
        assert col == (len(line) + 1 if encoding == "utf-16" else len(line.encode()))
        open_doc(client, line + "\nprint(label)\n")
        # Characters typed while the model works are covered by the range: replaced, not doubled.
        pending = asyncio.ensure_future(complete(client, 0, col))
        await asyncio.sleep(0.01)
        await stats(client)  # the request has reached the server
        type_text(client, 0, col, "na")
        [late] = await pending
        assert late.insert_text == "name.upper()"
        assert late.range == lsp.Range(lsp.Position(0, col), lsp.Position(0, col + 2))
        # At the new cursor, the rest of the same suggestion, with an empty range right there.
        [rest] = await complete(client, 0, col + 2)
        assert rest.insert_text == "me.upper()"
        assert rest.range == lsp.Range(lsp.Position(0, col + 2), lsp.Position(0, col + 2))


async def test_cancel_request_answers_within_50ms_and_stops_the_engine():
    async with serve({"default": "x" * 400, "delay": 0.05, "chunk": 1}) as client:
        open_doc(client, "value = ")
        future = asyncio.ensure_future(
            client.protocol.send_request_async(lsp.TEXT_DOCUMENT_INLINE_COMPLETION, params(0, 8), msg_id="slow"))
        assert await eventually(lambda: _active(client, 1))
        t0 = time.perf_counter()
        client.cancel_request(lsp.CancelParams(id="slow"))
        with pytest.raises(JsonRpcRequestCancelled) as err:
            await future
        elapsed = time.perf_counter() - t0
        assert err.value.code == -32800
        assert elapsed < 0.05, f"cancel answered after {elapsed * 1000:.1f} ms"
        assert await eventually(lambda: _active(client, 0))
        engine = await engine_stats(client)
        assert engine["cancelled"] == 1 and engine["generated_tokens"] < 20


async def _active(client, n):
    engine = await engine_stats(client)
    return engine is not None and engine["extra"]["active"] == n


async def test_burst_without_cancels_runs_the_model_for_the_last_request_only():
    async with serve({"default": "total"}, options={"debounceMs": 60}) as client:
        open_doc(client, "def f():\n    return ")
        pending = []
        for i in range(20):
            type_text(client, 1, 11 + i, "x", version=2 + i)
            pending.append(asyncio.ensure_future(complete(client, 1, 12 + i)))
            await asyncio.sleep(0.002)
        results = await asyncio.gather(*pending)
        assert all(r == [] for r in results[:-1])
        assert [i.insert_text for i in results[-1]] == ["total"]
        s = await stats(client)
        assert s["engine"]["requests"] == 1 and s["counters"]["superseded"] == 19


async def test_new_request_supersedes_the_previous_one_of_the_document():
    async with serve({"rules": [["= ", "slow_answer" * 20]], "default": "z", "delay": 0.05, "chunk": 1}) as client:
        open_doc(client, "a = ")
        first = asyncio.ensure_future(complete(client, 0, 4))
        assert await eventually(lambda: _active(client, 1))
        type_text(client, 0, 4, "q")  # diverges from what the model writes
        t0 = time.perf_counter()
        second = await complete(client, 0, 5)
        assert await first == []
        assert [i.insert_text for i in second] == ["z"]
        assert time.perf_counter() - t0 < 1
        engine = await engine_stats(client)
        assert engine["requests"] == 2 and engine["cancelled"] == 1


async def test_type_through_is_answered_without_a_model_call():
    async with serve({"rules": [[ADD, "return a + b\n"]]}) as client:
        open_doc(client, ADD)
        [item] = await complete(client, 1, 4)
        assert item.insert_text == "return a + b"
        type_text(client, 1, 4, "ret")
        [rest] = await complete(client, 1, 7)
        assert rest.insert_text == "urn a + b"
        assert rest.range.start == lsp.Position(1, 7)
        s = await stats(client)
        assert s["engine"]["requests"] == 1 and s["counters"]["type_through"] == 1


async def test_generation_in_flight_is_reused():
    async with serve({"rules": [[ADD, "return a + b\n"]], "delay": 0.04, "chunk": 2}) as client:
        open_doc(client, ADD)
        first = asyncio.ensure_future(complete(client, 1, 4))
        assert await eventually(lambda: _active(client, 1))
        type_text(client, 1, 4, "r")
        [item] = await complete(client, 1, 5)
        assert item.insert_text == "eturn a + b"
        assert await first == []  # superseded, never doubled
        s = await stats(client)
        assert s["engine"]["requests"] == 1 and s["counters"]["reused_in_flight"] == 1


async def test_accept_is_recorded_and_prefetches_the_continuation():
    script = {"rules": [["total = a + b", " + c\n"], ["total = ", "a + b\n"]]}
    async with serve(script) as client:
        open_doc(client, "total = ")
        [item] = await complete(client, 0, 8)
        assert item.insert_text == "a + b"
        type_text(client, 0, 8, item.insert_text)
        await client.workspace_execute_command_async(
            lsp.ExecuteCommandParams(command=item.command.command, arguments=item.command.arguments))
        s = await stats(client)
        assert s["counters"]["accepted"] == 1 and s["counters"]["prefetches"] == 1
        assert s["accepted"][-1]["chars"] == 5
        [nxt] = await complete(client, 0, 13)
        assert nxt.insert_text == "+ c" or nxt.insert_text == " + c"
        assert (await engine_stats(client))["requests"] == 2  # the prefetch, no third call
        assert (await engine_stats(client))["extra"]["gates"] == [0.02, 0.02]  # the prefetch is gated too


async def test_invoked_returns_up_to_three_distinct_items():
    async with serve({"default": "gamma", "seeds": {"1": "alpha", "2": "gamma"}}) as client:
        open_doc(client, "word = ")
        items = await complete(client, 0, 7, invoked=True)
        assert [i.insert_text for i in items] == ["gamma", "alpha"]
        assert [i.insert_text for i in await complete(client, 0, 7)] == ["gamma"]


async def test_the_confidence_gate_is_asked_for_automatic_suggestions_only():
    async with serve({"default": "1"}) as client:
        open_doc(client, "x = ")
        await complete(client, 0, 4)
        await complete(client, 0, 4, invoked=True)
        assert (await engine_stats(client))["extra"]["gates"][:2] == [0.02, 0.0]  # the default, then none
        client.workspace_did_change_configuration(
            lsp.DidChangeConfigurationParams(settings={"lingls": {"minLineProbability": 1.5}}))
        client.workspace_did_change_configuration(
            lsp.DidChangeConfigurationParams(settings={"lingls": {"minLineProbability": 0.2}}))
        type_text(client, 0, 4, "y")
        await complete(client, 0, 5)
        assert (await engine_stats(client))["extra"]["gates"][-1] == 0.2
        assert any("minLineProbability" in m.message and "1.5" in m.message for m in client.log_messages)


async def test_configuration_switches_languages_and_rejects_bad_values():
    async with serve({"default": "1"}, options={"lingls": {"maxTokens": "many"}}) as client:
        assert any("maxTokens" in m.message for m in client.log_messages)
        open_doc(client, "x = ")
        client.workspace_did_change_configuration(
            lsp.DidChangeConfigurationParams(settings={"lingls": {"languages": ["rust"]}}))
        assert await complete(client, 0, 4) == []
        client.workspace_did_change_configuration(lsp.DidChangeConfigurationParams(settings={"languages": ["*"]}))
        assert [i.insert_text for i in await complete(client, 0, 4)] == ["1"]


async def test_close_forgets_the_document():
    async with serve({"default": "1"}) as client:
        open_doc(client, "x = ")
        client.text_document_did_close(lsp.DidCloseTextDocumentParams(lsp.TextDocumentIdentifier(URI)))
        assert await complete(client, 0, 4) == []


async def test_a_completion_that_repeats_the_line_above_the_cursor_is_not_shown():
    """The degeneration guard sees the line above a blank cursor line (ling-nano wrote `if key in line:` again)."""
    above = "for line in f:\n    key, _, value = line.partition('=')\n    if key in line:\n"
    script = {"rules": [[above + "        ", "if key in line:\n            pass\n"]]}
    async with serve(script) as client:
        open_doc(client, above + "        \n")
        assert await complete(client, 3, 8) == []
