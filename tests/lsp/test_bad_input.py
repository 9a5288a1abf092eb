"""Bad input never kills the server: each case gets an empty result or an LSP error with a message, and the
next request works."""

import asyncio
import json

import pytest
from lsprotocol import types as lsp

from lsp_harness import REPO, URI, RawClient, complete, open_doc, serve, stats

EMBEDDED = REPO / "lingls" / "assets" / "ling-nano"

GOOD = "x = "


async def works(client, uri=URI):
    """The server still answers a normal request."""
    open_doc(client, GOOD, uri=uri)
    return [i.insert_text for i in await complete(client, 0, 4, uri=uri)] == ["1"]


async def test_unknown_uri_and_positions_past_the_end():
    async with serve({"default": "1"}) as client:
        assert await complete(client, 0, 0, uri="file:///nowhere.py") == []
        open_doc(client, "ab\ncd")
        assert await complete(client, 7, 0) == []
        assert await complete(client, 0, 99) == []
        assert any("past the end" in m.message for m in client.log_messages)
        assert any("not open" in m.message for m in client.log_messages)
        assert await works(client)


async def test_ten_megabyte_document():
    async with serve({"default": "1"}) as client:
        big = "value = compute(1, 2)  # some padding to make lines long\n" * 180_000  # ~10 MB
        open_doc(client, big + "x = ", uri="file:///work/big.py")
        items = await asyncio.wait_for(complete(client, 180_000, 4, uri="file:///work/big.py"), 30)
        assert [i.insert_text for i in items] == ["1"]
        prompt_chars = len((await stats(client))["engine"]["extra"]["prompts"][-1])
        assert prompt_chars < 20_000  # the budget, not the file, sets the prompt size
        assert await works(client)


async def test_binary_content():
    async with serve({"default": "1"}) as client:
        open_doc(client, "\x00\x01\x02ELF\x00" * 100 + "\n", uri="file:///work/a.bin", language="plaintext")
        assert await complete(client, 1, 0, uri="file:///work/a.bin") == []
        assert await works(client)


async def test_invalid_utf16_surrogates():
    async with serve({"default": "1"}) as client:
        open_doc(client, 's = "\ud800\udfff\udc00"\nx = ')  # a lone low surrogate in the middle
        items = await complete(client, 1, 4)
        assert [i.insert_text for i in items] == ["1"]
        prompt = (await stats(client))["engine"]["extra"]["prompts"][-1]
        assert "\ufffd" in prompt
        assert await works(client)


async def test_engine_that_raises_then_recovers():
    async with serve({"default": "1", "fail_first": 2}) as client:
        open_doc(client, GOOD)
        assert await complete(client, 0, 4) == []
        assert await complete(client, 0, 4) == []
        assert len(client.messages) == 1 and "scripted failure" in client.messages[0].message  # shown once
        assert [i.insert_text for i in await complete(client, 0, 4)] == ["1"]


async def test_engine_that_cannot_load_is_reported_once():
    async with serve({"fail_load": "model directory /nope has no config.json"}) as client:
        open_doc(client, GOOD)
        assert await complete(client, 0, 4) == []
        assert await complete(client, 0, 4) == []
        shown = [m.message for m in client.messages]
        assert shown == ["lingls: model directory /nope has no config.json"]


async def test_raw_protocol_abuse():
    raw = await RawClient.start({"default": "1"})
    try:
        pos = {"textDocument": {"uri": URI}, "position": {"line": 0, "character": 4},
               "context": {"triggerKind": 2}}
        early = await raw.request("textDocument/inlineCompletion", pos)
        assert early["error"]["code"] == -32002  # ServerNotInitialized
        init = await raw.request("initialize", {"processId": None, "rootUri": None, "capabilities": {}})
        assert "inlineCompletionProvider" in init["result"]["capabilities"]
        raw.send({"method": "initialized", "params": {}})
        raw.send_bytes(b"{not json")
        raw.send_bytes(json.dumps({"jsonrpc": "2.0", "id": 99, "method": "textDocument/inlineCompletion",
                                   "params": {"textDocument": {"uri": URI}, "position": {"line": -1}}}).encode())
        bad = await raw.request("textDocument/inlineCompletion", {"position": "nowhere"})
        assert bad["error"]["code"] == -32602 and bad["error"]["message"]
        unknown = await raw.request("lingls/nothing", {})
        assert unknown["error"]["code"] == -32601
        raw.send({"method": "textDocument/didOpen", "params": {"textDocument": {
            "uri": URI, "languageId": "python", "version": 1, "text": "x = "}}})
        ok = await raw.request("textDocument/inlineCompletion", pos)
        assert [i["insertText"] for i in ok["result"]] == ["1"]
        assert raw.proc.returncode is None
    finally:
        await raw.close()


async def test_accept_with_garbage_arguments():
    async with serve({"default": "1"}) as client:
        await client.workspace_execute_command_async(
            lsp.ExecuteCommandParams(command="lingls.accept", arguments=["nonsense", 3]))
        await client.workspace_execute_command_async(lsp.ExecuteCommandParams(command="lingls.accept"))
        assert await works(client)


async def test_a_lone_surrogate_in_a_closed_document_breaks_no_later_completion():
    # The context ring keeps the closed document's chunk, so every later prompt's token count reads it.
    async with serve({"default": "1", "tokenizer": str(EMBEDDED)}) as client:
        other = "file:///work/other.py"
        open_doc(client, 's = "\ud800"\nt = ', uri=other)
        assert [i.insert_text for i in await complete(client, 1, 4, uri=other)] == ["1"]
        client.text_document_did_close(lsp.DidCloseTextDocumentParams(lsp.TextDocumentIdentifier(other)))
        assert await works(client)
        assert await works(client, uri="file:///work/third.py")
        assert not client.messages, [m.message for m in client.messages]


@pytest.mark.parametrize("fim", [False, True])
async def test_an_empty_file_gives_an_empty_answer_without_a_popup(fim):
    async with serve({"default": "1", "fim": fim}) as client:
        for name in ("a", "b"):
            uri = f"file:///work/{name}.py"
            open_doc(client, "", uri=uri)
            items = [i.insert_text for i in await complete(client, 0, 0, uri=uri)]
            # A left-to-right model has nothing to continue; a FIM model completes from an empty prefix.
            assert items == (["1"] if fim else [])
        assert not client.messages, [m.message for m in client.messages]
        assert await works(client)
