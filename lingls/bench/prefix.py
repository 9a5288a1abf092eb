"""`lingls bench prefix`: time to first token after a one-token edit at the end of a long prompt, with prefix
reuse, against a cold prefill of the same prompt (Ling-3.0-flash shapes, random weights, one TP=4 rank's
shard by default, as in `lingls bench step`).

TTFT here is the wall time from handing the runner the prompt to holding the first new token on the host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from lingls.bench.step import build_flash, fla_version
from lingls.runtime.runner import ModelRunner, Sampling


def ttft_ms(runner: ModelRunner, prompt: list[int]) -> tuple[float, int]:
    """(ms to the first token, prompt tokens reused)."""
    torch.cuda.synchronize()
    saved = runner.cache.stats.tokens_saved
    t0 = time.perf_counter()
    steps = runner.generate(prompt, 2, Sampling())
    next(steps)
    ms = (time.perf_counter() - t0) * 1e3
    steps.close()
    torch.cuda.synchronize()
    return ms, runner.cache.stats.tokens_saved - saved


def cold_prefill_profile(runner: ModelRunner, prompt: list[int], top: int) -> list[dict]:
    """Where a cold prefill's time goes: its `top` ops by device time (CUPTI via torch.profiler), each with
    its calls and the host time spent in it (a prefill issued op by op can be bound by either)."""
    from torch.profiler import ProfilerActivity, profile

    runner.cache.reset()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ttft_ms(runner, prompt)
    rows = [dict(op=e.key[:90], device_ms=e.self_device_time_total / 1e3, host_ms=e.self_cpu_time_total / 1e3,
                 calls=e.count) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r["device_ms"])
    for r in rows[:top]:
        print(f"  {r['device_ms']:9.1f} ms device {r['host_ms']:9.1f} ms host {r['calls']:7d} x  {r['op']}")
    return rows[:top]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lingls bench prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="prompt length")
    p.add_argument("--layers", type=int, default=42)
    p.add_argument("--tp", type=int, default=4, help="run rank 0's shard of this tensor-parallel degree")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (and snapshot spacing)")
    p.add_argument("--edits", type=int, default=5)
    p.add_argument("--out", default="bench/results/prefix.json")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile one more cold prefill: its N largest ops by device time, in the JSON")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("lingls bench prefix: needs a CUDA GPU", file=sys.stderr)
        return 2
    model = build_flash(a.layers, tp=a.tp)
    vocab = model.config.vocab_size
    runner = ModelRunner(model, capacity=a.tokens + 64, prefill_chunk=a.chunk)
    runner.warmup(greedy_only=True)
    g = torch.Generator().manual_seed(0)
    warm = torch.randint(0, vocab, (a.chunk + 100,), generator=g).tolist()
    ttft_ms(runner, warm)  # compile / autotune whatever kernels a prefill uses
    prompt = torch.randint(0, vocab, (a.tokens,), generator=g).tolist()
    runner.cache.reset()
    cold, _ = ttft_ms(runner, prompt)
    print(f"cold prefill of {a.tokens} tokens: TTFT {cold:.1f} ms", flush=True)
    edits, reused = [], []
    for i in range(a.edits):
        edited = prompt[:-1] + [(prompt[-1] + 1 + i) % vocab]  # the last token changes, as a keystroke does
        ms, saved = ttft_ms(runner, edited)
        edits.append(ms)
        reused.append(saved)
    append, _ = ttft_ms(runner, edited + [17])
    ops = cold_prefill_profile(runner, prompt, a.profile) if a.profile else None
    result = {"bench": "prefix", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "layers": a.layers, "tp": a.tp, "prompt_tokens": a.tokens, "prefill_chunk": a.chunk,
              "cold_ttft_ms": cold, "edit_ttft_ms": edits, "edit_ttft_median_ms": statistics.median(edits),
              "edit_tokens_reused": reused, "append_one_token_ttft_ms": append,
              "speedup": cold / statistics.median(edits), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "fla": fla_version(),
              **({"cold_prefill_ops": ops} if ops else {})}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"one-token edit at the end: TTFT median {result['edit_ttft_median_ms']:.2f} ms "
          f"(reused {reused[-1]} tokens), x{result['speedup']:.0f} faster than cold; "
          f"appending a token: {append:.2f} ms", flush=True)
    return 0
