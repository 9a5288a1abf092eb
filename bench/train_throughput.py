"""ling-nano training throughput on the GPU, by variant of the chunked KDA's state carry and matmul precision.

The training step of `training.train` (forward, next-token + MTP loss, backward, AdamW) on random tokens,
batch x 2048, timed over a few steps after warm-up. Variants: the parallel-scan carry (the CUDA default) or the
chunk loop, and fp32 matmuls at full precision or TF32. Writes JSON, prints tokens/s and peak memory.

    python -m bench.train_throughput OUT.json [BATCH]
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
from training.train import losses

CONFIG = Path(__file__).resolve().parents[1] / "training" / "configs" / "ling-nano.json"


def measure(batch: int, scan: bool, tf32: bool, steps: int = 6, warmup: int = 2) -> dict:
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
        return dict(batch=batch, scan=scan, tf32=tf32, step_ms=step_s * 1e3, tokens_per_s=batch * 2048 / step_s,
                    peak_gb=torch.cuda.max_memory_allocated() / 1e9, loss=float(main))
    finally:
        ref.kda_chunked = chunked
        torch.backends.cuda.matmul.allow_tf32 = False


def main(out: str, batch: int) -> int:
    rows = []
    for scan, tf32 in ((True, True), (True, False), (False, True)):
        try:
            rows.append(measure(batch, scan, tf32))
        except Exception as e:  # noqa: BLE001 - a failed variant is reported, the others still run
            rows.append(dict(batch=batch, scan=scan, tf32=tf32, error=repr(e)[:300]))
        torch.cuda.empty_cache()
    write_result(out, dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows))
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "train_throughput.json",
                  int(sys.argv[2]) if len(sys.argv) > 2 else 32))
