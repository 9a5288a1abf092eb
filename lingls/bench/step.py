"""`lingls bench step`: the batch-1 step time of Ling-3.0-flash shapes (random weights) against its byte floor.

Modes:
- `shard`: one TP=4 rank's shard (all 42 layers, a quarter of the heads / expert and dense widths / vocab) on
  one GPU with the all-reduce stubbed out: the per-rank step time of a 4-GPU deployment.
- `full`: the whole model (TP=1) at a reduced depth, for GPUs that cannot hold more.
- `tp`: the whole model at TP=N on N GPUs (--tp, default 2; all 42 layers), NCCL against the peer all-reduce,
  plus the all-reduces alone: runs `python -m bench.tp_gpu` in a checkout of the repository (one process per GPU;
  see that module).
For T = 1 (decode) and T = 2..16 (verify) it reports the median CUDA-graph step time and the step's byte
floor (`lingls.bench.floor.step_bytes`: every weight but the routed experts, the distinct routed experts of
that step as the fused step routes them, the embedding rows, the KDA state read and written, the MLA latent KV
of the context) over the device-to-device copy bandwidth measured in the same run. With --peer-layers L it also
runs, side by side, transformers' BailingHybridForCausalLM (greedy generate with its cache) and lingls with and
without CUDA graphs, all at L layers of full width. Writes JSON (+ a PNG with --plot) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from lingls.bench.floor import copy_bandwidth, median_ms, routed_experts, step_bytes
from lingls.model.config import flash_config
from lingls.model.ling import LingForCausalLM, Parallel
from lingls.model.loader import random_model
from lingls.runtime.runner import ModelRunner, Sampling


def fla_version() -> str | None:
    """fla-core's version when installed (long prefills then run its chunk_kda), else None."""
    try:
        import fla
    except ImportError:
        return None
    return getattr(fla, "__version__", "present")


def build_flash(layers: int, tp: int = 1, rank: int = 0, device: str = "cuda", seed: int = 0) -> LingForCausalLM:
    """Random bf16 weights built directly on the device (no 250 GB checkpoint on disk), without the MTP layer."""
    cfg = flash_config(layers)
    cfg.num_nextn_predict_layers = 0
    return random_model(cfg, Parallel(rank, tp), device, torch.bfloat16, seed)


def distinct_experts(model: LingForCausalLM, runner: ModelRunner, t: int) -> list[int]:
    """Distinct routed experts per MoE layer in one eager T-token step on random token ids, as the step routes
    them (the fused step's routing included: `floor.routed_experts`)."""
    def run():
        runner.ids[:t].copy_(torch.randint(0, model.config.vocab_size, (t,), device=runner.device))
        runner._body(t, runner.bucket(int(runner.pos[0]) + t), True)

    return routed_experts(model, run, fused=runner.fused)


def bench_steps(model, tokens: list[int], context: int, bw: float, reps: int) -> list[dict]:
    runner = ModelRunner(model, capacity=context + 128, verify_sizes=tuple(t for t in tokens if t > 1))
    rows = []
    for t in tokens:
        runner.pos.fill_(context - 64)
        experts = distinct_experts(model, runner, t)
        kv = runner.bucket(context)
        runner.pos.fill_(context - 64)
        runner.run_step(t, kv, True)  # capture
        runner.pos.fill_(context - 64)
        ms = median_ms(lambda: runner.run_step(t, kv, True), reps=reps)
        parts = step_bytes(model, t, context, experts)
        total = sum(parts.values())
        floor = total / bw * 1e3
        rows.append({"T": t, "graph_ms": ms, "floor_ms": floor, "ratio": ms / floor, "bytes": total, "parts": parts,
                     "distinct_experts_mean": statistics.mean(experts) if experts else 0})
        print(f"T={t:2d}  step {ms:7.3f} ms  floor {floor:6.3f} ms  x{ms / floor:5.2f}  "
              f"experts/layer {rows[-1]['distinct_experts_mean']:.1f}", flush=True)
    runner.use_graphs = False
    runner.pos.fill_(context - 64)
    rows[0]["eager_ms"] = median_ms(lambda: runner.run_step(1, runner.bucket(context), True), reps=10, warm=2)
    rows[0]["decode_loop_tpot_ms"] = decode_loop_tpot(ModelRunner(model, capacity=context + 128), 128)
    return rows


def decode_loop_tpot(runner: ModelRunner, n: int, prompt_len: int = 32, graphs: bool = True) -> float:
    """Wall-clock ms per token of the real host loop (graph replays, one-step-late reads), after warm-up."""
    runner.use_graphs = graphs
    prompt = torch.randint(0, runner.model.config.vocab_size, (prompt_len,)).tolist()
    list(runner.generate(prompt, 8, Sampling()))
    runner.prefill(prompt, Sampling())
    steps = runner.decode(n + 1, True)
    next(steps)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in steps:
        pass
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def peers(layers: int, prompt_len: int = 512, new: int = 64) -> dict:
    """lingls (graphs, eager) and transformers' BailingHybridForCausalLM at `layers` layers of full width."""
    out = {"layers": layers, "prompt_tokens": prompt_len, "new_tokens": new}
    model = build_flash(layers)
    runner = ModelRunner(model, capacity=prompt_len + new + 64)
    runner.warmup(greedy_only=True)
    out["lingls_graph_tpot_ms"] = decode_loop_tpot(runner, new, prompt_len, graphs=True)
    out["lingls_eager_tpot_ms"] = decode_loop_tpot(runner, new, prompt_len, graphs=False)
    print(f"lingls {layers} layers: graphs {out['lingls_graph_tpot_ms']:.3f} ms/token, "
          f"eager {out['lingls_eager_tpot_ms']:.3f} ms/token", flush=True)
    del model, runner
    torch.cuda.empty_cache()
    try:
        import transformers
        from transformers import BailingHybridConfig, BailingHybridForCausalLM
    except ImportError as e:
        out["transformers_error"] = repr(e)
        print("transformers peer skipped:", e, flush=True)
        return out
    out["transformers"] = transformers.__version__
    cfg = BailingHybridConfig(num_hidden_layers=layers, num_mtp_layers=0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = BailingHybridForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda")

    def gen(n, model=hf):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(2)
    t1 = min(gen(1) for _ in range(2))
    tn = min(gen(new + 1) for _ in range(2))
    out["transformers_tpot_ms"] = (tn - t1) / new * 1e3
    print(f"transformers {layers} layers: {out['transformers_tpot_ms']:.3f} ms/token", flush=True)
    del gen, hf  # gen holds the model too
    torch.cuda.empty_cache()
    return out


def profile_step(model: LingForCausalLM, context: int, top: int = 12) -> dict:
    """Kernels one eager T=1 step launches, and where its GPU time goes (the launch count is what graphs hide)."""
    from torch.profiler import ProfilerActivity, profile

    runner = ModelRunner(model, capacity=context + 128, use_graphs=False)
    runner.pos.fill_(context - 64)
    runner.run_step(1, runner.bucket(context), True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.run_step(1, runner.bucket(context), True)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    out = {"kernels_per_step": len(kernels), "kernel_time_ms": sum(e.device_time for e in kernels) / 1e3,
           "top": [{"name": n, "count": len(ts), "ms": sum(ts) / 1e3} for n, ts in ranked]}
    print(f"one eager T=1 step: {out['kernels_per_step']} kernels, {out['kernel_time_ms']:.2f} ms of kernel time")
    for k in out["top"]:
        print(f"  {k['ms']:7.3f} ms  x{k['count']:5d}  {k['name']}")
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["steps"]
    fig, axes = plt.subplots(1, 2 if "peers" in result else 1, figsize=(11, 4), squeeze=False)
    ax = axes[0][0]
    ts = [r["T"] for r in rows]
    ax.plot(ts, [r["graph_ms"] for r in rows], "o-", label="lingls step (CUDA graph)")
    ax.plot(ts, [r["floor_ms"] for r in rows], "s--", label="byte floor")
    ax.set_xlabel("tokens per step (T)")
    ax.set_ylabel("ms")
    ax.set_title(f"{result['mode']}: {result['layers']} layers, TP={result['tp']} rank shard, ctx {result['context']}")
    ax.legend()
    if "peers" in result:
        p = result["peers"]
        names = [("transformers", "transformers_tpot_ms"), ("lingls eager", "lingls_eager_tpot_ms"),
                 ("lingls graphs", "lingls_graph_tpot_ms")]
        names = [(n, p[k]) for n, k in names if k in p]
        ax2 = axes[0][1]
        ax2.bar([n for n, _ in names], [v for _, v in names])
        ax2.set_ylabel("ms per token (decode)")
        ax2.set_title(f"{p['layers']} layers, full width, batch 1")
        for i, (_, v) in enumerate(names):
            ax2.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def tp_mode(a) -> int:
    """`--mode tp`: `python -m bench.tp_gpu` does the work, run in the current directory, which must be a checkout
    of the repository (bench/ is not installed with lingls)."""
    import subprocess

    if not (Path("bench") / "tp_gpu.py").is_file():
        print("lingls bench step --mode tp: run it from a checkout of the repository (./bench/tp_gpu.py is missing)",
              file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "bench.tp_gpu", "--tp", str(a.tp or 2), "--tokens", a.tokens,
           "--layers", str(a.layers or 42),
           "--out", str(Path(a.out).parent)]
    return subprocess.call(cmd, env={**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                     "NVSHMEM_DISABLE_NVLS": "1"})


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lingls bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["shard", "full", "peers", "tp"], default="shard",
                   help="peers: only the side-by-side run at --peer-layers (a fresh process has the whole GPU); "
                        "tp: the whole model at TP=N (--tp, default 2) on N GPUs, NCCL vs the peer all-reduce "
                        "(python -m bench.tp_gpu)")
    p.add_argument("--layers", type=int, help="decoder layers (default: 42 for shard, 6 for full)")
    p.add_argument("--tp", type=int, default=None,
                   help="shard mode: the tensor-parallel degree whose rank is run (default 4); "
                        "tp mode: the ranks (default 2)")
    p.add_argument("--tokens", default="1,2,4,8,16", help="step sizes T")
    p.add_argument("--context", type=int, default=8192, help="tokens of context (MLA KV) per step")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--peer-layers", type=int, default=0, help="also run transformers and eager lingls at this depth")
    p.add_argument("--out", default="bench/results/step.json")
    p.add_argument("--plot", action="store_true", help="also write a PNG beside the JSON")
    p.add_argument("--profile", action="store_true", help="also profile one eager T=1 step (kernel count, top kernels)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("lingls bench step: needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.mode == "tp":
        return tp_mode(a)
    tp = (a.tp or 4) if a.mode == "shard" else 1
    layers = a.layers or (42 if a.mode == "shard" else 6)
    tokens = [int(t) for t in a.tokens.split(",")]
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    result = {"bench": "step", "mode": a.mode, "tp": tp, "layers": layers, "context": a.context,
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
              "copy_TBps": bw / 1e12, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "fla": fla_version()}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.mode == "peers":
        result["peers"] = peers(a.peer_layers or 6)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["peers"]))
        return 0
    t0 = time.perf_counter()
    model = build_flash(layers, tp=tp, rank=0)
    result["weights_GB"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    print(f"built {result['weights_GB']:.1f} GB of weights in {time.perf_counter() - t0:.1f} s", flush=True)
    result["steps"] = bench_steps(model, tokens, a.context, bw, a.reps)
    if a.profile:
        result["profile_t1"] = profile_step(model, a.context)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if a.peer_layers:  # the shard's memory is not all returned in-process: prefer --mode peers in a fresh one
        del model
        torch.cuda.empty_cache()
        result["peers"] = peers(a.peer_layers)
        out.write_text(json.dumps(result, indent=1) + "\n")
    if a.plot:
        plot(result, out.with_suffix(".png"))
    print("\n| T | step ms (graph) | floor ms | ratio |\n|---|---|---|---|")
    for r in result["steps"]:
        print(f"| {r['T']} | {r['graph_ms']:.3f} | {r['floor_ms']:.3f} | {r['ratio']:.2f} |")
    s1 = result["steps"][0]
    print(f"T=1 eager (no graphs): {s1['eager_ms']:.2f} ms; real decode loop: {s1['decode_loop_tpot_ms']:.3f} ms/token")
    if "peers" in result:
        print(json.dumps(result["peers"]))
    return 0
