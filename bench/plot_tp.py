"""Plot tensor-parallel step sweeps (bench/tp_gpu.py JSONs) side by side: step ms against T with the byte floor.

    python -m bench.plot_tp OUT.png LABEL=RESULT.json [LABEL=RESULT.json ...]
"""

from __future__ import annotations

import json
import sys


def rows(path: str) -> list[dict]:
    model = json.load(open(path))["model"]
    return sorted((v for k, v in model.items() if k.startswith("T") and isinstance(v, dict)), key=lambda r: r["T"])


def main(out: str, series: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec in series:
        label, path = spec.rsplit("=", 1)
        rs = rows(path)
        ts = [r["T"] for r in rs]
        line, = ax.plot(ts, [r["peer_ms"] for r in rs], "o-", label=f"{label}: peer all-reduce")
        ax.plot(ts, [r["nccl_ms"] for r in rs], "x:", color=line.get_color(), label=f"{label}: NCCL")
        ax.plot(ts, [r["floor_ms"] for r in rs], "--", color=line.get_color(), alpha=0.5, label=f"{label}: byte floor")
    ax.set_xlabel("tokens per step (1 = decode, >1 = verify)")
    ax.set_ylabel("step ms (CUDA graph, median)")
    ax.set_title("Ling-3.0-flash full model, random weights, 8k context")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
