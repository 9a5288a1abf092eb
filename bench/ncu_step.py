"""Inside each kernel of a fused step: achieved DRAM bandwidth and why its warps stall, from Nsight Compute.

The step's timers (fused_step_gpu.py, step_timeline.py) say how long each kernel takes and what it adds to the
critical path, not why: whether a kernel streams at the copy bandwidth, waits on memory with too little in
flight, or is bound by the instructions its warps issue (the KDA step at T=9: a quarter of its warp states
issuing, a quarter fixed-latency dependencies, almost no memory traffic). This runs one eager step of rank 0's
TP=N shard (random bf16 weights, all-reduce stubbed, 8k context) with only that step between
cudaProfilerStart/Stop, so `ncu --profile-from-start off` replays each of its kernels alone (no PDL overlap:
times are each kernel's own), then folds the report into one row per kernel name.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum -o REP \\
        python -m bench.ncu_step run LAYERS T COPY.json [--tp N]
    ncu --import REP.ncu-rep --csv --page raw > RAW.csv
    python -m bench.ncu_step fold RAW.csv COPY.json OUT.json
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

from bench.common import write_result

DURATION, READ, WRITE = "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"
# warp states per issued instruction, as ncu's WarpStateStats section collects them ("selected": issuing)
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


def run(layers: int, t: int, copy_json: str, tp: int) -> None:
    import torch

    from bench.common import CONTEXT
    from lingls.bench.step import build_flash, copy_bandwidth
    from lingls.runtime.fused_step import FusedStep

    Path(copy_json).write_text(json.dumps(dict(copy_tbs=copy_bandwidth() / 1e12)))  # before the profiled range
    torch.manual_seed(0)
    model = build_flash(layers, tp=tp, rank=0)
    fused = FusedStep(model, kernels=True)
    state = model.new_state(CONTEXT + 64)
    ids = torch.randint(0, model.config.vocab_size, (t,), device="cuda")
    pos = torch.arange(CONTEXT - t, CONTEXT, device="cuda")
    with torch.inference_mode():
        for _ in range(3):  # compile and warm every kernel outside the profiled range
            fused.step(ids, state, pos)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fused.step(ids, state, pos)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def fold(raw_csv: str, copy_json: str, out: str) -> None:
    """ncu's raw CSV (a header row, a units row, one row per kernel launch) -> one row per kernel name."""
    copy_tbs = json.loads(Path(copy_json).read_text())["copy_tbs"]
    rows = list(csv.reader(open(raw_csv)))
    start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    head, data = rows[start], [r for r in rows[start + 2:] if len(r) == len(rows[start])]
    col = {name: i for i, name in enumerate(head)}
    units = dict(zip(head, rows[start + 1]))
    stalls = {h[len(STALL[0]):-len(STALL[1])]: h for h in head if h.startswith(STALL[0]) and h.endswith(STALL[1])
              and "_not_issued" not in h}
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[units[DURATION]]
    per_byte = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
    def value(r, metric):  # ncu writes thousands with commas
        return float(r[col[metric]].replace(",", "") or 0)

    acc = defaultdict(lambda: defaultdict(float))
    for r in data:
        a = acc[r[col["Kernel Name"]].split("(")[0]]
        us = value(r, DURATION) * scale
        a["launches"] += 1
        a["us"] += us
        a["bytes"] += sum(value(r, m) * per_byte[units[m]] for m in (READ, WRITE))
        for s, m in stalls.items():  # per issued instruction, weighted by the launch's time
            a[s] += value(r, m) * us
    table = []
    for name, a in sorted(acc.items(), key=lambda kv: -kv[1]["us"]):
        states = sorted(((s, a[s] / a["us"]) for s in stalls), key=lambda kv: -kv[1])
        total = sum(v for _, v in states) or 1.0
        tbs = a["bytes"] / (a["us"] * 1e-6) / 1e12
        table.append(dict(kernel=name, launches=int(a["launches"]), us=a["us"], mb=a["bytes"] / 1e6, tbs=tbs,
                          of_copy=tbs / copy_tbs, stall_share={s: v / total for s, v in states if v > 0}))
    write_result(out, dict(source=Path(raw_csv).name, copy_tbs=copy_tbs, kernels=table))
    print(f"{'kernel':<26} {'n':>4} {'us':>8} {'MB':>8} {'TB/s':>6} {'of copy':>7}  "
          "warp states (share; selected: issuing)")
    for k in table:
        top = ", ".join(f"{s} {v:.0%}" for s, v in list(k["stall_share"].items())[:3])
        print(f"{k['kernel'][:26]:<26} {k['launches']:>4} {k['us']:>8.1f} {k['mb']:>8.1f} {k['tbs']:>6.2f} "
              f"{k['of_copy']:>7.0%}  {top}")


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the step to profile (under ncu)")
    r.add_argument("layers", type=int)
    r.add_argument("tokens", type=int)
    r.add_argument("copy_json", help="where the copy bandwidth measured before the profiled range goes")
    r.add_argument("--tp", type=int, default=4)
    f = sub.add_parser("fold", help="ncu's raw CSV -> one row per kernel")
    f.add_argument("raw_csv")
    f.add_argument("copy_json")
    f.add_argument("out")
    a = p.parse_args()
    if a.cmd == "run":
        run(a.layers, a.tokens, a.copy_json, a.tp)
    else:
        fold(a.raw_csv, a.copy_json, a.out)
