"""A client's protocol mistakes cost that one message (issue 37, failures 4 and 8): a framing fault is answered
with a parse error and the next message is read; a message that is not a JSON-RPC 2.0 request the LSP allows
gets an error; `exit` says whether `shutdown` came first; stdin's end, stdout's end and SIGTERM/SIGINT end the
server quietly. Each test drives a real `lingls --stdio` over its pipes."""

import asyncio
import json
import signal
import subprocess
import sys
import time

import pytest

from lsp_harness import RawClient, server_env

PARSE_ERROR, INVALID_REQUEST = -32700, -32600
STATS = {"command": "lingls.stats", "arguments": []}


def frame(body: bytes, length: int | None = None) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length) + body


def request(msg_id, method="workspace/executeCommand", params=STATS, **extra) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params, **extra}).encode()


FRAMING_FAULTS = {
    "one byte short": lambda: frame(request(7), len(request(7)) - 1),
    "one byte long": lambda: frame(request(7), len(request(7)) + 1),
    "far too long": lambda: frame(request(7), len(request(7)) + 500),
    "no header": lambda: request(7),
    "non-numeric length": lambda: b"Content-Length: seven\r\n\r\n" + request(7),
    "no length header": lambda: b"Content-Type: application/vscode-jsonrpc\r\n\r\n" + request(7),
    "binary garbage": lambda: bytes(range(256)) * 3,
    "garbage with CR LF": lambda: b"\xff\xfe\r\n\r\nContent-Lengt\r\n\x00\r\n\r\n",
}


@pytest.mark.parametrize("fault", FRAMING_FAULTS)
async def test_a_framing_fault_costs_one_message(fault):
    raw = await RawClient.start({"default": "1"}, stderr=True)
    try:
        await raw.initialize()
        raw.write(FRAMING_FAULTS[fault]())
        raw.write(frame(request(8)))  # well framed, right after the fault
        answer, before = await raw.until_answered(8)
        assert "result" in answer
        errors = [m["error"] for m in before if "error" in m]
        assert errors and all(e["code"] == PARSE_ERROR and e["message"] for e in errors), before
        # and the stream stays in step: a later split write is read as usual
        data = frame(request(9))
        raw.write(data[:10])
        await asyncio.sleep(0.05)
        raw.write(data[10:])
        assert "result" in (await raw.until_answered(9))[0]
        raw.send({"id": 10, "method": "shutdown"})
        await raw.until_answered(10)
        raw.send({"method": "exit"})
        assert await raw.exit_code() == 0
        assert "Traceback" not in await raw.stderr()
    finally:
        await raw.close()


async def test_a_length_too_large_with_nothing_after_is_answered():
    """The client waits for the answer, so no next header shows the fault: a stalled whole message does."""
    raw = await RawClient.start({"default": "1"})
    try:
        await raw.initialize()
        raw.write(frame(request(7), len(request(7)) + 3))
        answer, _ = await raw.until_answered(7)
        assert answer["error"]["code"] == PARSE_ERROR
        # a message written slowly, in parts, is not cut
        data = frame(request(8))
        raw.write(data[:-5])
        await asyncio.sleep(1.5)
        raw.write(data[-5:])
        assert "result" in (await raw.until_answered(8))[0]
    finally:
        await raw.close()


async def test_headers_in_any_case_and_order_are_read():
    raw = await RawClient.start({"default": "1"})
    try:
        await raw.initialize()
        body = request(5)
        raw.write(b"content-type: application/vscode-jsonrpc; charset=utf-8\r\ncontent-length:%d\r\n\r\n%b"
                  % (len(body), body))
        answer, before = await raw.until_answered(5)
        assert "result" in answer and not [m for m in before if "error" in m]
    finally:
        await raw.close()


BAD_MESSAGES = {
    "invalid UTF-8": (request(3, params={"command": "lingls.stats", "arguments": ["\udcff"]})
                      .replace(b"\\udcff", b"\xff\xfe"), PARSE_ERROR, 3),
    "not JSON": (b'{"jsonrpc": "2.0", "id": 3, "method":', PARSE_ERROR, None),
    "jsonrpc 1.0": (request(3, jsonrpc="1.0"), INVALID_REQUEST, 3),
    "no jsonrpc": (json.dumps({"id": 3, "method": "workspace/executeCommand", "params": STATS}).encode(),
                   INVALID_REQUEST, 3),
    "not an object": (b'"hello"', INVALID_REQUEST, None),
    "method not a string": (request(3, method=5), INVALID_REQUEST, 3),
    "id not an int or string": (request(3.5), INVALID_REQUEST, None),
    "params not structured": (request(3, params=5), INVALID_REQUEST, 3),
    "no method, no result": (b'{"jsonrpc": "2.0", "id": 3}', INVALID_REQUEST, None),
}


@pytest.mark.parametrize("case", BAD_MESSAGES)
async def test_a_bad_message_gets_an_error(case):
    body, code, msg_id = BAD_MESSAGES[case]
    raw = await RawClient.start({"default": "1"})
    try:
        await raw.initialize()
        raw.send_bytes(body)
        raw.send_bytes(request(4))
        answer, before = await raw.until_answered(4)
        assert "result" in answer
        [error] = [m for m in before if "error" in m]
        assert (error["id"], error["error"]["code"]) == (msg_id, code) and error["error"]["message"]
    finally:
        await raw.close()


async def test_a_batch_is_answered_with_an_error_per_request():
    raw = await RawClient.start({"default": "1"})
    try:
        await raw.initialize()
        batch = [json.loads(request(11)), json.loads(request(12)), {"jsonrpc": "2.0", "method": "initialized"}]
        raw.send_bytes(json.dumps(batch).encode())
        raw.send_bytes(request(13))
        answer, before = await raw.until_answered(13)
        assert "result" in answer
        errors = sorted((m["id"], m["error"]["code"]) for m in before if "error" in m)
        assert errors == [(11, INVALID_REQUEST), (12, INVALID_REQUEST)]
    finally:
        await raw.close()


@pytest.mark.parametrize("shutdown", [True, False])
async def test_exit_code_says_whether_shutdown_came_first(shutdown):
    raw = await RawClient.start({"default": "1"}, stderr=True)
    try:
        await raw.initialize()
        if shutdown:
            raw.send({"id": 20, "method": "shutdown"})
            assert (await raw.until_answered(20))[0]["result"] is None
            raw.send_bytes(request(21))  # requests after shutdown get InvalidRequest
            assert (await raw.until_answered(21))[0]["error"]["code"] == INVALID_REQUEST
        raw.send({"method": "exit"})
        assert await raw.exit_code() == (0 if shutdown else 1)
        assert "Traceback" not in await raw.stderr()
    finally:
        await raw.close()


def test_stdin_from_dev_null_exits_at_once():
    t = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "lingls.cli", "--stdio"], stdin=subprocess.DEVNULL,
                         capture_output=True, env=server_env({}), timeout=30)
    assert run.returncode == 0 and run.stderr == b"" and time.monotonic() - t < 20


@pytest.mark.parametrize("how", ["stdin closed", "stdout closed", "SIGTERM", "SIGINT"])
async def test_the_server_ends_quietly_when_the_client_goes(how):
    raw = await RawClient.start({"default": "1", "delay": 0.05}, stderr=True)
    try:
        await raw.initialize()
        raw.send({"method": "textDocument/didOpen", "params": {"textDocument": {
            "uri": "file:///w/a.py", "languageId": "python", "version": 1, "text": "x = "}}})
        assert "result" in await raw.request("workspace/executeCommand", STATS)
        if how == "stdin closed":
            raw.proc.stdin.close()
        elif how == "stdout closed":
            raw.proc._transport.get_pipe_transport(1).close()  # the client stops reading
            raw.send_bytes(request(30))  # its answer meets a closed pipe
        else:
            raw.proc.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGINT)
        assert await raw.exit_code() == 0
        err = await raw.stderr()
        assert "Traceback" not in err and "Error" not in err, err
    finally:
        await raw.close()


@pytest.mark.parametrize("shutdown", [True, False])
def test_exit_code_with_stdin_from_a_file(tmp_path, shutdown):
    """stdin that is not a pipe is read by pygls' own loop: `exit` gives the same codes there."""
    messages = [request(1, "initialize", {"capabilities": {}})]
    if shutdown:
        messages.append(request(2, "shutdown", None))
    messages.append(json.dumps({"jsonrpc": "2.0", "method": "exit"}).encode())
    (tmp_path / "in").write_bytes(b"".join(frame(m) for m in messages))
    with open(tmp_path / "in", "rb") as stdin:
        run = subprocess.run([sys.executable, "-m", "lingls.cli", "--stdio"], stdin=stdin, capture_output=True,
                             env=server_env({}), timeout=30)
    assert run.returncode == (0 if shutdown else 1) and b"Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("changes", [[{"text": 5}], "x", [{"range": 5, "text": "q"}], [{"text": ["q"]}]])
async def test_a_malformed_did_change_leaves_the_document_alone(changes):
    """pygls' converter reads `"text": 5` as "5": such a change must not replace the document."""
    raw = await RawClient.start({"default": "1"})
    try:
        await raw.initialize()
        uri = "file:///w/a.py"
        raw.send({"method": "textDocument/didOpen", "params": {"textDocument": {
            "uri": uri, "languageId": "python", "version": 1, "text": "x = "}}})
        raw.send({"method": "textDocument/didChange", "params": {"textDocument": {"uri": uri, "version": 2},
                                                                "contentChanges": changes}})
        answer = await raw.request("textDocument/inlineCompletion", {
            "textDocument": {"uri": uri}, "position": {"line": 0, "character": 4}, "context": {"triggerKind": 1}})
        assert [i["insertText"] for i in answer["result"]] == ["1"]
    finally:
        await raw.close()
