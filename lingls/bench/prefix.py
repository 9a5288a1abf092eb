"""`lingls bench prefix`: time to first token after a one-token edit at the end of a long prompt, with prefix
reuse, against a cold prefill of the same prompt (Ling-3.0-flash shapes, random weights, one TP=4 rank's
shard by default, as in `lingls bench step`).

With `--model DIR` (`--model nano`: the embedded ling-nano) it measures a real model instead, on the CPU by
default, at the language server's prompt budget (1,536 tokens): a real Python file is cut at a cursor after a
line's indentation, the prompt is the last 1,536 tokens before it, and the user types that line one character at
a time; after each keystroke (a one-line edit: everything before the line is reused) it times the first token
and a whole one-line completion (greedy, up to the first newline or 48 tokens), then the same keystrokes through
LocalEngine.stream (what the language server waits for), and prints their p50 with the machine's load average
(other work on the machine inflates the figures).

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


def _sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize()


def ttft_ms(runner: ModelRunner, prompt: list[int]) -> tuple[float, int]:
    """(ms to the first token, prompt tokens reused)."""
    _sync(runner)
    saved = runner.cache.stats.tokens_saved
    t0 = time.perf_counter()
    steps = runner.generate(prompt, 2, Sampling())
    next(steps)
    ms = (time.perf_counter() - t0) * 1e3
    steps.close()
    _sync(runner)
    return ms, runner.cache.stats.tokens_saved - saved


def line_ms(runner: ModelRunner, prompt: list[int], texts: list[str], stop: set[int],
            max_new: int = 48) -> tuple[float, float, int, float]:
    """(ms to the first token, ms to the end of the line, tokens written, CPU ms this thread spent on the line)
    for a greedy one-line completion (`stop`: ids that end a completion). The CPU time leaves out the time other
    processes held the cores: on a busy machine it says what the line costs, the wall time what it took."""
    _sync(runner)
    t0, cpu0 = time.perf_counter(), time.thread_time()
    first, n = None, 0
    steps = runner.generate(prompt, max_new, Sampling())
    for token in steps:
        n += 1
        if first is None:
            first = (time.perf_counter() - t0) * 1e3
        if token in stop or "\n" in texts[token]:
            break
    steps.close()
    _sync(runner)
    return first or 0.0, (time.perf_counter() - t0) * 1e3, n, (time.thread_time() - cpu0) * 1e3


def engine_ms(model_dir: Path, device: str, prompts: list[str], max_new: int = 48) -> tuple[list[float], list[float]]:
    """(ms to the first text, ms to the end of the line) of one-line completions of `prompts` (after one more, the
    first, as a warm-up) through LocalEngine.stream, as the language server asks for them: tokenising, token
    healing and the stop at the newline included."""
    import asyncio

    from lingls.runtime.engine import GenerateRequest
    from lingls.runtime.local import LocalEngine

    async def run() -> tuple[list[float], list[float]]:
        engine = LocalEngine(str(model_dir), device=device)
        firsts, wholes = [], []
        try:
            await engine.start()
            for prompt in prompts:
                t0, first = time.perf_counter(), None
                async for chunk in engine.stream(GenerateRequest(prompt, max_tokens=max_new, stop=("\n",))):
                    if chunk.text and first is None:
                        first = time.perf_counter() - t0
                whole = time.perf_counter() - t0
                firsts.append((whole if first is None else first) * 1e3)
                wholes.append(whole * 1e3)
        finally:
            await engine.close()
        return firsts[1:], wholes[1:]

    return asyncio.run(run())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def model_latency(a) -> int:
    """The --model mode: a real model at the prompt budget, a line typed keystroke by keystroke."""
    import os
    import platform

    from lingls.model import load_model
    from lingls.runtime import cpu_step
    from lingls.runtime.local import cpu_threads, default_model_dir
    from lingls.runtime.tokenizer import Tokenizer

    model_dir = default_model_dir() if a.model == "nano" else Path(a.model)
    device = a.device
    if a.threads or device == "cpu":
        torch.set_num_threads(a.threads or cpu_threads())
    load_before = os.getloadavg()
    model = load_model(model_dir, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    tok = Tokenizer(model_dir)
    texts = tok.candidates().texts
    stop = tok.special_ids | tok.eos_ids
    runner = ModelRunner(model, capacity=a.tokens + 128)
    lean = not a.model_step and cpu_step.install(runner)  # as LocalEngine runs it
    text = Path(a.file).read_text(encoding="utf-8")
    lines = text.split("\n")
    # the cursor's line: the first code line past the middle of the file with at least `keystrokes` characters
    start = len(lines) // 2
    li = next(i for i in range(start, len(lines)) if len(lines[i].strip()) >= a.keystrokes)
    before = "\n".join(lines[:li]) + "\n"
    line = lines[li]
    indent = line[: len(line) - len(line.lstrip())]
    whole = tok.encode(before + indent)
    first_token = max(0, len(whole) - a.tokens)  # the window's start stays put while the line is typed, as the
    context = whole[first_token:]  # language server's does (it moves a whole line at a time)
    runner.generate(context, 2, Sampling()).close()  # warm-up: allocations, first-call paths
    runner.cache.reset()
    cold, _ = ttft_ms(runner, context)
    firsts, lines_ms, reused, written, lines_cpu = [], [], [], [], []
    for k in range(1, a.keystrokes + 1):  # one more character of the line each time
        typed = line.strip()[:k]
        prompt = tok.encode(before + indent + typed)[first_token:]
        saved = runner.cache.stats.tokens_saved
        first, total, n, cpu = line_ms(runner, prompt, texts, stop)
        firsts.append(first)
        lines_cpu.append(cpu)
        lines_ms.append(total)
        written.append(n)
        reused.append(runner.cache.stats.tokens_saved - saved)
    engine = None
    if device == "cpu" and not a.model_step:  # the same keystrokes through the engine the language server runs
        if a.threads:
            os.environ["LINGLS_THREADS"] = str(a.threads)
        window = tok.decode(context)
        engine = engine_ms(model_dir, device, [window] + [window + line.strip()[:k] for k in range(1, a.keystrokes + 1)])
    load_after = os.getloadavg()
    result = {"bench": "prefix", "mode": "model", "model": str(model_dir), "device": device,
              "step": "cpu_step" if lean else "model", "torch": torch.__version__,
              "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "processor": platform.processor() or platform.machine(), "file": str(a.file), "line": li + 1,
              "prompt_tokens": len(context), "keystrokes": a.keystrokes, "cold_ttft_ms": cold,
              "edit_ttft_ms": firsts, "edit_ttft_p50_ms": statistics.median(firsts),
              "edit_ttft_p95_ms": percentile(firsts, 0.95), "line_ms": lines_ms,
              "line_p50_ms": statistics.median(lines_ms), "line_p95_ms": percentile(lines_ms, 0.95),
              "line_cpu_ms": lines_cpu, "line_cpu_p50_ms": statistics.median(lines_cpu),
              "line_tokens": written, "tokens_reused": reused,
              **({"engine_first_text_ms": engine[0], "engine_first_text_p50_ms": statistics.median(engine[0]),
                  "engine_line_ms": engine[1], "engine_line_p50_ms": statistics.median(engine[1]),
                  "engine_line_p95_ms": percentile(engine[1], 0.95)} if engine else {}),
              "loadavg_before": load_before, "loadavg_after": load_after,
              "targets_ms": {"edit_ttft_p50": 50, "line_p50": 150},
              "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{model_dir.name} on {device} ({torch.get_num_threads()} threads, {result['step']} step), "
          f"prompt {len(context)} tokens, "
          f"cold prefill TTFT {cold:.0f} ms")
    print(f"one-line edit (prefix reused, median {statistics.median(reused):.0f} tokens): first token p50 "
          f"{result['edit_ttft_p50_ms']:.1f} ms, p95 {result['edit_ttft_p95_ms']:.1f} ms (target <= 50)")
    print(f"one-line completion ({statistics.median(written):.0f} tokens median): p50 {result['line_p50_ms']:.1f} ms, "
          f"p95 {result['line_p95_ms']:.1f} ms (target <= 150); CPU time of the line p50 "
          f"{result['line_cpu_p50_ms']:.1f} ms")
    if engine:
        print(f"through LocalEngine.stream (tokenising, healing, stop at the newline): first text p50 "
              f"{result['engine_first_text_p50_ms']:.1f} ms, whole line p50 {result['engine_line_p50_ms']:.1f} ms, "
              f"p95 {result['engine_line_p95_ms']:.1f} ms")
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}; wrote {out}", flush=True)
    return 0


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
    p.add_argument("--tokens", type=int, default=None, help="prompt length (default 8192; with --model 1536)")
    p.add_argument("--model", help="a model directory, or 'nano' for the embedded ling-nano: time it on real code")
    p.add_argument("--device", default="cpu", help="with --model: the device (default cpu)")
    p.add_argument("--file", default=None, help="with --model: the Python file typed in (default: stdlib argparse.py)")
    p.add_argument("--keystrokes", type=int, default=10, help="with --model: characters of the line typed")
    p.add_argument("--threads", type=int, default=None,
                   help="with --model on a CPU: torch threads (default: LocalEngine's, LINGLS_THREADS or 1)")
    p.add_argument("--model-step", action="store_true",
                   help="with --model on a CPU: the model's own step instead of the lean CPU step (to compare)")
    p.add_argument("--layers", type=int, default=42)
    p.add_argument("--tp", type=int, default=4, help="run rank 0's shard of this tensor-parallel degree")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (and snapshot spacing)")
    p.add_argument("--edits", type=int, default=5)
    p.add_argument("--out", default="bench/results/prefix.json")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile one more cold prefill: its N largest ops by device time, in the JSON")
    a = p.parse_args(argv)
    if a.model:
        import argparse as _argparse
        a.tokens = a.tokens or 1536
        a.file = a.file or _argparse.__file__
        if a.out == "bench/results/prefix.json":
            a.out = "bench/results/nano_latency.json"  # the file docs/performance.md cites
        return model_latency(a)
    a.tokens = a.tokens or 8192
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
