"""The tuned launch settings are data: every entry of lingls/kernels/tuned.json names the GPU and commit it was
timed on, the kernels read it at import, and the tuner's `--ship` writes the same layout it reads."""

import json
from pathlib import Path

from lingls.kernels import TUNED, gemv, mla, tuned


def test_every_entry_names_its_gpu_and_commit():
    doc = json.loads(TUNED.read_text())
    for kernel in (k for k in doc if k != "about"):
        for e in doc[kernel]:
            assert e["gpu"] and e["commit"] and e["shape"], e
            assert set(e) == {"key", "settings", "gpu", "commit", "shape"}, e


def test_kernels_read_the_file():
    assert gemv.CONFIGS == tuned("gemv")
    assert mla.CONFIGS[8][1] == tuple(tuned("mla")[(8, 1)])


def test_ship_writes_the_layout_it_reads(tmp_path: Path, monkeypatch):
    tune_gpu = __import__("bench.tune_gpu", fromlist=["ship"])
    monkeypatch.setattr("torch.cuda.get_device_name", lambda: "TEST GPU")
    monkeypatch.setenv("LINGLS_COMMIT", "0123abcd")
    out = tmp_path / "tuned.json"
    tune_gpu.ship(str(out), {"gemv": {(2560, 1024, False, 1): {"block_n": 16}}}, {}, 4)
    before, after = TUNED.read_text().splitlines(), out.read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == 1, changed
    entry = json.loads(changed[0][1].rstrip(","))
    assert entry["settings"] == {"block_n": 16} and (entry["gpu"], entry["commit"]) == ("TEST GPU", "0123abcd")
    tune_gpu.write_tuned(json.loads(TUNED.read_text()), out)
    assert out.read_text() == TUNED.read_text()
