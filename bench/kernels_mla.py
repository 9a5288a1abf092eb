"""MLA decode kernel on the GPU: correctness against the reference, then median time against its byte floor.

Shapes: one TP=4 rank of Ling-3.0-flash (8 heads, 512-wide latent + 64 rope), T = 1 and 9 queries, contexts of
1k / 8k / 32k tokens. The floor counts the latent rows the step must read (context x 576 x 2 bytes) plus the
queries and the output, over the copy bandwidth measured in the same run.

    python -m bench.kernels_mla OUT.json
"""

from __future__ import annotations

import sys

import torch

from bench.common import write_result
from lingls.bench.step import copy_bandwidth, median_ms
from lingls.kernels.mla import mla_decode_reference, mla_decode_triton

HEADS, RANK, ROPE = 8, 512, 64


def main(out: str) -> int:
    torch.manual_seed(0)
    bw = copy_bandwidth()
    rows = []
    for ctx in (1024, 8192, 32768):
        cache = torch.randn(ctx + 64, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
        for t in (1, 9):
            q_lat = torch.randn(t, HEADS, RANK, device="cuda", dtype=torch.bfloat16)
            q_rope = torch.randn(t, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
            positions = torch.arange(ctx - t, ctx, device="cuda")
            scale = 192 ** -0.5
            want = mla_decode_reference(q_lat, q_rope, cache, positions, scale)
            got = mla_decode_triton(q_lat, q_rope, cache, positions, scale)
            rel = ((got - want).norm() / want.norm()).item()
            kernel_ms = median_ms(lambda: mla_decode_triton(q_lat, q_rope, cache, positions, scale), reps=200)
            torch_ms = median_ms(lambda: mla_decode_reference(q_lat, q_rope, cache[:ctx], positions, scale), reps=50)
            nbytes = ctx * (RANK + ROPE) * 2 + t * HEADS * (RANK + ROPE) * 2 + t * HEADS * RANK * 4
            floor_ms = nbytes / bw * 1e3
            rows.append(dict(ctx=ctx, t=t, rel_err=rel, kernel_ms=kernel_ms, torch_ms=torch_ms, floor_ms=floor_ms,
                             ratio=kernel_ms / floor_ms))
    result = dict(kernel="mla_decode", device=torch.cuda.get_device_name(), copy_bw_tbs=bw / 1e12, rows=rows)
    write_result(out, result)
    print(f"mla_decode  copy {bw / 1e12:.2f} TB/s")
    print(f"{'ctx':>6} {'T':>3} {'rel err':>9} {'kernel us':>10} {'torch us':>9} {'floor us':>9} {'x floor':>8}")
    for r in rows:
        print(f"{r['ctx']:>6} {r['t']:>3} {r['rel_err']:>9.1e} {r['kernel_ms'] * 1e3:>10.1f} "
              f"{r['torch_ms'] * 1e3:>9.1f} {r['floor_ms'] * 1e3:>9.1f} {r['ratio']:>8.2f}")
    return 0 if all(r["rel_err"] < 2e-2 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "mla.json"))
