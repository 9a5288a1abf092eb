"""Ship a reproduce run's model as the embedded default: `python -m training.ship RUN_DIR`.

RUN_DIR is a `training.reproduce --out` directory (ling-nano/, results/) whose evaluation finished. Its model
directory replaces lingls/assets/ling-nano/ with the weights packed (`lingls.model.packed`: the repository travels
to the GPU machine whole, within 64 MiB), and its evaluation, training log, curves, data manifest and licenses
replace bench/results/nano_* (the evaluation holds the train state, so a later run trains on from the shipped
model with nothing more to carry: `RESUME_TAR=shipped bash training/device_run.sh`). The decision to ship is the
training log's (docs/training-log.md), not this step's.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from lingls.model.packed import pack_file

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "lingls" / "assets" / "ling-nano"
RESULTS = ROOT / "bench" / "results"
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md",
               "training_curve.png", "model.safetensors")
DRAFT_FILES = ("config.json", "distill_log.json", "model.safetensors")
RESULT_FILES = {"nano_eval.json": "nano_eval.json", "nano_eval.png": "nano_eval.png",
                "nano_training_curve.png": "nano_training_curve.png", "data_manifest.json": "nano_data_manifest.json",
                "data_licenses.json": "nano_data_licenses.json"}


def ship(run: Path, assets: Path = ASSETS, results: Path = RESULTS) -> list[Path]:
    """Copy the run into assets/ and results/; returns the files written."""
    model, res = run / "ling-nano", run / "results"
    missing = [str(p) for p in [*(model / f for f in MODEL_FILES), res / "nano_eval.json", res / "train_log.jsonl"]
               if not p.is_file()]
    if missing:
        raise SystemExit(f"{run} is not a finished run: missing {', '.join(missing)}")
    written = []
    if assets.exists():
        shutil.rmtree(assets)
    assets.mkdir(parents=True)
    for name in MODEL_FILES:
        written.append(shutil.copy2(model / name, assets / name))
    if (model / "draft" / "model.safetensors").is_file():
        (assets / "draft").mkdir()
        for name in DRAFT_FILES:
            written.append(shutil.copy2(model / "draft" / name, assets / "draft" / name))
    written = [pack_file(Path(p)) if Path(p).name == "model.safetensors" else Path(p) for p in written]
    for src, dst in RESULT_FILES.items():
        if (res / src).is_file():
            written.append(Path(shutil.copy2(res / src, results / dst)))
    log = [json.loads(line) for line in (res / "train_log.jsonl").read_text().splitlines() if line.strip()]
    (results / "nano_train_log.json").write_text(json.dumps(log, indent=0) + "\n")
    written.append(results / "nano_train_log.json")
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a training.reproduce --out directory")
    args = ap.parse_args(argv)
    for path in ship(args.run):
        print(f"{path.relative_to(ROOT)} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
