"""One table and one file for the sides of an A/B call (bench/ab_session.sh with bench/fused_step_gpu.py or
bench/spec_flash_gpu.py).

The device tool returns at most 8 files per call, so a call that times more trees than that folds their
results here: every SIDE.json under DIR goes into DIR/ab_summary.json (the whole files, keyed by side), and
one row per side is printed: for the fused step, its time at each T and the device time of the kernels named
below; for a speculative round, the plain decode step, the K+1-token target step, and per draft head the
verify time and TPOT at the acceptance the README quotes (SPEC_ACCEPT of K=8, SIMULATED).

    python -m bench.ab_summary DIR [KERNEL ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT_KERNELS = ("_route_token_kernel", "_gate_up_kernel", "_down_kernel", "_gemv_tma_kernel", "_mla_split_kernel")
SPEC_ACCEPT = 6


def step_table(sides: dict, kernels: list[str]) -> None:
    print(f"{'side':<14} {'T':>2} {'step ms':>8} " + " ".join(f"{k.strip('_')[:14]:>14}" for k in kernels))
    for side, result in sides.items():
        for row in result["rows"]:
            device = {k["kernel"]: k["us_per_step"] for k in row.get("kernels", [])}
            cells = " ".join(f"{device[k]:>14.1f}" if k in device else f"{'-':>14}" for k in kernels)
            print(f"{side:<14} {row['T']:>2} {row['fused_graph_ms']:>8.3f} {cells}")


def spec_table(sides: dict) -> None:
    print(f"{'side':<14} {'plain ms':>8} {'K+1 ms':>8} {'head':>6} {'verify ms':>9} {'TPOT ms':>8}")
    for side, result in sides.items():
        for row in result["rows"]:
            if row["a"] != SPEC_ACCEPT:
                continue
            head = f"{row['draft_vocab'] // 1024}k" if row.get("draft_vocab") else "whole"
            target = result["target_step_ms"].get(str(row["k"]), float("nan"))
            print(f"{side:<14} {result['plain_decode_ms']:>8.3f} {target:>8.3f} {head:>6} {row['verify_ms']:>9.3f} "
                  f"{row['tpot_ms']:>8.3f}")


def main(folder: str, kernels: list[str]) -> int:
    out = Path(folder)
    sides = {}
    for path in sorted(out.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except ValueError:  # a side that died mid-write: its log says why
            print(f"{path.name}: not JSON, left out")
            continue
        if path.name != "ab_summary.json" and isinstance(result, dict) and "rows" in result:
            sides[path.stem] = result
    (out / "ab_summary.json").write_text(json.dumps(sides, indent=1))
    spec = {side: result for side, result in sides.items() if "target_step_ms" in result}
    step = {side: result for side, result in sides.items() if side not in spec}
    if step:
        step_table(step, kernels)
    if spec:
        spec_table(spec)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2:] or list(DEFAULT_KERNELS)))
