"""`lingls bench lsp`: keystroke-to-answer latency of the language server over stdio, during scripted typing.

A block of a real Python file (by default the standard library's textwrap.py) is cut out and typed back one
character at a time; each keystroke sends didChange + textDocument/inlineCompletion, as VS Code does, and
waits for the answer. Latency is measured at the client. The server reports, per request, how long it waited
on the engine (loading, generating) and in its debounce; the rest is the LSP's own overhead: JSON-RPC, document
sync, prompt building, post-processing, scheduling. Target: overhead p95 <= 2 ms. For scale, the run also
times an empty request (a document the server does not have) at the same pacing: the floor that pipes and
the operating system set, whatever the server does.

`--engine instant` swaps the model for one that answers at once (through the server's engine hook), which
isolates the LSP's own cost from a CPU model competing with it for the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from lingls import __version__
from lingls.engine.protocol import EngineStats, FimTemplate
from lingls.lsp.engines import TEST_ENGINE_ENV
from lingls.lsp.positions import length_in

FLOOR_SAMPLES = 50
STATS_BATCH = 256  # the server keeps its last 512 request timings; fetch them well before they roll over
TARGET_OVERHEAD_P95_MS = 2.0


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


def summary(values: list[float]) -> dict:
    return {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95), "mean": statistics.fmean(values),
            "max": max(values)} if values else {}


def typing_script(text: str, keystrokes: int) -> tuple[int, str]:
    """(offset, block): the block of `keystrokes` characters to retype, starting at a function definition
    past the first third of the file."""
    start = text.find("\n    def ", len(text) // 3)
    start = text.find("\ndef ", len(text) // 3) if start < 0 else start
    start = max(0, start) + 1
    return start, text[start : start + keystrokes]


class InstantEngine:
    """Answers every prompt at once with the same line (`--engine instant`)."""

    name = "instant"
    fim = FimTemplate()

    def __init__(self, settings=None):
        self.stats = EngineStats()

    def count_tokens(self, text: str) -> int:
        return len(text) // 4 + 1

    async def generate(self, request):
        self.stats.requests += 1
        yield "value = compute()\n"

    async def close(self) -> None:
        pass


class JsonRpcClient:
    """A lean LSP client over a child's stdio (plain dicts, no type conversion), so that the latency measured
    is the server's, not a heavyweight test client's: editors' clients are native JSON speakers too."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self._ids = iter(range(1, 1 << 30))
        self._pending: dict[int, asyncio.Future] = {}
        self.received_at = 0.0  # perf_counter when the last response's bytes were read
        self._reader = asyncio.ensure_future(self._read())

    def notify(self, method: str, params: dict) -> None:
        self._write({"jsonrpc": "2.0", "method": method, "params": params})

    async def request(self, method: str, params) -> object:
        msg_id = next(self._ids)
        future = self._pending[msg_id] = asyncio.get_running_loop().create_future()
        self._write({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
        return await future

    def _write(self, message: dict) -> None:
        body = json.dumps(message).encode()
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n%b" % (len(body), body))

    async def _read(self) -> None:
        out = self.proc.stdout
        while True:
            length = 0
            while (line := await out.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if not line:
                return
            body = await out.readexactly(length)
            self.received_at = time.perf_counter()
            message = json.loads(body)
            future = self._pending.pop(message.get("id"), None) if "method" not in message else None
            if future is not None:
                if "error" in message:
                    future.set_exception(RuntimeError(message["error"].get("message")))
                else:
                    future.set_result(message.get("result"))
            elif message.get("method") == "window/showMessage":
                print(f"lingls: {message['params']['message']}", file=sys.stderr)


async def run(a: argparse.Namespace) -> dict:
    path = Path(a.file)
    text = path.read_text(encoding="utf-8")
    offset, block = typing_script(text, a.keystrokes)
    doc = text[:offset] + text[offset + len(block) :]
    uri = path.resolve().as_uri()

    options = {"debounceMs": a.debounce_ms, "maxTokens": a.max_tokens}
    for key, value in (("endpoint", a.endpoint), ("model", a.model), ("device", a.device)):
        if value:
            options[key] = value
    env = dict(os.environ)
    if a.engine == "instant":
        env[TEST_ENGINE_ENV] = f"{__name__}:InstantEngine"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lingls.cli", "--stdio", "--log-file", a.log_file, env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    client = JsonRpcClient(proc)
    caps = {"textDocument": {"inlineCompletion": {}}}
    await client.request("initialize", {"processId": os.getpid(), "capabilities": caps,
                                        "rootUri": path.parent.resolve().as_uri(),
                                        "initializationOptions": options})
    client.notify("initialized", {})
    client.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1,
                                                           "text": doc}})
    line = doc.count("\n", 0, offset)
    col = length_in(doc[doc.rfind("\n", 0, offset) + 1 : offset])

    async def ask() -> list:
        return await client.request("textDocument/inlineCompletion", {
            "textDocument": {"uri": uri}, "position": {"line": line, "character": col},
            "context": {"triggerKind": 2}}) or []

    async def server_stats() -> dict:
        return await client.request("workspace/executeCommand", {"command": "lingls.stats"})

    t0 = time.perf_counter()
    await ask()  # waits for the engine to load; not a keystroke
    load_s = time.perf_counter() - t0

    # The floor: the same pacing, a request the server answers at once (a document it does not have).
    floor_ms = []
    nowhere = {"textDocument": {"uri": uri + ".absent"}, "position": {"line": 0, "character": 0},
               "context": {"triggerKind": 2}}
    for _ in range(FLOOR_SAMPLES):
        await asyncio.sleep(a.interval_ms / 1000)
        t = time.perf_counter()
        await client.request("textDocument/inlineCompletion", nowhere)
        floor_ms.append((time.perf_counter() - t) * 1000)

    client_ms: list[float] = []
    sent_at: list[float] = []  # perf_counter at the client: keystroke sent, answer read
    received_at: list[float] = []
    timings: list[dict] = []
    shown = 0
    for version, ch in enumerate(block, start=2):
        await asyncio.sleep(a.interval_ms / 1000)
        pos = {"line": line, "character": col}
        t = time.perf_counter()
        sent_at.append(t)
        client.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": version},
                                                 "contentChanges": [{"range": {"start": pos, "end": pos},
                                                                     "text": ch}]})
        line, col = (line + 1, 0) if ch == "\n" else (line, col + length_in(ch))
        items = await ask()
        client_ms.append((time.perf_counter() - t) * 1000)
        received_at.append(client.received_at)
        shown += bool(items)
        if len(client_ms) % STATS_BATCH == 0:
            timings += (await server_stats())["timings"][-STATS_BATCH:]
    final = await server_stats()
    timings += final["timings"][-(len(client_ms) - len(timings)) :] if len(client_ms) > len(timings) else []
    await client.request("shutdown", None)
    client.notify("exit", None)
    await proc.wait()

    engine_ms = [t["engine_ms"] for t in timings]
    handler = [t["total_ms"] - t["engine_ms"] - t["debounce_ms"] for t in timings]
    # The LSP's overhead per keystroke, measured in the server: from reading the first bytes of the keystroke's
    # didChange to handing the serialized answer to the OS (the write call), minus the time spent inside the engine's
    # stream (and the debounce, when one is set).
    overhead = [(t["t_write"] - _keystroke_start(t, s)) * 1000 - t["engine_ms"] - t["debounce_ms"]
                for t, s in zip(timings, sent_at)]
    # The same seen from the client (what the editor sees): adds both pipe hops and the OS waking each side.
    end_to_end = [c - t["engine_ms"] - t["debounce_ms"] for c, t in zip(client_ms, timings)]
    phases = _phases(timings, sent_at, received_at)
    sources: dict[str, int] = {}
    by_source: dict[str, list[float]] = {}
    for t, o in zip(timings, overhead):
        sources[t["source"]] = sources.get(t["source"], 0) + 1
        by_source.setdefault(t["source"], []).append(o)
    return {
        "benchmark": "lsp",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_1m_after": os.getloadavg()[0]},  # other work on the machine inflates the tails
        "versions": _versions(),
        "config": {"file": str(path), "file_sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
                   "keystrokes": len(block), "interval_ms": a.interval_ms, "engine": a.engine, **options},
        "engine": final["engine"],
        "engine_load_s": load_s,
        "latency_ms": summary(client_ms),
        "engine_wait_ms": summary(engine_ms),
        "overhead_definition": "server side: first byte of the keystroke's didChange read -> serialized answer "
                               "handed to write(), minus time inside the engine's stream (and the debounce)",
        "overhead_ms": summary(overhead),
        "overhead_end_to_end_ms": summary(end_to_end),  # at the client: + pipes and OS wake-ups both ways
        # An empty request at the same pacing: what the pipes and the OS cost (a VM waking idle vCPUs, say).
        "round_trip_floor_ms": summary(floor_ms),
        "overhead_in_handler_ms": summary(handler),  # of which inside the server's completion handler
        "phases_ms": {k: summary(v) for k, v in phases.items()},
        "overhead_by_source_ms": {k: summary(v) for k, v in by_source.items()},
        "answers_shown": shown,
        "sources": sources,
        "counters": final["counters"],
        "target_overhead_p95_ms": TARGET_OVERHEAD_P95_MS,
        "target_met": bool(overhead) and percentile(overhead, 0.95) <= TARGET_OVERHEAD_P95_MS,
    }


def _keystroke_start(t: dict, sent: float) -> float:
    """When the server read the keystroke's first bytes: its didChange's (if the request carries the one sent
    for this keystroke), else the request's own."""
    change = t.get("change_recv")
    return change if change is not None and change >= sent - 1e-4 else t["t_recv"]


# (name, from, to): server-side phases of a keystroke, between the timestamps the server records per request
# (perf_counter, which on Linux is CLOCK_MONOTONIC and so comparable with the client's).
PHASES = (
    ("pipe_in (client write -> server read)", "client_sent", "change_recv"),
    ("didChange parse", "change_recv", "change_parsed"),
    ("didChange apply", "change_parsed", "change_done"),
    ("request parse", "request_ready", "t_parsed"),
    ("dispatch to handler task", "t_parsed", "t_start"),
    ("handler until prompt (model answers)", "t_start", "t_prompt"),
    ("prompt build + start generation", "t_prompt", "t_started"),
    ("start -> first engine chunk (incl. engine)", "t_started", "t_first_chunk"),
    ("handler end -> result to pygls", "t_answer", "t_result"),
    ("serialize", "t_result", "t_write"),
    ("write call (wakes the client)", "t_write", "t_sent"),
    ("pipe_out (server write -> client read)", "t_write", "client_received"),
)


def _phases(timings: list[dict], sent_at: list[float], received_at: list[float]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name, _, _ in PHASES}
    for t, sent, received in zip(timings, sent_at, received_at):
        stamps = dict(t, client_sent=sent, client_received=received)
        if stamps.get("change_recv") is None or stamps["change_recv"] < sent - 1e-4:
            stamps.pop("change_recv", None)
        # the request may have been read with the didChange, before the didChange was applied
        stamps["request_ready"] = max(t["t_recv"], stamps.get("change_done") or 0)
        for name, a, b in PHASES:
            if stamps.get(a) is not None and stamps.get(b) is not None:
                out[name].append((stamps[b] - stamps[a]) * 1000)
    return {k: v for k, v in out.items() if v}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"lingls": __version__}
    for name in ("pygls", "lsprotocol", "torch"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lingls bench lsp", description=__doc__.split("\n\n")[0])
    p.add_argument("--file", default=textwrap.__file__, help="Python file to type in (default: stdlib textwrap.py)")
    p.add_argument("--keystrokes", type=int, default=300)
    p.add_argument("--interval-ms", type=float, default=60, help="pause between keystrokes (not timed)")
    p.add_argument("--debounce-ms", type=float, default=0, help="server debounceMs (reported apart from overhead)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--engine", choices=["both", "model", "instant"], default="both",
                   help="model: the configured engine; instant: no model, the LSP's own cost alone; both (default)")
    p.add_argument("--endpoint", help="remote /v1/completions server instead of the in-process model")
    p.add_argument("--model", help="model directory (default: the embedded ling-nano)")
    p.add_argument("--device", default="cpu", help="device of the in-process model (default cpu)")
    p.add_argument("--phases", action="store_true", help="print the per-phase breakdown (always in the JSON)")
    p.add_argument("--out", default="bench/results/lsp.json")
    p.add_argument("--log-file", default=os.path.join(tempfile.gettempdir(), "lingls-bench-lsp.log"))
    a = p.parse_args(argv)
    runs = {}
    for engine in (["instant", "model"] if a.engine == "both" else [a.engine]):
        a.engine = engine
        runs[engine] = result = asyncio.run(run(a))
        lat, ovh, eng = result["latency_ms"], result["overhead_ms"], result["engine_wait_ms"]
        hnd = result["overhead_in_handler_ms"]
        print(f"{result['config']['keystrokes']} keystrokes on {Path(a.file).name} with {result['engine']['name']}:")
        print(f"  keystroke -> answer  p50 {lat['p50']:.2f} ms  p95 {lat['p95']:.2f} ms")
        print(f"  engine wait          p50 {eng['p50']:.2f} ms  p95 {eng['p95']:.2f} ms")
        e2e = result["overhead_end_to_end_ms"]
        print(f"  LSP overhead         p50 {ovh['p50']:.2f} ms  p95 {ovh['p95']:.2f} ms  "
              f"(server: keystroke's bytes read -> answer to write(), minus engine; "
              f"target p95 <= {TARGET_OVERHEAD_P95_MS} ms: {'met' if result['target_met'] else 'NOT met'})")
        print(f"    of which in the completion handler  p50 {hnd['p50']:.2f} ms  p95 {hnd['p95']:.2f} ms")
        print(f"  at the client        p50 {e2e['p50']:.2f} ms  p95 {e2e['p95']:.2f} ms  "
              f"(keystroke -> answer minus engine: + pipes and OS wake-ups)")
        flo = result["round_trip_floor_ms"]
        print(f"    empty request round trip (floor)    p50 {flo['p50']:.2f} ms  p95 {flo['p95']:.2f} ms")
        if a.phases:
            for name, v in result["phases_ms"].items():
                print(f"    {name:<44} p50 {v['p50']:.3f}  p95 {v['p95']:.3f}  max {v['max']:.3f} ms")
        print(f"  answers: {result['sources']}, engine calls {result['counters']['engine_calls']}", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "lsp", "runs": runs}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
