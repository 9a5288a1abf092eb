"""bench.spec_flash_gpu (simulated-acceptance TPOT at Ling-3.0-flash shapes, for the GPU) runs end to end at tiny
shapes on CPU: every (drafter, K, a) is measured, every round accepts exactly the forced count, the JSON says so."""

from __future__ import annotations

import json

import torch

from bench import spec_flash_gpu as bench


def test_tiny_run_measures_every_forced_acceptance(tmp_path):
    threads = torch.get_num_threads()
    out = tmp_path / "spec.json"
    try:
        rc = bench.main(["--tiny", "--ks", "3,1", "--rounds", "3", "--reps", "2", "--draft-vocab", "1024",
                         "--drafters", "mtp,dspark", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    res = json.loads(out.read_text())
    assert rc == 0 and not res["errors"] and not res["skipped"]
    # each K: MTP with the whole lm_head as the draft head, then with a 1,024-id one (--draft-vocab), then DSpark
    assert [(r["drafter"], r["k"], r["draft_vocab"], r["a"]) for r in res["rows"]] == [
        ("mtp", 3, None, 0), ("mtp", 3, None, 1), ("mtp", 3, None, 2), ("mtp", 3, None, 3), ("mtp", 3, 1024, 0),
        ("mtp", 3, 1024, 1), ("mtp", 3, 1024, 2), ("mtp", 3, 1024, 3), ("dspark", 3, None, 0),
        ("dspark", 3, None, 1), ("dspark", 3, None, 2), ("dspark", 3, None, 3), ("mtp", 1, None, 0),
        ("mtp", 1, None, 1), ("mtp", 1, 1024, 0), ("mtp", 1, 1024, 1), ("dspark", 1, None, 0), ("dspark", 1, None, 1)]
    assert set(res["graph_keys"]) == {"mtp K=3", "mtp K=3 vocab=1024", "dspark K=3", "mtp K=1", "mtp K=1 vocab=1024",
                                      "dspark K=1"}
    assert res["draft_round_ms"]["dspark"] > 0 and res["dspark_config"]["block_size"] == 8
    assert all(r["forced_count_honoured"] and r["tpot_ms"] > 0 for r in res["rows"])
    assert "SIMULATED" in res["label"] and res["plain_decode_ms"] > 0
