"""The engine's loading as LSP work-done progress (`$/progress` on a token the server creates), so that an editor
says "ready" when the model is loaded, not when the server process starts; through a real `lingls --stdio`."""

import asyncio

from lsprotocol import types as lsp

from lsp_harness import capabilities, complete, open_doc, serve


async def initialized(client, progress: bool) -> None:
    caps = capabilities()
    caps.window.work_done_progress = progress
    client.init_result = await client.initialize_session(lsp.InitializeParams(capabilities=caps,
                                                                              root_uri="file:///work"))


async def reports(client, n: int, timeout: float = 10) -> list:
    """The progress values of the one token the server made, once there are n of them."""
    async def wait():
        while sum(map(len, client.progress_reports.values())) < n:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(wait(), timeout)
    [(token, values)] = client.progress_reports.items()
    assert token.startswith("lingls/loading/")
    return values


async def test_loading_is_reported_from_its_start_to_ready():
    async with serve({"default": "1", "load_delay": 0.5}, initialize=False) as client:
        await initialized(client, progress=True)
        begin, end = await reports(client, 2)
        assert isinstance(begin, lsp.WorkDoneProgressBegin) and begin.title == "lingls"
        assert begin.message == "loading the embedded model"
        assert isinstance(end, lsp.WorkDoneProgressEnd) and end.message == "scripted ready"
        open_doc(client, "x = ")
        assert [item.insert_text for item in await complete(client, 0, 4)] == ["1"]
        await asyncio.wait_for(client.shutdown_session(), 10)


async def test_a_failed_load_ends_the_progress():
    async with serve({"fail_load": "no weights here"}, initialize=False) as client:
        await initialized(client, progress=True)
        _, end = await reports(client, 2)
        assert end.message == "failed: see the log"
        await asyncio.wait_for(client.shutdown_session(), 10)


async def test_a_client_without_progress_gets_none():
    async with serve({"default": "1", "load_delay": 0.2}, initialize=False) as client:
        await initialized(client, progress=False)
        open_doc(client, "x = ")
        assert [item.insert_text for item in await complete(client, 0, 4)] == ["1"]  # loaded by then
        assert client.progress_reports == {}
        await asyncio.wait_for(client.shutdown_session(), 10)
