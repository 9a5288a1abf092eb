"""`lingls bench spec` reads ling-nano's held-out file list from a path it is given (default: bench/results of the
current directory), never from beside its own source, so it works from an installed wheel: run elsewhere without
the file it says what is missing and how to pass it; given the file it runs and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lingls.bench import spec

MANIFEST = Path(__file__).resolve().parents[2] / "bench" / "results" / "nano_data_manifest.json"


def test_without_the_manifest_it_says_how_to_pass_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        spec.main(["--drafts", "lookup", "--cases", "1"])
    assert "nano_data_manifest.json is missing" in str(stop.value) and "--heldout" in str(stop.value)


def test_given_the_manifest_it_runs_from_any_directory(tmp_path, monkeypatch):
    if not spec.heldout_files(MANIFEST, 1):
        pytest.skip("none of ling-nano's held-out files is installed here")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        rc = spec.main(["--heldout", str(MANIFEST), "--drafts", "lookup", "--cases", "1", "--prompt-tokens", "64",
                        "--max-new", "8", "--repeat", "1", "--k", "2", "--out", "out/spec.json"])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "out" / "spec.json").read_text())
    assert rc == 0 and set(report["results"]) == {"none", "lookup"}
    assert report["results"]["lookup"]["identical_to_plain_greedy"]
