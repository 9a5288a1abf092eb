"""bench.ncu_step's folding of an Nsight Compute report (the GPU run writes ncu's raw CSV; here, one made up by
hand in ncu's shape: a header row, a units row, one row per launch): launches of one kernel are summed, bytes
and times are read in their units, and the warp states are weighted by each launch's time."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from bench import ncu_step as ncu

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def write_raw(path: Path) -> None:
    head = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
            STALL.format("selected"), STALL.format("long_scoreboard"), STALL.format("long_scoreboard_not_issued")]
    units = ["", "", "us", "Mbyte", "Kbyte", "inst", "inst", "inst"]
    launches = [["0", "_gemv_kernel(int, float)", "4", "12", "0", "1", "3", "9"],
                ["1", "_kda_step_kernel(int)", "11", "1", "1,000", "6", "2", "9"],
                ["2", "_gemv_kernel(int, float)", "6", "18", "0", "1", "1", "9"]]
    with open(path, "w", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows([head, units, *launches])


def test_launches_fold_into_one_row_per_kernel(tmp_path):
    write_raw(tmp_path / "raw.csv")
    (tmp_path / "copy.json").write_text(json.dumps({"copy_tbs": 4.0}))
    ncu.fold(str(tmp_path / "raw.csv"), str(tmp_path / "copy.json"), str(tmp_path / "out.json"))
    rows = {r["kernel"]: r for r in json.loads((tmp_path / "out.json").read_text())["kernels"]}
    gemv, kda = rows["_gemv_kernel"], rows["_kda_step_kernel"]
    assert gemv["launches"] == 2 and gemv["us"] == 10.0 and gemv["mb"] == 30.0
    assert abs(gemv["tbs"] - 3.0) < 1e-9 and abs(gemv["of_copy"] - 0.75) < 1e-9  # 30 MB in 10 us
    assert kda["mb"] == 2.0  # 1 MB read + 1,000 KB written
    # time-weighted: selected (4*1 + 6*1)/10 = 1, long scoreboard (4*3 + 6*1)/10 = 1.8; "not issued" is a subset
    assert abs(gemv["stall_share"]["long_scoreboard"] - 1.8 / 2.8) < 1e-9
    assert set(gemv["stall_share"]) == {"selected", "long_scoreboard"}
    assert list(rows) == ["_kda_step_kernel", "_gemv_kernel"]  # longest first
