"""ling-nano training throughput on the GPU, by batch size and variant of the chunked KDA's state carry.

The training step of `training.train` (forward, next-token + MTP loss, backward, AdamW) on random tokens,
batch x 2048, timed over a few steps after warm-up, with the parallel-scan carry (the CUDA default; the chunk
loop measured 67k tokens/s against 208k for it at batch 32 on an H200) and TF32 for the fp32 matmuls left under
autocast. Writes JSON; prints
tokens/s, model FLOPs utilisation (training.train.model_flops_per_token against the GPU's dense bf16 peak) and
peak memory, and last the batch size with the most tokens/s.

    python -m bench.train_throughput OUT.json [BATCH ...]
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch

from bench.common import write_result
from lingls.kernels import reference as ref
from lingls.model import LingConfig, LingForCausalLM
from training.train import PEAK_BF16_FLOPS, losses, model_flops_per_token

CONFIG = Path(__file__).resolve().parents[1] / "training" / "configs" / "ling-nano.json"


def measure(batch: int, scan: bool, tf32: bool, steps: int = 3, warmup: int = 2) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    chunked = ref.kda_chunked
    ref.kda_chunked = functools.partial(chunked, scan=scan)
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
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        step_s = sorted(times)[len(times) // 2]
        tps = batch * 2048 / step_s
        peak = PEAK_BF16_FLOPS.get(torch.cuda.get_device_name(), 0.0)
        return dict(batch=batch, scan=scan, tf32=tf32, step_ms=step_s * 1e3, tokens_per_s=tps,
                    mfu=model_flops_per_token(model, 2048) * tps / peak if peak else None,
                    peak_gb=torch.cuda.max_memory_allocated() / 1e9, loss=float(main))
    finally:
        ref.kda_chunked = chunked
        torch.backends.cuda.matmul.allow_tf32 = False


def main(out: str, batches: list[int]) -> int:
    rows = []
    for batch, scan in [(b, True) for b in batches]:
        try:
            rows.append(measure(batch, scan, True))
        except Exception as e:  # noqa: BLE001 - a failed variant (out of memory) is reported, the others still run
            rows.append(dict(batch=batch, scan=scan, tf32=True, error=repr(e)[:300]))
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)
    write_result(out, dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows))
    # a larger batch means fewer optimizer steps in the same time: worth it only when clearly faster
    ok = [r for r in rows if "tokens_per_s" in r]
    best = ok[0] if ok else {"batch": batches[0], "tokens_per_s": 0}
    for r in ok[1:]:
        if r["tokens_per_s"] >= 1.15 * best["tokens_per_s"]:
            best = r
    print(best["batch"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "train_throughput.json",
                  [int(b) for b in sys.argv[2:]] or [32]))
