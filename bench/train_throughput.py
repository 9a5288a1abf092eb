"""ling-nano training throughput on the GPU: the old training step against the new, in one run, and the choice
training runs with.

The training step of `training.train` (forward, next-token + MTP loss, backward, AdamW) on random tokens,
batch x 2048, timed over a few steps after warm-up, with TF32 for the fp32 matmuls left under autocast, in forms:
- `eager` (the step before 2026-12-03's nineteenth session): every op eager, the heads' logits materialised and
  upcast to fp32 for `F.cross_entropy`;
- `fused_ce`: eager layers, both heads through `training.linear_ce` (row chunks, no logits kept);
- `compiled_eager_ce`: that, with every layer's attention, MLP and norms torch.compiled
  (`training.train.compile_for_training`; the first step's time includes compiling, reported as first_step_s);
- `compiled`: that, with the cross-entropy's chunks compiled too (`training.linear_ce.compile_chunks`), as
  `compile_for_training` leaves them;
- `compiled_route`: that, with the routers' choice by the routing kernel (`training.train.route_by_kernel`);
the first batch in every form, the others in the fastest compiled form at the first;
each with fla-core's Triton chunk_kda once it matches the torch form on fresh random inputs
(`training.fla_kernels.check_against_torch`, autotuning bounded), else lingls' torch scan (`kda` says which).
One step of the eager form and of the last two is also profiled (torch.profiler): the top CUDA kernels by time and the
share of the step the GPU was busy.
Writes JSON (rows, profiles, the fla check, the choice); prints tokens/s, model FLOPs utilisation
(training.train.model_flops_per_token against the GPU's dense bf16 peak) and peak memory, and last the choice
with the most tokens/s ("32 fla compiled").

    python -m bench.train_throughput OUT.json [BATCH ...]    # default one batch: 32
    python -m bench.train_throughput OUT.json 64 128 256 --config CONFIG.json --compiled-only

`--config` times another model config than ling-nano's (a candidate's size: its tokens/s and utilisation before
a run is spent on it); `--compiled-only` times only `compiled` and `compiled_route` (what a training call needs:
each compiled form compiles for ~40-55 s on its first step).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from bench.common import write_result
from lingls.model import LingConfig, LingForCausalLM
from training import fla_kernels, linear_ce
from training.train import PEAK_BF16_FLOPS, compile_for_training, losses, model_flops_per_token, route_by_kernel

CONFIG = Path(__file__).resolve().parents[1] / "training" / "configs" / "ling-nano.json"


FORMS = {"eager": dict(compiled=False, fused_ce=False), "fused_ce": dict(compiled=False, fused_ce=True),
         "compiled_eager_ce": dict(compiled=True, fused_ce=True, compiled_ce=False),
         "compiled": dict(compiled=True, fused_ce=True),
         "compiled_route": dict(compiled=True, fused_ce=True, kernel_route=True)}


def profile_step(step, steps: int = 2) -> dict:
    """Profile `steps` calls of step(): the top CUDA kernels by GPU time (ms per step) and the GPU-busy share."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    busy = sum(e.self_device_time_total for e in kernels) / 1e3 / steps  # ms per step
    return {"step_ms_profiled": round(wall * 1e3, 2), "gpu_busy_ms": round(busy, 2),
            "gpu_idle_share": round(max(0.0, 1 - busy / (wall * 1e3)), 3),
            "kernel_launches_per_step": sum(e.count for e in kernels) // steps,
            "top_kernels": [{"name": e.key[:90], "ms": round(e.self_device_time_total / 1e3 / steps, 3),
                             "calls": e.count // steps} for e in kernels[:15]]}


def measure(batch: int, kda: str, form: str, steps: int = 4, warmup: int = 2, profiled: bool = False,
            config: Path = CONFIG) -> dict:
    """One training-step variant: kda "scan" (torch) or "fla"; form one of FORMS."""
    torch.backends.cuda.matmul.allow_tf32 = True
    fla_kernels.enable(kda == "fla")
    compiled, fused_ce = FORMS[form]["compiled"], FORMS[form]["fused_ce"]
    try:
        cfg = LingConfig.from_json(config)
        model = LingForCausalLM(cfg).cuda()
        model.init_weights(0.02)
        if compiled:
            torch._dynamo.reset()  # each batch size compiles static shapes, as a training process would (its cache)
            compile_for_training(model)
        if not (compiled and FORMS[form].get("compiled_ce", True)):  # compile_for_training compiled them
            linear_ce.compile_chunks(False)
        route_by_kernel(model, FORMS[form].get("kernel_route", False))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
        x = torch.randint(5, cfg.vocab_size, (batch, 2049), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        last = {}

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                main, mtp = losses(model, x, fused_ce=fused_ce)
                loss = main + 0.3 * mtp
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            last["loss"] = main

        times = []
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        step_s = sorted(times[warmup:])[steps // 2]
        tps = batch * 2048 / step_s
        peak = PEAK_BF16_FLOPS.get(torch.cuda.get_device_name(), 0.0)
        row = dict(batch=batch, kda=kda, form=form, tf32=True, step_ms=step_s * 1e3, tokens_per_s=tps,
                   mfu=model_flops_per_token(model, 2048) * tps / peak if peak else None,
                   first_step_s=times[0], peak_gb=torch.cuda.max_memory_allocated() / 1e9,
                   loss=float(last["loss"]))
        if profiled:
            row["profile"] = profile_step(step)
        return row
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def _measured(batch: int, kda: str, form: str, profiled: bool, config: Path) -> dict:
    """`measure`'s row, printed (a failed variant, out of memory say, is a row with its error)."""
    try:
        row = measure(batch, kda, form, profiled=profiled, config=config)
    except Exception as e:  # noqa: BLE001 - the other variants still run
        row = dict(batch=batch, kda=kda, form=form, error=repr(e)[:300])
    torch.cuda.empty_cache()
    print({k: v for k, v in row.items() if k != "profile"}, flush=True)
    if "profile" in row:
        print({k: v for k, v in row["profile"].items() if k != "top_kernels"}, flush=True)
        for k in row["profile"]["top_kernels"]:
            print(f"  {k['ms']:8.3f} ms {k['calls']:5d}x  {k['name']}", flush=True)
    return row


def choose(rows: list[dict], batches: list[int], kda: str) -> tuple[dict, dict]:
    """(the best row, the choice training takes from it): the most tokens/s, a larger batch only when clearly
    faster (it means fewer optimizer steps in the same time)."""
    ok = [r for r in rows if "tokens_per_s" in r]
    best = ok[0] if ok else {"batch": batches[0], "kda": kda, "form": "eager", "tokens_per_s": 0}
    for r in ok[1:]:
        bigger = r["batch"] > best["batch"]
        if r["tokens_per_s"] >= (1.15 if bigger else 1.0) * best["tokens_per_s"]:
            best = r
    form = FORMS[best["form"]]
    return best, {"batch": best["batch"], "kda": best["kda"], "compile": form["compiled"],
                  "compile_ce": form.get("compiled_ce", True), "kernel_route": form.get("kernel_route", False)}


def main(out: str, batches: list[int], config: Path = CONFIG, compiled_only: bool = False) -> int:
    """The rows and the choice so far are written after every row (`final` false until the last): a training
    call whose time limit cuts the benchmark still trains with the best form measured."""
    rows, check = [], None
    t0 = time.perf_counter()
    kda = "scan"
    if fla_kernels.enable(True):
        try:
            check = fla_kernels.check_against_torch()
        except Exception as e:  # noqa: BLE001 - fla failing to build or run here leaves the torch form
            check = {"ok": False, "error": repr(e)[:300]}
        check["seconds_with_first_compile"] = round(time.perf_counter() - t0, 1)
        print({"fla_check": check}, flush=True)
        kda = "fla" if check["ok"] else "scan"
    with torch.device("meta"):
        params = sum(p.numel() for p in LingForCausalLM(LingConfig.from_json(config)).parameters())

    def write(final: bool) -> dict:
        best, choice = choose(rows, batches, kda)
        write_result(out, dict(device=torch.cuda.get_device_name(), torch=torch.__version__, config=str(config),
                               parameters=params, rows=rows, fla_check=check, choice=choice, final=final))
        return best

    # compiled only (a training call): the form it would train with, then the one change to try
    first = [("compiled", True), ("compiled_route", True)]
    if not compiled_only:
        first = [("eager", True), ("fused_ce", False), ("compiled_eager_ce", False), *first]
    for form, profiled in first:
        rows.append(_measured(batches[0], kda, form, profiled, config))
        write(False)
    compiled = [r for r in rows if "tokens_per_s" in r and FORMS[r["form"]]["compiled"]]
    form = max(compiled, key=lambda r: r["tokens_per_s"])["form"] if compiled else "compiled"
    for batch in batches[1:]:
        rows.append(_measured(batch, kda, form, False, config))
        write(False)
    best = write(True)
    print(best["batch"], best["kda"], best["form"])
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="ling-nano training throughput on the GPU")
    ap.add_argument("out", nargs="?", default="train_throughput.json")
    ap.add_argument("batches", nargs="*", type=int, default=[32])
    ap.add_argument("--config", type=Path, default=CONFIG, help="the model config timed (default ling-nano's)")
    ap.add_argument("--compiled-only", action="store_true", help="only the forms a training call chooses between")
    a = ap.parse_args()
    sys.exit(main(a.out, a.batches, a.config, a.compiled_only))
