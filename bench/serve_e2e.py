"""Batch-1 latency through the real `lingls serve`, timed by its client: one long prompt, one long generation.

Starts `lingls serve --model DIR [--tp N] [--draft D [--simulate-accept A]]` on a free port, waits for /health, then per
run sends one streaming greedy completion (stream_options.include_usage) of a prompt of --prompt-tokens tokens (random
ids of the model's vocabulary, decoded to text; each run a fresh prompt, so no prefix is reused) asking for
--new-tokens tokens, and records from the client side:
- TTFT: request sent -> first streamed chunk,
- TPOT: (last chunk - first chunk) / (completion tokens - 1), the completion tokens being the server's count,
and, from the server's /metrics after all runs, its own TTFT and TPOT means. The seed's workload is an
8,192-token prompt and 1,024 new tokens. With a weightless checkpoint (`python -m lingls.model.random_checkpoint
DIR --flash --weightless`) this runs Ling-3.0-flash's real shapes end to end; its text is noise, and its drafts
are never accepted, so `--simulate-accept A` makes every round accept A drafts (SIMULATED acceptance, recorded
as such, with the server's accept length).

    python -m bench.serve_e2e --model DIR [--tp N] [--draft mtp [--draft-k K] [--simulate-accept A]]
                              [--prompt-tokens 8192] [--new-tokens 1024] [--runs 3] [--device cuda|cpu] --out OUT.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tokenizers import Tokenizer

from bench.common import free_port, write_result


def start_server(args, port: int, log: Path, launcher: list[str] | None = None) -> subprocess.Popen:
    """`lingls serve` (through `launcher`, the command before `serve`: default python -m lingls.cli), ready."""
    cmd = [*(launcher or [sys.executable, "-m", "lingls.cli"]), "serve", "--model", args.model, "--port", str(port),
           "--tp", str(args.tp), "--draft", args.draft]
    if args.draft_k is not None:
        cmd += ["--draft-k", str(args.draft_k)]
    if args.simulate_accept is not None:
        cmd += ["--simulate-accept", str(args.simulate_accept)]
    if args.draft_vocab:
        cmd += ["--draft-vocab", args.draft_vocab]
    if args.device:
        cmd += ["--device", args.device]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stderr=err, stdout=err, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + args.load_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lingls serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200 and json.loads(r.read()).get("status") == "ok":
                    return proc
        except urllib.error.HTTPError as e:
            if e.code != 503:  # 503: still loading
                proc.terminate()
                raise RuntimeError(f"lingls serve failed to load: {e.read()[:1000]!r}") from None
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"lingls serve was not ready after {args.load_timeout} s:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within a minute."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def one_run(port: int, prompt: str, new_tokens: int, timeout: float) -> dict:
    """One streaming greedy completion; chunk arrival times measured here, token counts from the server."""
    body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    first = last = None
    usage, finish = None, None
    while line := resp.readline():
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        now = time.perf_counter()
        if chunk["choices"][0].get("text"):
            first = first or now
            last = now
        usage = chunk.get("usage") or usage
        finish = chunk["choices"][0].get("finish_reason") or finish
    conn.close()
    n = (usage or {}).get("completion_tokens", 0)
    return {"prompt_tokens": (usage or {}).get("prompt_tokens"), "completion_tokens": n, "finish_reason": finish,
            "ttft_ms": None if first is None else (first - sent) * 1e3,
            "tpot_ms": (last - first) * 1e3 / (n - 1) if first is not None and n > 1 else None}


def server_metrics(port: int) -> dict:
    """Mean TTFT and TPOT from the server's Prometheus histograms (sum / count), and the speculative accept length."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    out = {}
    for what in ("ttft", "tpot"):
        s = [v for k, v in values.items() if k.endswith(f"{what}_seconds_sum")]
        c = [v for k, v in values.items() if k.endswith(f"{what}_seconds_count")]
        if s and c and c[0]:
            out[f"server_{what}_mean_ms"] = s[0] / c[0] * 1e3
    if "lingls_spec_accept_length" in values:
        out["server_accept_length"] = values["lingls_spec_accept_length"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--draft", default="none")
    p.add_argument("--draft-k", type=int, default=None, help="passed to lingls serve")
    p.add_argument("--simulate-accept", type=int, default=None,
                   help="passed to lingls serve: forced accepted drafts per round (random weights; SIMULATED)")
    p.add_argument("--device", default=None, help="passed to lingls serve (default: its own choice)")
    p.add_argument("--draft-vocab", default=None, metavar="FILE", help="passed to lingls serve")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--load-timeout", type=float, default=900.0, help="seconds for the model to load")
    p.add_argument("--out", default="bench/results/serve_e2e.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    rng = random.Random(0)
    port = free_port()
    t0 = time.perf_counter()
    proc = start_server(args, port, out.with_suffix(".log"))
    result = {"bench": "serve_e2e", "model": args.model, "tp": args.tp, "draft": args.draft, "draft_k": args.draft_k,
              "draft_vocab": args.draft_vocab, "simulated_accept": args.simulate_accept,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "load_s": time.perf_counter() - t0,
              "time": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": []}
    try:
        for _ in range(args.runs):
            prompt = tok.decode([rng.randrange(vocab) for _ in range(args.prompt_tokens)])
            run = one_run(port, prompt, args.new_tokens, timeout=600)
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
        result.update(server_metrics(port))
    finally:
        stop_server(proc)
    for key in ("ttft_ms", "tpot_ms"):
        vals = [r[key] for r in result["runs"] if r[key] is not None]
        result[f"median_{key}"] = statistics.median(vals) if vals else None
    write_result(out, result)
    print(f"TP={args.tp} draft={args.draft}: prompt {args.prompt_tokens} tokens, {args.new_tokens} new: "
          f"median TTFT {result['median_ttft_ms']} ms, median TPOT {result['median_tpot_ms']} ms; wrote {out}")
    return 0 if result["runs"] and all(r["completion_tokens"] for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
