"""`lingls --tcp` serves the same protocol; `lingls bench lsp` runs end to end (a smoke run, no timings
asserted: benchmarks measure, tests do not)."""

import asyncio
import json
import socket
import subprocess
import sys

from lsp_harness import REPO, server_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect once the server listens (it is still starting)."""
    for _ in range(200):
        try:
            return await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
    return await asyncio.open_connection("127.0.0.1", port)


async def _read_message(reader: asyncio.StreamReader) -> dict:
    length = 0
    while (line := await asyncio.wait_for(reader.readline(), 10)) != b"\r\n":
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return json.loads(await reader.readexactly(length))


def _frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return b"Content-Length: %d\r\n\r\n%b" % (len(body), body)


async def test_tcp_session_survives_a_framing_fault_and_exits_with_the_lsp_code():
    """The TCP transport reads through the same framer as stdio: garbage costs one parse error, the next message
    is answered, and `shutdown` + `exit` end the process with 0, listener closed."""
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "lingls.cli", "--tcp", "--port", str(port),
                                                env=server_env({"default": "1"}), cwd=REPO,
                                                stderr=subprocess.PIPE)
    try:
        reader, writer = await _connect(port)
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"processId": None, "rootUri": None, "capabilities": {}}}
        writer.write(b"Content-Length: 5\r\n\r\n{\"a\":" + _frame(init))
        await writer.drain()
        first, second = await _read_message(reader), await _read_message(reader)
        assert first["error"]["code"] == -32700
        assert second["id"] == 1 and "inlineCompletionProvider" in second["result"]["capabilities"]
        writer.write(_frame({"jsonrpc": "2.0", "method": "initialized", "params": {}})
                     + _frame({"jsonrpc": "2.0", "id": 2, "method": "shutdown"}))
        await writer.drain()
        while "id" not in (reply := await _read_message(reader)):  # notifications (log messages) come between
            pass
        assert reply["id"] == 2 and reply["result"] is None
        writer.write(_frame({"jsonrpc": "2.0", "method": "exit"}))
        await writer.drain()
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        assert b"Traceback" not in await proc.stderr.read()
        writer.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_tcp_transport():
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "lingls.cli", "--tcp", "--port", str(port),
                                                env=server_env({"default": "1"}), cwd=REPO)
    try:
        reader, writer = await _connect(port)
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                           "params": {"processId": None, "rootUri": None, "capabilities": {}}}).encode()
        writer.write(b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        await writer.drain()
        length = 0
        while (line := await asyncio.wait_for(reader.readline(), 10)) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        reply = json.loads(await reader.readexactly(length))
        assert "inlineCompletionProvider" in reply["result"]["capabilities"]
        writer.close()
    finally:
        proc.kill()
        await proc.wait()


def test_bench_lsp_smoke(tmp_path):
    out = tmp_path / "lsp.json"
    run = subprocess.run([sys.executable, "-m", "lingls.cli", "bench", "lsp", "--engine", "instant", "--keystrokes",
                          "12", "--interval-ms", "0", "--out", str(out), "--log-file", str(tmp_path / "log")],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())["runs"]["instant"]
    assert result["config"]["keystrokes"] == 12 and len(result["overhead_by_source_ms"]) >= 1
    assert set(result["overhead_ms"]) == {"p50", "p95", "mean", "max"}
