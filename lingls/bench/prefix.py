"""`lingls bench prefix`: time to first token of cold prefills (512, 1,536, 4,096 and 8,192 tokens by default) at
Ling-3.0-flash shapes (random weights, one TP=4 rank's shard by default, as in `lingls bench step`), by the
runtime's path (on a GPU: prefill graphs, a cold prompt's first piece and its short tail pieces as CUDA graph
replays), by the same code run eagerly (`eager`), and by the path before issue 39 (`legacy_prefill_step`, kept
here only as the baseline, `--baseline`), beside the floor (`lingls.bench.floor`: the prefill's FLOPs over the
bf16 matmul peak and its weight bytes over the copy rate, both measured in the same run; the floor is the larger)
and the time the host takes to issue the prefill. Then the graphed and eager paths' results on every prompt
(last hidden state, last logits, states left behind, first greedy token), and the first token after a one-token
edit at the end of the longest prompt, with prefix reuse. `eager_torch_ops` is the eager path with the prefill
kernels off (`LINGLS_KERNELS=0`): their torch reference, timed and compared in the same run. `--previous` times
the path before, graphed on a runner of its own: the routed experts' kernels in their forms before
(`prefill_moe.PREVIOUS`: a program per block and column tile, for gate/up and for down), the rest as shipped;
`--tune` first chooses how the runtime runs the state pass (`tune_kda_state_pass`).
`--profile N` adds, for the paths `--profile-paths` names, the N largest ops and kernels of one cold prefill (the
prefill alone; device time: kernels inside a graph replay are listed by name) and its kernel time summed by kind
(`kernel_kinds`). Time to first token through `lingls serve` at the same sizes: `python -m bench.serve_ttft`.

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
from typing import NamedTuple

import torch

from lingls.bench.floor import median_ms
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

    from lingls.engine.local import LocalEngine
    from lingls.engine.protocol import GenerateRequest

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


def tokenise_ms(model_dir: Path, prompts: list[str]) -> tuple[list[float], list[float]]:
    """(ms of Tokenizer.encode, ms of Tokenizer.encode_prompt) for each of `prompts` in turn (after the first, a
    warm-up), each on a tokenizer of its own; the two must give the same ids."""
    from lingls.engine.tokenizer import Tokenizer

    whole_tok, pieces_tok = Tokenizer(model_dir), Tokenizer(model_dir)
    whole, pieces = [], []
    for prompt in prompts:
        t0 = time.perf_counter()
        ids = whole_tok.encode(prompt)
        t1 = time.perf_counter()
        if pieces_tok.encode_prompt(prompt) != ids:
            raise AssertionError("Tokenizer.encode_prompt differs from Tokenizer.encode")
        whole.append((t1 - t0) * 1e3)
        pieces.append((time.perf_counter() - t1) * 1e3)
    return whole[1:], pieces[1:]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def model_latency(a) -> int:
    """The --model mode: a real model at the prompt budget, a line typed keystroke by keystroke."""
    import os
    import platform

    from lingls.engine.local import cpu_threads, default_model_dir
    from lingls.engine.tokenizer import Tokenizer
    from lingls.model import load_model
    from lingls.runtime import cpu_step

    model_dir = default_model_dir() if a.model == "nano" else Path(a.model)
    device = a.device
    if a.threads or device == "cpu":
        torch.set_num_threads(a.threads or cpu_threads())
    load_before = os.getloadavg()
    model = load_model(model_dir, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    tok = Tokenizer(model_dir)
    texts = tok.candidates().texts
    stop = tok.special_ids | tok.eos_ids
    runner = ModelRunner(model, capacity=a.tokens + 128, lean_cpu=not a.model_step)  # as LocalEngine runs it
    lean = isinstance(runner.fused, cpu_step.CpuStep)
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
    window = tok.decode(context)
    whole_ms, pieces_ms = tokenise_ms(model_dir, [window + line.strip()[:k] for k in range(a.keystrokes + 1)])
    engine = None
    if device == "cpu" and not a.model_step:  # the same keystrokes through the engine the language server runs
        if a.threads:
            os.environ["LINGLS_THREADS"] = str(a.threads)
        engine = engine_ms(model_dir, device,
                           [window] + [window + line.strip()[:k] for k in range(1, a.keystrokes + 1)])
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
              "tokenise_whole_ms": whole_ms, "tokenise_whole_p50_ms": statistics.median(whole_ms),
              "tokenise_pieces_ms": pieces_ms, "tokenise_pieces_p50_ms": statistics.median(pieces_ms),
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
    print(f"tokenising the prompt after each keystroke: p50 {result['tokenise_whole_p50_ms']:.2f} ms whole, "
          f"{result['tokenise_pieces_p50_ms']:.2f} ms by pieces (Tokenizer.encode_prompt, what LocalEngine runs)")
    if engine:
        print(f"through LocalEngine.stream (tokenising, healing, stop at the newline): first text p50 "
              f"{result['engine_first_text_p50_ms']:.1f} ms, whole line p50 {result['engine_line_p50_ms']:.1f} ms, "
              f"p95 {result['engine_line_p95_ms']:.1f} ms")
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}; wrote {out}", flush=True)
    return 0


# what a prefill kernel is, by its name: (kind, pattern), the first match counts
KERNEL_KINDS = (
    ("experts: gate/up (grouped)", r"_grouped_gate_up"),
    ("experts: down (grouped)", r"_grouped_down"),
    ("experts: weighted sum", r"_combine_kernel"),
    ("experts: routing and sort", r"_route_kernel|_count_kernel|_offsets_kernel|_scatter_kernel|_block_expert"),
    ("KDA: fla state pass (chunk_gated_delta_rule_fwd_kernel_h)", r"delta_rule_fwd_kernel_h"),
    ("KDA: state pass (prefill_kda_state)", r"_state_pass_kernel"),
    ("KDA: tail snapshots (prefill_kda_state)", r"_snapshot_kernel"),
    ("KDA: fla, other kernels", r"chunk|kda|solve_tril|recompute_w_u|cumsum|fwd_o"),
    ("KDA: prologue, conv state, gated norm", r"_prologue_kernel|_conv_state_kernel|_gated_norm_kernel"),
    ("MLA: flash attention", r"flash|fmha|attention"),
    ("dense GEMMs (cuBLAS)", r"gemm|nvjet|sm90_xmma|cutlass|cublas"),
    ("residual add + RMSNorm", r"rms_norm"),
    ("tail step: fused decode kernels", r"_gate_up_kernel|_down_kernel|_route_token|_router_kernel|_gemv|_mla_|kda_"),
)


def kernel_kinds(kernels) -> list[dict]:
    """Device time of profiled kernels summed by `KERNEL_KINDS` (the rest as 'other'), largest first."""
    import re

    sums: dict[str, list] = {}
    for e in kernels:
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, e.name)), "other")
        entry = sums.setdefault(kind, [0.0, 0])
        entry[0] += e.device_time / 1e3
        entry[1] += 1
    return sorted(({"kind": k, "device_ms": ms, "kernels": n} for k, (ms, n) in sums.items()),
                  key=lambda r: -r["device_ms"])


def cold_prefill_profile(runner: ModelRunner, prompt: list[int], top: int) -> dict:
    """Where a cold prefill's time goes: the prefill alone (its pieces, the head and the first token's choice,
    no decode step), its `top` ops and kernels by device time (CUPTI via torch.profiler; the kernels a graph
    replay runs are listed by name, with no host time of their own), each with its calls and the host time
    spent in it (a prefill issued op by op can be bound by either), the device time of all kernels, and that
    time by kind of kernel (`kernel_kinds`)."""
    from torch.profiler import ProfilerActivity, profile

    runner.cache.reset()
    _sync(runner)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.prefill(prompt, Sampling())
        _sync(runner)
    runner.cache.reset()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    rows = [dict(op=e.key[:90], device_ms=e.self_device_time_total / 1e3, host_ms=e.self_cpu_time_total / 1e3,
                 calls=e.count) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r["device_ms"])
    kernel_ms = sum(e.device_time for e in kernels) / 1e3
    span_ms = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3 \
        if kernels else 0.0
    print(f"  {len(kernels)} kernels, {kernel_ms:.1f} ms of kernel time over a span of {span_ms:.1f} ms "
          f"from the first kernel's start to the last one's end")
    for r in rows[:top]:
        print(f"  {r['device_ms']:9.2f} ms device {r['host_ms']:9.2f} ms host {r['calls']:7d} x  {r['op']}")
    by_host = sorted(rows, key=lambda r: -r["host_ms"])[:10]
    print("  by host time: " + "; ".join(f"{r['op'][:40]} {r['host_ms']:.2f} ms x{r['calls']}" for r in by_host))
    kinds = kernel_kinds(kernels)
    print("  by kind: " + "; ".join(f"{k['kind']} {k['device_ms']:.2f} ms ({k['kernels']})" for k in kinds))
    return {"kernels": len(kernels), "kernel_ms": kernel_ms, "kernel_span_ms": span_ms, "top": rows[:top],
            "top_by_host": by_host, "by_kind": kinds}


# ---- the KDA state pass's value columns, measured on the GPU -------------------------------------------------
def tune_kda_state_pass(model, sizes: list[int], reps: int = 10) -> tuple[dict, list[dict]]:
    """How the KDA state pass of a prefill of each size in `sizes` runs (`prefill_kda_state`: fla's own pass, or
    the narrow pass at some value columns and pipeline stages), measured on one KDA
    layer's shapes: fresh random inputs as the prologue makes them (q, k L2-normalised, q scaled, beta in (0, 1),
    `slow_gates`; q, k and v in the dtype a bf16 model's prefill hands the recurrence, `prefill_kda.recurrence_dtype`)
    and a random initial state; for every option the time of one layer's whole recurrence as a CUDA graph replay,
    as it runs inside a prefill graph (CUDA events, median of `reps`; timed eagerly, fla's host work between its
    launches hides the device time), and the relative error of the output and final state against the torch
    chunked form in fp32 on the same inputs (`reference.kda_chunked`) and against fla's own pass. The fastest
    whose errors stay within twice fla's (+ 1e-4) is chosen. Returns (the table by token count for
    `prefill_kda_state.COLUMNS`, a row per size)."""
    from lingls.kernels import prefill_kda
    from lingls.kernels import prefill_kda_state as ks
    from lingls.kernels import reference as ref
    from lingls.model.ling import KimiDeltaAttention, fla_chunk_kda
    from lingls.runtime.graphs import capture

    attn = next(layer.attention for layer in model.decoder_layers if isinstance(layer.attention, KimiDeltaAttention))
    heads, d, lower = attn.heads, attn.d, attn.lower_bound
    fla = fla_chunk_kda()
    if fla is None or not ks.available():
        print("KDA state pass: fla-core 0.6.0 absent, fla's own chunk_kda (or the torch form) serves", flush=True)
        return {max(sizes): (0, 0)}, []
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    gen = torch.Generator(device="cuda").manual_seed(13)
    table, rows = {}, []
    # the largest first: fla's kernels autotune on their first call, keyed without the token count, so the first
    # call's length chooses their settings for every length (the server's warm-up is a prefill of a whole chunk;
    # tuned at 512 tokens, fla's kernels took 10.3 ms of an 8,192-token prefill against 8.2, docs/kernel-log.md)
    for t in sorted(sizes, reverse=True):
        rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
        dt = prefill_kda.recurrence_dtype(torch.bfloat16)
        q = (ref.l2_normalize(rnd(1, t, heads, d)) * d ** -0.5).to(dt)
        k = ref.l2_normalize(rnd(1, t, heads, d)).to(dt)
        v = rnd(1, t, heads, d).to(dt)
        g = slow_gates(rnd(1, t, heads, d), lower)
        beta = torch.sigmoid(rnd(1, t, heads))
        s0 = rnd(1, heads, d, d) * 0.05
        with torch.inference_mode():
            o_ref, s_ref = ref.kda_chunked(q.float(), k.float(), v.float(), g, beta, s0)
            options = []
            for columns, stages in ((0, 0), (16, 2), (16, 3), (16, 4), (32, 2), (32, 3)):
                if columns == 0:
                    run = lambda: fla(q=q, k=k, v=v, g=g, beta=beta, scale=1.0, initial_state=s0,  # noqa: E731
                                      output_final_state=True, use_qk_l2norm_in_kernel=False)
                else:
                    run = lambda c=columns, n=stages: ks.chunk_kda(q, k, v, g, beta, s0, c, n)  # noqa: E731
                try:
                    o, s = run()  # eagerly first: the kernels compile and fla's tune before the capture
                    if columns == 0:
                        o1, s1 = o, s
                    graph, _ = capture(run, [])
                    options.append({"columns": columns, "stages": stages, "ms": median_ms(graph.replay, reps, warm=2),
                                    "o_err": rel(o, o_ref), "state_err": rel(s, s_ref), "o_vs_fla": rel(o, o1),
                                    "state_vs_fla": rel(s, s1)})
                    del graph
                except Exception as e:  # a failed option is reported and not chosen
                    options.append({"columns": columns, "stages": stages, "error": repr(e)[:300]})
        base = options[0]
        ok = [o for o in options if "ms" in o and o["o_err"] <= 2 * base["o_err"] + 1e-4
              and o["state_err"] <= 2 * base["state_err"] + 1e-4]
        best = min(ok, key=lambda o: o["ms"])
        table[t] = (best["columns"], best["stages"])
        rows.append({"tokens": t, "inputs": str(dt), "chosen": table[t], "options": options})
        name = lambda o: "fla's pass" if o["columns"] == 0 else f"{o['columns']} columns x {o['stages']} stages"  # noqa: E731
        print(f"KDA recurrence at {t} tokens (one layer, {heads} heads, {dt} inputs, graph replays): " + "; ".join(
            f"{name(o)} {o['ms']:.3f} ms (err o {o['o_err']:.1e}, state {o['state_err']:.1e}; against fla's "
            f"o {o['o_vs_fla']:.1e}, state {o['state_vs_fla']:.1e})" if "ms" in o
            else f"{name(o)} failed: {o['error'][:80]}" for o in options) + f"; chosen {name(best)}", flush=True)
    return table, rows


def slow_gates(x: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """KDA gates (log decay per token and channel, in [lower_bound, 0)) from standard normal x, log-normal in
    size: a 64-token chunk keeps a median 0.65 of the state, a tenth of them above 0.97 and a tenth below 0.004, so
    parts of a state carry across many chunks, as a trained layer's long-memory channels carry them. (Gates of
    lower_bound * sigmoid(x - 4), ~-0.09 a token, forget a state within a chunk or two: every split then gave the
    unsplit pass's bits in the eighteenth session's tuning of a split pass, its runs starting from states that no
    longer mattered, so a wrong merge would have gone unseen.)"""
    return torch.clamp(-torch.exp(2 * x - 5), min=lower_bound)


# ---- the flash-shape cold prefill: the runtime's path beside the one before issue 39 -------------------------
def legacy_prefill_step(model):
    """The prefill step as it was before issue 39 (9f7a14b), kept here only as the benchmark's baseline: every
    piece, even the few tokens before a prompt's end, through torch ops; MLA attention of a long piece in the
    absorbed form over the plain fp32 reference (`mla_decode_reference`); the router as an fp32 GEMM over upcast
    copies; the routed experts through torch's grouped GEMM (`Experts._grouped`)."""
    import torch.nn.functional as F

    from lingls.kernels import reference as ref
    from lingls.kernels.mla import mla_decode_reference
    from lingls.model.config import KDA
    from lingls.model.ling import GATHER_EXPERTS_MAX_TOKENS, MoE

    par = model.par

    def absorbed(attn, x, positions, cache, kv_len):
        t = x.shape[0]
        q_nope, q_rope = attn._query(x)
        cos, sin = ref.rope_cos_sin(positions, attn.rope, attn.theta)
        q_rope = ref.apply_rope(q_rope, cos, sin, attn.interleave, heads=True)
        w = attn.kv_b_proj.weight.view(attn.heads, attn.nope + attn.vdim, attn.rank)
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w[:, : attn.nope])
        o_lat = mla_decode_reference(q_lat, q_rope, cache[:kv_len], positions, attn.scale).to(x.dtype)
        return attn._out(x, torch.einsum("thr,hvr->thv", o_lat, w[:, attn.nope:]).reshape(t, attn.heads, attn.vdim))

    def mlp(layer, h):
        x = layer.post_attention_layernorm(h)
        m = layer.mlp
        if not isinstance(m, MoE):
            return h + par.all_reduce(m(x))
        r = m.gate
        w, idx = ref.route_grouped_topk(F.linear(x.float(), r.weight.float()), r.expert_bias, r.top_k, r.n_group,
                                        r.topk_group, r.normalize, r.scale)
        experts = m.experts(x, w, idx) if x.shape[0] <= GATHER_EXPERTS_MAX_TOKENS else m.experts._grouped(x, w, idx)
        return h + par.all_reduce(experts + m.shared_experts(x) if m.shared_experts is not None else experts)

    def step(ids, state, positions, kv_len):
        h = model.model.word_embeddings(ids)
        for i, layer in enumerate(model.decoder_layers):
            x = layer.input_layernorm(h)
            if layer.kind == KDA:
                s = model.kda_slot[i]
                a, conv, rec = layer.attention(x[None], state.conv[s:s + 1], state.kda[s:s + 1])
                state.conv[s].copy_(conv[0])
                state.kda[s].copy_(rec[0])
                a = a[0]
            else:
                cache = state.latent[model.mla_slot[i]]
                cache.index_copy_(0, positions, layer.attention.latent(x, positions))
                a = absorbed(layer.attention, x, positions, cache, kv_len)
            h = mlp(layer, h + par.all_reduce(a))
        return h

    return step


class PrefillPath(NamedTuple):
    """A way to prefill, timed beside the others: the runner it runs on (a graph bakes in the kernels it was
    captured with, so a path with other expert kernels has a runner, and graphs, of its own), its prefill step,
    its chunk (piece size and snapshot spacing), whether a cold prompt's pieces replay graphs, the KDA state
    pass (`prefill_kda_state.COLUMNS`), the routed experts' gate/up form (`prefill_moe.FORM`) and whether a cold
    prompt's tail snapshots come out of its one piece (`ModelRunner.tail_free`) while it runs."""
    runner: ModelRunner
    step: object
    chunk: int
    graphs: bool
    kda_columns: dict
    experts: str
    tail_free: bool = True
    settings: dict | None = None  # kernel launch settings by name (`--variants`: `_KERNEL_SETTINGS`), or the shipped


def _use(path: PrefillPath) -> ModelRunner:
    """Put a path into its runner, its KDA state pass into `prefill_kda_state` and its experts' kernels into
    `prefill_moe`; returns the runner."""
    from lingls.kernels import prefill_kda_state, prefill_moe

    runner = path.runner
    runner.prefill_step, runner.prefill_chunk, runner.prefill_graphs = path.step, path.chunk, path.graphs
    runner.tail_free = path.tail_free and path.graphs
    runner.cache.every = path.chunk
    prefill_kda_state.COLUMNS = path.kda_columns
    prefill_moe.FORM = path.experts
    for name, value in {**_KERNEL_SETTINGS, **(path.settings or {})}.items():
        module, _, attr = name.rpartition(".")
        setattr(_KERNEL_MODULES[module or "prefill_moe"], attr, tuple(value) if isinstance(value, list) else value)
    return runner


def _kernel_settings() -> tuple[dict, dict]:
    """The prefill kernels' modules by name, and their launch settings a `--variants` path may change, as shipped
    (a plain name is prefill_moe's; "prefill_kda.BLOCK" another module's)."""
    from lingls.kernels import prefill_kda, prefill_moe

    modules = {"prefill_moe": prefill_moe, "prefill_kda": prefill_kda}
    names = [*(f"prefill_moe.{n}" for n in ("BLOCK_M", "GATE_UP_CONFIG", "DOWN_CONFIG", "GATE_UP_WHOLE",
                                             "DOWN_WHOLE", "DOWN_FORM", "COMBINE_BLOCK",
                                             "ROUTE_WARPS")),
             "prefill_kda.BLOCK", "prefill_kda.NORM_BLOCK"]
    return modules, {n: getattr(modules[n.split(".")[0]], n.split(".")[1]) for n in names}


_KERNEL_MODULES, _KERNEL_SETTINGS = _kernel_settings()  # what a path without settings of its own runs with


def _torch_ops(step):
    """`step` with the prefill kernels off (LINGLS_KERNELS=0 while it runs: the torch ops of
    `KimiDeltaAttention.forward`, `Router`, `Experts._grouped`): their reference in the same run."""
    import os

    def run(ids, state, positions, kv_len):
        before = os.environ.get("LINGLS_KERNELS")
        os.environ["LINGLS_KERNELS"] = "0"
        try:
            return step(ids, state, positions, kv_len)
        finally:
            if before is None:
                del os.environ["LINGLS_KERNELS"]
            else:
                os.environ["LINGLS_KERNELS"] = before
    return run


def _two_tail_pieces(runner: ModelRunner):
    """The runner's own prefill step, swapped in as another: a swapped-in step sees every piece, so a prompt's
    tail runs as the path before the staged tail did (a piece up to the end-1 snapshot, then one token)."""
    step = runner._prefill_step

    def run(ids, state, positions, kv_len):
        return step(ids, state, positions, kv_len)
    return run


def _timed_cold(runner: ModelRunner, prompt: list[int], reps: int) -> tuple[float, float]:
    """Median TTFT of `reps` cold prefills of `prompt` (the prefix cache forgotten before each), and the median
    time the host took to issue a cold prefill's work (`prefill` returning, before the GPU is waited for): near
    the TTFT, the prefill is bound by the host's launches rather than by the GPU."""
    times, issued = [], []
    for _ in range(reps):
        runner.cache.reset()
        times.append(ttft_ms(runner, prompt)[0])
        runner.cache.reset()
        _sync(runner)
        t0 = time.perf_counter()
        runner.prefill(prompt, Sampling())
        issued.append((time.perf_counter() - t0) * 1e3)
        _sync(runner)
    return statistics.median(times), statistics.median(issued)


def _first_piece_graph_ms(runner: ModelRunner, prompt: list[int], reps: int = 3) -> float | None:
    """Device time of the graph a cold `prompt`'s first piece replays (the whole prompt with its tail snapshots
    where the runner is `tail_free`, else its tokens before the tail snapshot at end-8), by CUDA events around
    replays alone; None where that piece has no graph."""
    n = len(prompt) - (0 if runner.tail_free else 8)
    graph = runner.piece_graphs.graphs.get((runner.prefill_bucket(n), runner.tail_free))
    if graph is None:
        return None
    ms = median_ms(graph.replay, reps, warm=0)
    runner.cache.reset()  # the replays moved the live state
    return ms


def _prefill_result(runner: ModelRunner, prompt: list[int]) -> dict:
    """What a cold prefill of `prompt` leaves: the last token's hidden state and logits (this rank's shard), the
    KDA and conv states, the prompt's MLA latent rows, the tail snapshots' KDA and conv states (end-8, end-1),
    and the first greedy token. The hidden state is the head's input, caught at the model's head (a hook on
    the prefill step would take the runner's staged tail away: a swapped-in step sees every piece)."""
    model, kept = runner.model, []
    head = model.head

    def keep(h):
        kept.append(h.clone())
        return head(h)

    model.head = keep
    runner.cache.reset()
    try:
        runner.prefill(prompt, Sampling())
    finally:
        del model.head
    s, h, n = runner.state, kept[-1], len(prompt)
    with torch.inference_mode():
        logits = runner.model.head(h).float()
    snaps = {}
    for name, p in (("end8", n - 8), ("end1", n - 1)):
        slot = runner.cache._slots[p]
        snaps[f"{name}_kda"], snaps[f"{name}_conv"] = runner.cache._kda[slot].clone(), runner.cache._conv[slot].float()
    return {"hidden": h.float(), "logits": logits, "kda": s.kda.clone(), "conv": s.conv.float(),
            "latent": s.latent[:, :n].float().clone(), **snaps, "token": runner.chosen()}


def _compare(new: dict, old: dict) -> dict:
    """Relative L2 differences of two `_prefill_result`s, which of their tensors hold the same bits, and
    whether their first greedy tokens agree."""
    keys = ("hidden", "logits", "kda", "conv", "latent", "end8_kda", "end8_conv", "end1_kda", "end1_conv")
    out = {f"{k}_rel_err": float((new[k] - old[k]).norm() / old[k].norm()) for k in keys}
    out["bitwise_equal"] = [k for k in keys if torch.equal(new[k], old[k])]
    out["logits_max_abs_diff"] = float((new["logits"] - old["logits"]).abs().max())
    out["first_token_equal"] = new["token"] == old["token"]
    return out


def _padded_graph_exact(runner: ModelRunner, prompt: list[int]) -> dict | None:
    """The padded first piece's graph replay against the same padded step run eagerly (same shapes and kernels:
    the graph must reproduce it bit for bit), on the tokens of `prompt` a cold prefill's first piece takes (with
    the tail snapshots where the runner is `tail_free`, else the first len(prompt) - 8)."""
    n = len(prompt) if runner.tail_free else len(prompt) - 8
    ends = (n - 8, n - 1) if runner.tail_free else ()
    bucket = runner.prefill_bucket(n)
    if bucket is None or not runner.use_graphs:
        return None
    ids = torch.tensor(prompt[:n], device=runner.device)
    results = []
    with torch.inference_mode():
        for graphs in (True, False):
            runner.cache.reset()
            runner.use_graphs = graphs
            try:
                h = runner._padded_piece(ids, n, bucket, ends).float().clone()
            finally:
                runner.use_graphs = True
            snaps = runner._tail_snapshots() if ends else None
            results.append((h, runner.state.kda.clone(), runner.state.conv.clone(), runner.state.latent[:, :n].clone(),
                            *((snaps.kda.clone(), snaps.conv.clone()) if ends else ())))
    runner.cache.reset()
    (gh, *graphed), (eh, *eager) = results
    return {"tokens": n, "bucket": bucket, "tail_snapshots": list(ends),
            "hidden_bitwise_equal": bool(torch.equal(gh, eh)),
            "states_bitwise_equal": all(torch.equal(g, e) for g, e in zip(graphed, eager)),
            "hidden_max_abs_diff": float((gh - eh).abs().max())}


def plot(result: dict, path: Path) -> None:
    """Cold TTFT of each path against the prompt length, with the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["cold"]
    sizes = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name in result["paths"]:
        ax.plot(sizes, [r[f"{name}_ms"] for r in rows], "o-", label=name)
    ax.plot(sizes, [r["floor_ms"] for r in rows], "k--", label="floor (max of FLOP and byte floors)")
    for target, t in ((40, 1536), (150, 8192)):
        if t in sizes:
            ax.plot([t], [target], "r*", markersize=12)
    ax.plot([], [], "r*", label="issue 39 targets")
    ax.set_xlabel("prompt tokens (cold)")
    ax.set_ylabel("time to first token, ms")
    ax.set_title(f"cold prefill, {result['layers']} layers, TP={result['tp']} rank shard, {result['gpu']}")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def flash_prefill(a) -> int:
    """Cold prefill at Ling-3.0-flash shapes (random weights, one rank's shard) for each prompt size, by the
    runtime's path, its eager form and (with the baseline) the one before issue 39, beside the floor; the paths'
    results compared; then prefix reuse after the runtime's path."""
    from lingls.bench import floor as fl
    from lingls.kernels import prefill_kda_state, prefill_moe

    sizes = [a.tokens] if a.tokens else [int(x) for x in a.sizes.split(",")]
    prefill_moe.FORM = a.experts_form or prefill_moe.FORM  # before the warm-up captures the runtime's graphs
    model = build_flash(a.layers, tp=a.tp)
    vocab = model.config.vocab_size
    runner = ModelRunner(model, capacity=max(sizes) + 64, prefill_chunk=a.chunk)
    a.chunk = runner.prefill_chunk
    kda_table, tuning = prefill_kda_state.COLUMNS, None
    if a.tune:  # before the warm-up: its graphs are captured with the chosen state pass
        first = [t if runner.tail_free else t - 8 for t in sizes]  # a cold prompt's first piece
        kda_table, tuning = tune_kda_state_pass(model, sorted({runner.prefill_bucket(t) or t for t in first}))
        prefill_kda_state.COLUMNS = kda_table
    t0 = time.perf_counter()
    runner.warmup(greedy_only=True)  # its prefill fits the capacity it was given (the old warm-up here did not)
    warmup_s = time.perf_counter() - t0
    print(f"warm-up (graphs captured, kernels compiled and tuned) {warmup_s:.1f} s", flush=True)
    peak, bw = fl.matmul_peak_tflops(), fl.copy_bandwidth()
    g = torch.Generator().manual_seed(0)
    prompts = {t: torch.randint(0, vocab, (t,), generator=g).tolist() for t in sizes}
    form = prefill_moe.FORM
    paths = {"runtime": PrefillPath(runner, runner.prefill_step, a.chunk, runner.prefill_graphs, kda_table, form)}
    if a.previous:  # the path before, on a runner of its own (a graph bakes in its kernels): the experts' forms before
        previous = ModelRunner(model, capacity=runner.capacity, prefill_chunk=a.chunk)
        previous.fused = runner.fused  # (the same fused step: one copy of its weight layouts)
        paths["previous"] = PrefillPath(previous, previous.prefill_step, a.chunk, previous.prefill_graphs,
                                        kda_table, prefill_moe.PREVIOUS["FORM"], True,
                                        {"prefill_moe.DOWN_FORM": prefill_moe.PREVIOUS["DOWN_FORM"]})
    for name, settings in json.loads(a.variants or "{}").items():  # other kernel settings, in place
        other = ModelRunner(model, capacity=runner.capacity, prefill_chunk=a.chunk)
        other.fused = runner.fused
        experts = settings.pop("FORM", form)
        settings = {(n if "." in n else f"prefill_moe.{n}"): v for n, v in settings.items()}
        unknown = set(settings) - set(_KERNEL_SETTINGS)
        if unknown:
            raise SystemExit(f"--variants: unknown settings {sorted(unknown)} (known: {sorted(_KERNEL_SETTINGS)})")
        paths[f"variant_{name}"] = PrefillPath(other, other.prefill_step, a.chunk, other.prefill_graphs, kda_table,
                                               experts, True, settings)
    if runner.fused is not None and "two_tail_pieces" not in a.skip:  # the runner's step swapped in: its tail
        paths["two_tail_pieces"] = PrefillPath(runner, _two_tail_pieces(runner), a.chunk, runner.prefill_graphs,
                                         kda_table, form)  # as two pieces, each a weight stream
    if runner.prefill_graphs and "eager" not in a.skip:
        paths["eager"] = PrefillPath(runner, runner.prefill_step, a.chunk, False, kda_table, form)
    for chunk in [int(c) for c in a.more_chunks.split(",") if c]:  # the runtime's path in other chunk sizes
        paths[f"eager_chunk{chunk}"] = PrefillPath(runner, runner.prefill_step, chunk, False, kda_table, form)
    if "eager_torch_ops" not in a.skip:
        paths["eager_torch_ops"] = PrefillPath(runner, _torch_ops(runner.prefill_step), a.chunk, False, kda_table,
                                               form)
    if not a.no_baseline:
        paths["before_issue_39"] = PrefillPath(runner, legacy_prefill_step(model), 2048, False, kda_table, form)
    rows = []
    for t in sizes:
        ids = torch.tensor(prompts[t], device="cuda")
        positions = torch.arange(t, device="cuda")
        experts = fl.routed_experts(model, lambda: model.step(ids, model.new_state(t + 1), positions, kv_len=t,
                                                              prefill=True))
        floor = fl.prefill_floor_ms(fl.prefill_flops(model, t), fl.prefill_bytes(model, t, experts), peak, bw)
        row = {"tokens": t, "tflop": fl.prefill_flops(model, t) / 1e12,
               "distinct_experts_mean": sum(experts) / len(experts), **floor}
        for name, path in paths.items():
            r = _use(path)
            r.cache.reset()
            ttft_ms(r, prompts[t])  # first use of this size: allocations, kernels' first launches, a graph's capture
            ms, issued = _timed_cold(r, prompts[t], a.reps)
            row[f"{name}_ms"], row[f"{name}_x_floor"], row[f"{name}_issue_ms"] = ms, ms / floor["floor_ms"], issued
        for name in ("runtime", "previous"):
            if name in paths:
                row[f"{name}_first_piece_graph_ms"] = _first_piece_graph_ms(_use(paths[name]), prompts[t])
        print(f"{t:6d} tokens: " + ", ".join(f"{n} {row[n + '_ms']:.1f} ms (x{row[n + '_x_floor']:.1f}, "
                                                f"issued in {row[n + '_issue_ms']:.1f})" for n in paths)
              + f"; floor {floor['floor_ms']:.1f} ms (FLOPs {floor['flop_ms']:.1f}, bytes {floor['byte_ms']:.1f}; "
                f"{row['tflop']:.1f} TFLOP, {row['distinct_experts_mean']:.0f} experts/layer)"
              + (f"; first piece's graph alone {row['runtime_first_piece_graph_ms']:.1f} ms"
                 if row["runtime_first_piece_graph_ms"] else ""), flush=True)
        rows.append(row)
    checks = {}
    for t in sizes:  # every path against the eager one on the same prompt (same weights, same tokens)
        ref_name = "eager" if "eager" in paths else "runtime"
        ref = _prefill_result(_use(paths[ref_name]), prompts[t])
        checks[t] = {}
        for name in paths:
            if name != ref_name:
                checks[t][f"{name}_vs_{ref_name}"] = _compare(_prefill_result(_use(paths[name]), prompts[t]), ref)
        checks[t]["padded_graph_vs_padded_eager"] = _padded_graph_exact(_use(paths["runtime"]), prompts[t])
        print(f"{t:6d} tokens, results against {ref_name}: {json.dumps(checks[t])}", flush=True)
    # prefix reuse after the runtime's cold prefill of the largest prompt: the last token edited, then one appended
    prompt = prompts[max(sizes)]
    _use(paths["runtime"])
    runner.cache.reset()
    ttft_ms(runner, prompt)
    edits, reused = [], []
    for i in range(a.edits):
        edited = prompt[:-1] + [(prompt[-1] + 1 + i) % vocab]  # the last token changes, as a keystroke does
        ms, saved = ttft_ms(runner, edited)
        edits.append(ms)
        reused.append(saved)
    append, _ = ttft_ms(runner, edited + [17])
    ops = {}
    if a.profile:  # the runtime's path at each profiled size, the eager one (thousands of ops) at the first
        sizes_profiled = [int(x) for x in a.profile_tokens.split(",") if int(x) in prompts]
        for t in sizes_profiled:
            for name in a.profile_paths.split(","):
                if name in paths:
                    print(f"{name}: the {a.profile} largest ops and kernels of a cold {t}-token prefill")
                    ops[f"{name}_{t}"] = cold_prefill_profile(_use(paths[name]), prompts[t], a.profile)
        _use(paths["runtime"])
    result = {"bench": "prefix", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "fla": fla_version(),
              "layers": a.layers, "tp": a.tp, "prefill_chunk": a.chunk, "reps": a.reps, "paths": list(paths),
              "warmup_s": warmup_s, "matmul_peak_tflops": peak, "copy_TBps": bw / 1e12, "cold": rows,
              "checks": {str(t): c for t, c in checks.items()},
              "edit_prompt_tokens": len(prompt), "edit_ttft_ms": edits,
              "edit_ttft_median_ms": statistics.median(edits), "edit_tokens_reused": reused,
              "append_one_token_ttft_ms": append, "targets_ms": {"1536": 40, "8192": 150},
              "kda_state_columns": {str(n): list(c) for n, c in kda_table.items()},
              "experts_form": {name: {"gate_up": path.experts, "down": (path.settings or {}).get(
                  "prefill_moe.DOWN_FORM", _KERNEL_SETTINGS["prefill_moe.DOWN_FORM"])} for name, path in paths.items()},
              **({"kda_state_tuning": tuning} if tuning else {}),
              "serve_ttft": "bench/serve_ttft.py (serve_ttft.json)",
              "time": time.strftime("%Y-%m-%d %H:%M:%S"), **({"cold_prefill_ops": ops} if ops else {})}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if a.plot:
        plot(result, out.with_suffix(".png"))
    print(f"peak bf16 matmul {peak:.0f} TFLOP/s, copy {bw / 1e12:.2f} TB/s; one-token edit at the end of "
          f"{len(prompt)} tokens: TTFT median {result['edit_ttft_median_ms']:.2f} ms (reused {reused[-1]} tokens); "
          f"appending a token: {append:.2f} ms", flush=True)
    print("\n| tokens | " + " | ".join(f"{n} ms" for n in paths) + " | floor ms (FLOPs, bytes) | runtime / floor |")
    print("|---" * (len(paths) + 3) + "|")
    for r in rows:
        print(f"| {r['tokens']:,} | " + " | ".join(f"{r[n + '_ms']:.1f}" for n in paths)
              + f" | {r['floor_ms']:.1f} ({r['flop_ms']:.1f}, {r['byte_ms']:.1f}) | {r['runtime_x_floor']:.1f} |")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lingls bench prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None,
                   help="one prompt length (default: --sizes; with --model 1536)")
    p.add_argument("--sizes", default="512,1536,4096,8192", help="cold prompt lengths timed (flash shapes)")
    p.add_argument("--reps", type=int, default=3, help="cold prefills timed per size and path (the median)")
    p.add_argument("--no-baseline", action="store_true", help="time only the runtime's path")
    p.add_argument("--more-chunks", default="", help="also time the eager path in these chunk sizes (a,b,...)")
    p.add_argument("--plot", action="store_true", help="also write a PNG beside the JSON")
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
    p.add_argument("--chunk", type=int, default=None,
                   help="prefill chunk and snapshot spacing (default: the runner's, 8192 on a GPU)")
    p.add_argument("--edits", type=int, default=5)
    p.add_argument("--out", default="bench/results/prefix.json")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile one more cold prefill by each path: its N largest ops by device time")
    p.add_argument("--profile-tokens", default="1536", help="the profiled prompts' lengths (of --sizes; a,b,...)")
    p.add_argument("--profile-paths", default="runtime", help="the paths profiled (a,b,...)")
    p.add_argument("--tune", action="store_true",
                   help="first time the KDA state pass (fla's, and the narrow pass at several value columns) at each "
                        "size's bucket (prefill_kda_state) and run with the fastest that agrees with the torch form")
    p.add_argument("--experts-form", choices=_KERNEL_MODULES["prefill_moe"].GATE_UP_FORMS,
                   help="the routed experts' gate/up form of the runtime path (default: prefill_moe.FORM; the "
                        "down kernel's: prefill_moe.DOWN_FORM)")
    p.add_argument("--previous", action="store_true",
                   help="also time the path before (the routed experts' kernels in prefill_moe.PREVIOUS's forms), "
                        "graphed on a runner of its own (path previous)")
    p.add_argument("--variants", default="", metavar="JSON",
                   help='also time the prefill kernels with other launch settings in place, each on a runner of its '
                        'own: {"NAME": {"GATE_UP_CONFIG": [64, 128, 4, 3], "prefill_kda.BLOCK": [32, 4], ...}, ...} '
                        "(a plain name is prefill_moe's; FORM too)")
    p.add_argument("--skip", default="", help="paths left out (of two_tail_pieces, eager, eager_torch_ops; a,b,...)")
    a = p.parse_args(argv)
    if a.model:
        import argparse as _argparse
        a.tokens = a.tokens or 1536
        a.file = a.file or _argparse.__file__
        if a.out == "bench/results/prefix.json":
            a.out = "bench/results/nano_latency.json"  # the file docs/performance.md cites
        return model_latency(a)
    if not torch.cuda.is_available():
        print("lingls bench prefix: needs a CUDA GPU", file=sys.stderr)
        return 2
    return flash_prefill(a)
