"""`lingls bench remote`: what the HTTP hop to `lingls serve` adds to a completion request on loopback.

The same model (the embedded ling-nano, CPU, one thread each) runs in this process (LocalEngine) and behind
`lingls serve` (RemoteEngine over a kept-alive connection), and the same requests go to both, interleaved:
- empty: max_tokens=0, so no model step runs; the whole time is request handling (tokenising the prompt,
  scheduling the worker), and remote minus local is the hop itself: HTTP, JSON, server-sent events, the
  server's event loop;
- first chunk: greedy FIM prompts from a real file; time to the first text chunk, remote minus local per
  prompt (model time is the same on both sides, so the difference is the hop again, with model noise).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from lingls import __version__
from lingls.bench.lsp import summary
from lingls.engine.protocol import GenerateRequest


def prompts(path: str, n: int, fim, window: int = 1500) -> list[str]:
    """`n` FIM prompts cut around cursors spread over the file (line ends, after some indentation)."""
    text = Path(path).read_text()
    cursors = [m.end() for m in re.finditer(r"\n        \w+ = ", text)] or [m.end() for m in re.finditer(r"\n", text)]
    picked = [cursors[i * len(cursors) // n] for i in range(n)]
    return [f"{fim.prefix}{text[max(0, c - window) : c]}{fim.suffix}{text[c : c + window // 4]}{fim.middle}"
            for c in picked]


async def timed(engine, request: GenerateRequest) -> tuple[float, float]:
    """(ms to the first text chunk or the end when there is none, ms to the end)."""
    t0 = time.perf_counter()
    first = None
    async for _ in engine.generate(request):
        first = first or time.perf_counter()
    end = time.perf_counter()
    return ((first or end) - t0) * 1000, (end - t0) * 1000


def start_server(log: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "lingls.cli", "serve", "--device", "cpu", "--port", "0"],
                                stderr=err, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        text = log.read_text()
        m = re.search(r"listening on (http://\S+) ", text)
        if m and " ready (" in text:
            return proc, m.group(1)
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"lingls bench remote: lingls serve did not start:\n{log.read_text()}")


async def run(a: argparse.Namespace, endpoint: str) -> dict:
    import torch

    from lingls.engine.local import LocalEngine
    from lingls.engine.remote import RemoteEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the server: the same arithmetic, and no fight over two cores
    local = LocalEngine()
    await local.start()
    remote = await asyncio.to_thread(RemoteEngine, endpoint)
    try:
        fim_prompts = prompts(a.file, a.prompts, local.tokenizer.fim)
        empty, first, total = {"local": [], "remote": []}, {"local": [], "remote": []}, {"local": [], "remote": []}
        hop_first = []
        for round_ in range(a.warmup + a.rounds):
            for i, prompt in enumerate(fim_prompts):
                # empty: the whole request without a model step
                req0 = GenerateRequest(prompt, max_tokens=0)
                for name, engine in (("local", local), ("remote", remote)):
                    ms = (await timed(engine, req0))[1]
                    if round_ >= a.warmup:
                        empty[name].append(ms)
                req = GenerateRequest(prompt, max_tokens=a.max_tokens, temperature=0.0)
                pair = {}
                for name, engine in (("local", local), ("remote", remote)):
                    # both engines see the same prompts in the same order: the same prefix-cache state
                    pair[name] = await timed(engine, req)
                if round_ >= a.warmup:
                    for name in pair:
                        first[name].append(pair[name][0])
                        total[name].append(pair[name][1])
                    hop_first.append(pair["remote"][0] - pair["local"][0])
        hop_empty = [remote_t - local_t for remote_t, local_t in zip(empty["remote"], empty["local"])]
        return {
            "config": {"file": a.file, "prompts": a.prompts, "rounds": a.rounds, "max_tokens": a.max_tokens,
                       "endpoint": endpoint, "model": local.name, "threads": 1},
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "lingls": __version__, "loadavg": os.getloadavg()},
            "hop_ms": {"empty_request": summary(hop_empty), "first_chunk": summary(hop_first)},
            "empty_request_ms": {k: summary(v) for k, v in empty.items()},
            "first_chunk_ms": {k: summary(v) for k, v in first.items()},
            "total_ms": {k: summary(v) for k, v in total.items()},
            "remote_stats": {"requests": remote.stats.requests, **remote.stats.extra},
        }
    finally:
        await remote.close()
        await local.close()
        torch.set_num_threads(threads)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lingls bench remote", description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", help="an already running `lingls serve` with the embedded ling-nano "
                                      "(default: start one on a free port)")
    p.add_argument("--file", default=textwrap.__file__, help="Python file the prompts are cut from")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5, help="times each prompt is sent (after one warm-up round)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", default="bench/results/remote.json")
    a = p.parse_args(argv)
    proc = None
    endpoint = a.endpoint
    if endpoint is None:
        proc, endpoint = start_server(Path(tempfile.gettempdir()) / "lingls-bench-remote.log")
    try:
        result = asyncio.run(run(a, endpoint))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    hop_e, hop_f = result["hop_ms"]["empty_request"], result["hop_ms"]["first_chunk"]
    n = a.prompts * a.rounds
    print(f"HTTP hop on loopback ({n} requests each, {result['config']['model']} on CPU):")
    print(f"  empty request   p50 {hop_e['p50']:.2f} ms  p95 {hop_e['p95']:.2f} ms   "
          f"(local p50 {result['empty_request_ms']['local']['p50']:.2f}, remote p50 "
          f"{result['empty_request_ms']['remote']['p50']:.2f})")
    print(f"  first chunk     p50 {hop_f['p50']:.2f} ms  p95 {hop_f['p95']:.2f} ms   "
          f"(local p50 {result['first_chunk_ms']['local']['p50']:.2f}, remote p50 "
          f"{result['first_chunk_ms']['remote']['p50']:.2f})")
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 0
