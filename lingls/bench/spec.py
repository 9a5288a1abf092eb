"""`lingls bench spec`: accept length and TPOT of speculative decoding with each drafter, on held-out code.

Cases: files held out from ling-nano's training, cut at a line start at 60% of the file. Their names come from
`--heldout`, the training run's data manifest (default: bench/results/nano_data_manifest.json of the current
directory, a checkout of the repository); the files are read from this interpreter's standard library and
site-packages where present. The prompt is the last `--prompt-tokens` tokens before the cut, and the model continues
greedily for `--max-new` tokens. For every drafter the same cases run on a fresh runner; the output must equal plain
greedy decoding (checked), so only speed differs.

Accept length = tokens per verify step (accepted drafts + the target's own token). TPOT = decode wall time /
tokens, the prefill excluded. Draft and verify times are per round.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from lingls.engine.local import EMBEDDED
from lingls.runtime.runner import ModelRunner, Sampling

HELDOUT = Path("bench") / "results" / "nano_data_manifest.json"  # relative to the current directory


def heldout_files(manifest: Path, limit: int) -> list[tuple[str, str]]:
    """(name, text) of the first `limit` held-out files (in name order) present on this machine."""
    if not manifest.is_file():
        raise SystemExit(f"lingls bench spec: {manifest} is missing (the data manifest that lists ling-nano's "
                         "held-out files): run it from a checkout of the repository or pass --heldout FILE")
    roots = {"stdlib": Path(sysconfig.get_paths()["stdlib"]), "site": Path(sysconfig.get_paths()["purelib"])}
    out = []
    for name in sorted(json.loads(manifest.read_text())["heldout_names"]):
        label, rel = name.split("/", 1)
        path = roots[label] / rel
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.count("\n") >= 40:
                out.append((name, text))
        if len(out) == limit:
            break
    return out


def make_prompt(tokenizer, text: str, prompt_tokens: int) -> list[int]:
    cut = text.rfind("\n", 0, int(len(text) * 0.6)) + 1
    return tokenizer.encode(text[:cut])[-prompt_tokens:]


class Subject:
    """One drafter's runner, timed over the cases; the runners share the model."""

    def __init__(self, model, spec: str, capacity: int, k: int):
        from lingls.runtime.spec.round import SpecStats, attach

        self.runner = ModelRunner(model, capacity=capacity)
        self.speculator = attach(self.runner, spec, k) if spec != "none" else None
        self.tpot, self.outputs, self._fresh_stats = [], {}, SpecStats

    def run(self, i: int, prompt: list[int], max_new: int, timed: bool = True) -> None:
        self.runner.prefill(prompt, Sampling())
        t0 = time.perf_counter()
        out = list(self.runner.decode(max_new, True))
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        if timed:
            self.tpot.append((time.perf_counter() - t0) / len(out) * 1e3)
            self.outputs[i] = out
        elif self.speculator is not None:  # warm-up rounds do not count
            self.speculator.stats = self._fresh_stats()

    def record(self) -> dict:
        rec = {"tpot_ms_median": statistics.median(self.tpot), "tpot_ms_mean": statistics.mean(self.tpot)}
        if self.speculator is not None:
            s = self.speculator.stats
            rec.update(accept_length=s.accept_length, rounds=s.rounds, accepted=s.accepted, drafted=s.drafted,
                       draft_ms_per_round=s.draft_s / s.rounds * 1e3, verify_ms_per_round=s.verify_s / s.rounds * 1e3)
        return rec


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lingls bench spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(EMBEDDED), help="model directory (default: the embedded ling-nano)")
    p.add_argument("--drafts", default=None, help="comma-separated --draft values (default: none, lookup, mtp, "
                   "lookup+mtp, and the shipped block drafter with and without lookup when present)")
    p.add_argument("--k", type=int, default=4, help="drafted tokens per round")
    p.add_argument("--cases", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2, help="timed passes over the cases")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--heldout", type=Path, default=HELDOUT, metavar="MANIFEST.json",
                   help=f"ling-nano's data manifest, which names the held-out files (default: ./{HELDOUT})")
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args(argv)

    from lingls.engine.tokenizer import Tokenizer
    from lingls.model import load_model

    files = heldout_files(args.heldout, args.cases)  # before the model loads: a missing manifest fails at once
    if args.threads:
        torch.set_num_threads(args.threads)
    drafts = args.drafts.split(",") if args.drafts else ["none", "lookup", "mtp", "lookup+mtp"]
    shipped = Path(args.model) / "draft"
    if args.drafts is None and (shipped / "config.json").is_file():
        drafts += [str(shipped), f"lookup+{shipped}"]
    if drafts[0] != "none":
        drafts.insert(0, "none")
    model = load_model(args.model, device=args.device, dtype=torch.float32)
    tok = Tokenizer(args.model)
    prompts = [make_prompt(tok, text, args.prompt_tokens) for _, text in files]
    capacity = max(len(p) for p in prompts) + args.max_new + 4 * (args.k + 1)
    subjects = {spec: Subject(model, spec, capacity, args.k) for spec in drafts}
    for sub in subjects.values():
        sub.run(0, prompts[0], 8, timed=False)
    for _ in range(args.repeat):  # drafters interleaved, so a noisy neighbour hurts them alike
        for i, prompt in enumerate(prompts):
            for sub in subjects.values():
                sub.run(i, prompt, args.max_new)
    results = {}
    for spec, sub in subjects.items():
        rec = results[spec] = sub.record()
        line = f"{spec:>24}: TPOT {rec['tpot_ms_median']:.2f} ms"
        if "accept_length" in rec:
            line += (f", accept length {rec['accept_length']:.2f}, draft {rec['draft_ms_per_round']:.2f} ms + "
                     f"verify {rec['verify_ms_per_round']:.2f} ms per round")
        print(line, flush=True)
    base = results["none"]
    for spec, rec in results.items():
        rec["identical_to_plain_greedy"] = subjects[spec].outputs == subjects["none"].outputs
        rec["speedup"] = base["tpot_ms_median"] / rec["tpot_ms_median"]
    report = {
        "what": "speculative decoding on held-out code (greedy): accept length and TPOT per drafter",
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "device": args.device, "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "config": {"model": Path(args.model).name, "k": args.k, "cases": [n for n, _ in files],
                   "prompt_tokens": args.prompt_tokens, "max_new": args.max_new, "repeat": args.repeat},
        "results": results,
    }
    if not all(r["identical_to_plain_greedy"] for r in results.values()):
        print("lingls bench spec: a drafter changed the greedy output (a bug)", file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({s: {k: v for k, v in r.items() if k in ("accept_length", "tpot_ms_median", "speedup")}
                      for s, r in results.items()}))
    return 0 if all(r["identical_to_plain_greedy"] for r in results.values()) else 1
