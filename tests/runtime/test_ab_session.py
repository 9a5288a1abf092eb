"""bench/ab_session.sh, the script every device call's A/B goes through, on CPU with a stand-in benchmark: a
variant is HEAD's code plus a patch (applied for real: a `git apply` inside the repository's ignored .cache
folder would skip every path without a word), and AB_SIDES / AB_ROUNDS time the trees alternately, each
benchmark importing its own tree's lingls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the stand-in benchmark: writes which lingls it imported and whether the patch's mark is in it
PROBE = ("import sys, lingls.kernels.pdl as p; "
         "open(sys.argv[1], 'w').write(p.__file__ + ' ' + str(hasattr(p, 'PATCHED')))")


def run(args, cwd, **env):
    return subprocess.run(["bash", "bench/ab_session.sh", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_variants_alternate_with_the_code_before(tmp_path):
    clone = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    pdl = clone / "lingls" / "kernels" / "pdl.py"
    pdl.write_text(pdl.read_text() + "\nPATCHED = True\n")
    patch = tmp_path / "mark.patch"
    patch.write_text(subprocess.run(["git", "diff"], cwd=clone, capture_output=True, text=True, check=True).stdout)
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=clone, check=True)

    assert run(["--prepare"], clone).returncode == 0
    made = run(["--variant", "mark", str(patch)], clone)
    assert made.returncode == 0, made.stderr
    assert "PATCHED" in (clone / ".cache" / "mark" / "lingls" / "kernels" / "pdl.py").read_text()
    assert not (clone / ".cache" / "mark" / "bench" / "results").exists()  # results stay home: 64 MiB travel
    assert run(["--variant", "after", str(patch)], clone).returncode != 0  # the working tree's name

    out = tmp_path / "out"
    timed = run(["none", "--", "-c", PROBE, "@OUT"], clone, OUT=str(out), AB_SIDES="before mark nothing",
                AB_ROUNDS="2", PYTHONPATH="")
    assert timed.returncode == 0, timed.stderr
    assert "== nothing: no .cache/nothing, skipped" in timed.stdout
    assert sorted(p.name for p in out.iterdir()) == ["before.json", "before_r2.json", "mark.json", "mark_r2.json"]
    for name, tree, patched in (("before", "before", False), ("mark_r2", "mark", True)):
        file, mark = (out / f"{name}.json").read_text().split()
        assert file == str(clone / ".cache" / tree / "lingls" / "kernels" / "pdl.py") and mark == str(patched)


def test_summary_folds_the_sides_into_one_file(tmp_path):
    """bench.ab_summary: the device returns at most 8 files, so a call with more sides folds them into one."""
    def side(ms, routing_us):
        return {"rows": [{"T": 9, "fused_graph_ms": ms,
                          "kernels": [{"kernel": "_route_token_kernel", "us_per_step": routing_us}]}]}

    (tmp_path / "before.json").write_text(json.dumps(side(4.33, 258.0)))
    (tmp_path / "after.json").write_text(json.dumps(side(4.23, 158.0)))
    (tmp_path / "broken.json").write_text("{")  # a side that died mid-write
    done = subprocess.run([sys.executable, "-m", "bench.ab_summary", str(tmp_path), "_route_token_kernel", "_none"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "broken.json: not JSON, left out" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("before", "after"))]
    assert rows == [["after", "9", "4.230", "158.0", "-"], ["before", "9", "4.330", "258.0", "-"]]
    summary = json.loads((tmp_path / "ab_summary.json").read_text())
    assert sorted(summary) == ["after", "before"] and summary["after"] == side(4.23, 158.0)


def test_summary_reads_speculative_rounds_too(tmp_path):
    """A spec_flash_gpu side prints its plain step, its K+1-token step and, per draft head, the verify time and
    TPOT at the README's acceptance; fused-step sides in the same folder keep their own table."""
    rows = [{"k": 8, "a": a, "draft_vocab": vocab, "verify_ms": 6.7 + a / 100, "tpot_ms": 1.0 + a / 100}
            for a in (5, 6) for vocab in (None, 32768)]
    (tmp_path / "spec.json").write_text(json.dumps({"rows": rows, "plain_decode_ms": 2.13,
                                                    "target_step_ms": {"8": 6.5}}))
    (tmp_path / "step.json").write_text(json.dumps({"rows": [{"T": 1, "fused_graph_ms": 1.4}]}))
    done = subprocess.run([sys.executable, "-m", "bench.ab_summary", str(tmp_path), "_none"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    assert ["step", "1", "1.400", "-"] in lines
    assert [line for line in lines if line[0] == "spec"] == [["spec", "2.130", "6.500", "whole", "6.760", "1.060"],
                                                             ["spec", "2.130", "6.500", "32k", "6.760", "1.060"]]
