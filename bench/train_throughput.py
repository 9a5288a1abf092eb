"""ling-nano training throughput on the GPU, by KDA kernel and batch size, and the choice training runs with.

The training step of `training.train` (forward, next-token + MTP loss, backward, AdamW) on random tokens,
batch x 2048, timed over a few steps after warm-up, with TF32 for the fp32 matmuls left under autocast, for:
- `scan`: lingls' torch chunked KDA with the parallel-scan state carry (`lingls.kernels.reference`; the chunk
  loop before it measured 67k tokens/s against 208k for the scan at batch 32 on an H200);
- `fla`: fla-core's Triton chunk_kda (forward and backward), when it imports and first matches the torch form
  on fresh random inputs (`training.fla_kernels.check_against_torch`), its autotuning bounded
  (`training.fla_kernels.bound_autotuning`; the first fla row's time includes compiling, reported apart).
Writes JSON (rows, the fla check, the choice); prints tokens/s, model FLOPs utilisation
(training.train.model_flops_per_token against the GPU's dense bf16 peak) and peak memory, and last the batch size
and kernel with the most tokens/s ("32 fla").

    python -m bench.train_throughput OUT.json [BATCH ...]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from bench.common import write_result
from lingls.model import LingConfig, LingForCausalLM
from training import fla_kernels
from training.train import PEAK_BF16_FLOPS, losses, model_flops_per_token

CONFIG = Path(__file__).resolve().parents[1] / "training" / "configs" / "ling-nano.json"


def measure(batch: int, kda: str, steps: int = 3, warmup: int = 2) -> dict:
    """One training-step variant: kda "scan" (torch) or "fla"."""
    torch.backends.cuda.matmul.allow_tf32 = True
    fla_kernels.enable(kda == "fla")
    try:
        cfg = LingConfig.from_json(CONFIG)
        model = LingForCausalLM(cfg).cuda()
        model.init_weights(0.02)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
        x = torch.randint(5, cfg.vocab_size, (batch, 2049), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                main, mtp = losses(model, x)
                loss = main + 0.3 * mtp
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        step_s = sorted(times[warmup:])[steps // 2]
        tps = batch * 2048 / step_s
        peak = PEAK_BF16_FLOPS.get(torch.cuda.get_device_name(), 0.0)
        return dict(batch=batch, kda=kda, tf32=True, step_ms=step_s * 1e3, tokens_per_s=tps,
                    mfu=model_flops_per_token(model, 2048) * tps / peak if peak else None,
                    first_step_s=times[0], peak_gb=torch.cuda.max_memory_allocated() / 1e9, loss=float(main))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def main(out: str, batches: list[int]) -> int:
    rows, check = [], None
    variants = [(batches[0], "scan")]
    t0 = time.perf_counter()
    if fla_kernels.enable(True):
        try:
            check = fla_kernels.check_against_torch()
        except Exception as e:  # noqa: BLE001 - fla failing to build or run here leaves the torch form
            check = {"ok": False, "error": repr(e)[:300]}
        check["seconds_with_first_compile"] = round(time.perf_counter() - t0, 1)
        print({"fla_check": check}, flush=True)
        if check["ok"]:
            variants += [(b, "fla") for b in batches]
    for batch, kda in variants:
        try:
            rows.append(measure(batch, kda))
        except Exception as e:  # noqa: BLE001 - a failed variant (out of memory) is reported, the others still run
            rows.append(dict(batch=batch, kda=kda, error=repr(e)[:300]))
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)
    # a larger batch means fewer optimizer steps in the same time: worth it only when clearly faster
    ok = [r for r in rows if "tokens_per_s" in r]
    best = ok[0] if ok else {"batch": batches[0], "kda": "scan", "tokens_per_s": 0}
    for r in ok[1:]:
        bigger = r["batch"] > best["batch"]
        if r["tokens_per_s"] >= (1.15 if bigger else 1.0) * best["tokens_per_s"]:
            best = r
    choice = {"batch": best["batch"], "kda": best["kda"]}
    write_result(out, dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows,
                           fla_check=check, choice=choice))
    print(best["batch"], best["kda"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "train_throughput.json",
                  [int(b) for b in sys.argv[2:]] or [32]))
