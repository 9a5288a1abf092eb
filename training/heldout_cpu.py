"""A reproduce run's model against the shipped one on a CPU, on the held-out packages that run named; or, without
--run, the shipped model alone on the packages here that its training data lacked.

    python -m training.heldout_cpu --run DIR [--compare lingls/assets/ling-nano] [--next-line 50] [--fim 30]
    python -m training.heldout_cpu --next-line 200 --fim 0 --prefix-tokens 1536 --gate 0.003,0.01,0.05 \
        --out bench/results/nano_gate.json

For a run whose GPU command ran out of time before its evaluation: DIR holds its ling-nano/ and
results/data_manifest.json. The held-out set is rebuilt from this machine's Python source, restricted to the
packages the run held out (so neither their files nor vendored copies were in its training data; the versions
here may differ from the GPU image's), deduplicated by content, and cased as `training.evaluate` cases it (same
kinds, same post-processing and metrics). Completion runs at batch 1 with the model's recurrent/KV state (a
prefill, then one token per step), which a CPU can afford where the GPU evaluation's re-run of the whole window
per token cannot. The token n-gram baseline is left out (it counts the whole training stream). Held-out loss is
over the first windows of the plain held-out text, per token (each model's own tokenizer) and per byte.
Writes DIR/results/heldout_cpu.json (or --out) and prints the summary table.

The confidence gate (`lingls.engine.local.LineGate`): every model line's probability (the product of its
tokens', the token that ends it included) is kept, and for each --gate bar the report counts the cursors where
the line would be shown, and how many of those are right (exact match) or wrong, with edit similarity over the
shown ones. Without --run the cases come from this machine's site-packages whose package is not among the
training packages of --manifest (the shipped model's, bench/results/nano_data_manifest.json; or of several), at most
--package-kb of each package (in file-name order), so no one large package fills the set.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from rapidfuzz import fuzz
from tokenizers import Tokenizer

from lingls.engine.healing import strip_tail
from lingls.engine.local import EMBEDDED
from lingls.model import load_model
from lingls.runtime.cpu_step import CpuStep
from training.baselines import first_line, repeat_previous_line
from training.data import content_key, iter_files, source_roots
from training.evaluate import (
    FIM_KINDS,
    MODE_NAMES,
    NEXT_LINE_KINDS,
    Case,
    ModelCompleter,
    case_record,
    make_cases,
    postprocess,
    score,
    summary_table,
)
from training.tokenizer import SPECIAL_TOKENS
from training.train import windows_of


class StatefulCompleter(ModelCompleter):
    """ModelCompleter's prompts and token healing, generated one prompt at a time over the model's state: the
    prompt by the model's own step, each new token by lingls' CPU decode step (`lingls.runtime.cpu_step`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.line_logprobs: list[float] = []  # each completed prompt's line: the sum of its tokens' log-probs

    def complete_all(self, cases: list[Case]) -> list[str]:
        """ModelCompleter's lines, one case at a time in their order (batch 1 gains nothing from sorting), with
        `line_logprobs` in the same order."""
        self.line_logprobs = []
        return [first_line(self._generate([self.prompt(c.prefix, c.suffix)])[0]) for c in cases]

    @torch.no_grad()
    def _generate(self, prompts: list[tuple[list[int], str]]) -> list[str]:
        texts, fast = [], CpuStep(self.model)
        for ids, tail in prompts:
            ids = ids or [0]  # nothing before the cursor: start from <|endoftext|>, as a document start
            state = self.model.new_state(len(ids) + self.max_new + 1, device="cpu", dtype=torch.float32)
            h, normed = self.model.step(torch.tensor(ids), state, torch.arange(len(ids)), kv_len=len(ids),
                                        normed=True, prefill=True)
            logits = self.model.head(h[-1:], normed[-1:])[0].float()
            logits = logits.masked_fill(~(self.candidates.mask(tail) if tail else self.candidates.ordinary),
                                        float("-inf"))
            generated, text, pos, score, rest = [], "", len(ids), 0.0, tail
            for _ in range(self.max_new):
                token = int(logits.argmax())
                score += float(logits.log_softmax(-1)[token])  # the line's end (newline, or a special token) too
                if token < len(SPECIAL_TOKENS):
                    break
                generated.append(token)
                # as LocalEngine heals: a chosen start of the tail leaves the rest of it to agree with
                piece = self.texts[token]
                rest = rest[len(piece):] if rest and len(piece) < len(rest) and rest.startswith(piece) else ""
                text = strip_tail(self.tok.decode(generated), tail)
                if "\n" in text:
                    break
                h, normed = fast.step(torch.tensor([token]), state, torch.tensor([pos]), kv_len=pos + 1, normed=True)
                logits = fast.head(h, normed)[0].float()
                if rest:
                    logits = logits.masked_fill(~self.candidates.mask(rest), float("-inf"))
                pos += 1
            texts.append(text)
            self.line_logprobs.append(score)
        return texts


def heldout_files(manifest: dict) -> list:
    packages = set(manifest["stats"]["heldout_packages"])
    files, keys = [], set()
    for f in iter_files(source_roots()):
        if f.package in packages and (k := content_key(f.text)) not in keys:
            keys.add(k)
            files.append(f)
    return files


def unseen_files(manifests: list[dict], package_bytes: int) -> list:
    """This machine's site-packages files whose package no manifest's training data had, deduplicated by
    content, at most `package_bytes` of each package in file-name order."""
    trained = {p for m in manifests for p in m["train_package_bytes"]}
    files, keys, used = [], set(), {}
    for f in sorted(iter_files(source_roots()), key=lambda f: f.name):
        if not f.name.startswith("site/") or f.package in trained:
            continue
        if used.get(f.package, 0) + len(f.text) > package_bytes or (k := content_key(f.text)) in keys:
            continue
        keys.add(k)
        used[f.package] = used.get(f.package, 0) + len(f.text)
        files.append(f)
    return files


def gated(cases: list[Case], lines: list[str], logprobs: list[float], bars: list[float]) -> dict:
    """{group: {bar: ...}} for the next-line and the suffix-aware (fim) cases, where there are some: the share
    of cursors where the line would be shown (non-empty, probability >= bar), and of all cursors the shares
    shown right (exact match) and shown wrong; exact match and edit similarity over the shown lines. Bar 0 is
    no gate."""
    out = {}
    for group, kinds in (("next_line", NEXT_LINE_KINDS), ("fim", FIM_KINDS)):
        rows = [(c, p, lp) for c, p, lp in zip(cases, lines, logprobs) if c.kind in kinds]
        if not rows:
            continue
        out[group] = {}
        for bar in [0.0, *bars]:
            shown = [(c, p) for c, p, lp in rows if p.strip() and (bar == 0 or lp >= math.log(bar))]
            right = sum(p.rstrip() == c.target.rstrip() for c, p in shown)
            es = sum(fuzz.ratio(p.rstrip(), c.target.rstrip()) / 100 for c, p in shown)
            out[group][str(bar)] = {"shown": round(len(shown) / len(rows), 4),
                                    "shown_right": round(right / len(rows), 4),
                                    "shown_wrong": round((len(shown) - right) / len(rows), 4),
                                    "exact_match_of_shown": round(right / max(len(shown), 1), 4),
                                    "edit_similarity_of_shown": round(es / max(len(shown), 1), 4)}
    return out


@torch.no_grad()
def plain_loss(model, tok, files, windows: int, seq_len: int = 2048) -> dict:
    ids = []
    for enc in tok.encode_batch([f.text for f in files], add_special_tokens=False):
        ids.extend(enc.ids + [0])
    stream = torch.tensor(ids, dtype=torch.int32)
    w = windows_of(stream, seq_len)[:windows].long()
    total = 0.0
    for x in w:
        logits = model(x[None, :-1]).float()
        total += float(torch.nn.functional.cross_entropy(logits[0], x[1:]))
    per_token = total / max(len(w), 1)
    text_bytes = sum(len(f.text.encode()) for f in files)
    bytes_per_token = text_bytes / max(len(ids) - len(files), 1)
    return {"nats_per_token": round(per_token, 4), "nats_per_byte": round(per_token / bytes_per_token, 4),
            "bytes_per_token": round(bytes_per_token, 3), "windows": len(w)}


def write_report(args, files, cases, raw: dict, scores: dict, losses: dict, seconds: dict) -> tuple[dict, dict]:
    raw = {**raw, "repeat previous line": [repeat_previous_line(c.prefix) for c in cases]}
    preds, degenerate = {}, {}
    for name, lines in raw.items():
        preds[name], before, after = postprocess(cases, lines)
        degenerate[name] = {"raw": before, "shown": after}
    results = {name: score(cases, p) for name, p in preds.items()}
    gates = {name: gated(cases, preds[name], lps, args.gate) for name, lps in scores.items()}
    report = {"run": str(args.run), "compare": str(args.compare), "heldout_files_here": len(files),
              "cases_from": "the run's held-out packages" if args.run else
              f"site-packages absent from the training packages of {', '.join(map(str, args.manifest))}, "
              f"<= {args.package_kb} kB each",
              "max_new_tokens": args.max_new_tokens, "prefix_tokens": args.prefix_tokens, "heal": args.heal,
              "cases_per_kind": {"next_line": args.next_line, "fim": args.fim}, "results": results,
              "gate": gates, "degenerate": degenerate, "heldout_loss": losses, "seconds": seconds,
              "samples": [case_record(c, {n: p[i] for n, p in preds.items()}) for i, c in enumerate(cases)]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return results, degenerate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, help="a reproduce --out DIR (without: the --compare model alone)")
    ap.add_argument("--compare", type=Path, default=EMBEDDED)
    ap.add_argument("--manifest", type=Path, action="append",
                    help="without --run: the --compare model's data manifest (its training packages; default "
                         "bench/results/nano_data_manifest.json); given again, cases from packages none of them "
                         "trained on, so several models can be scored on the same cases")
    ap.add_argument("--package-kb", type=int, default=400, help="without --run: at most this much of a package")
    ap.add_argument("--prefix-tokens", type=int, default=768, help="the prompt's prefix window (lingls: 1536)")
    ap.add_argument("--gate", default="0.01", help="confidence-gate bars to report (line probabilities)")
    ap.add_argument("--heal", choices=("word", "token"), default="word",
                    help="token healing of the half-typed word at the cursor (lingls'), or of its last token only")
    ap.add_argument("--out", type=Path, help="the report (default DIR/results/heldout_cpu.json)")
    ap.add_argument("--plot", action="store_true", help="the gate's chart beside the report (.png; matplotlib)")
    ap.add_argument("--next-line", type=int, default=50, help="cases of each next-line kind")
    ap.add_argument("--fim", type=int, default=30, help="cases of each suffix-aware kind")
    ap.add_argument("--modes", default="prefix,spm", help="the run's model's prompt modes (psm, spm, prefix)")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows of 2048 tokens for the loss")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args(argv)
    args.gate = [float(x) for x in args.gate.split(",") if x]
    if args.out is None and args.run is None:
        ap.error("--out is needed without --run")
    args.out = args.out or args.run / "results" / "heldout_cpu.json"
    torch.set_num_threads(args.threads)
    if args.run:
        files = heldout_files(json.loads((args.run / "results" / "data_manifest.json").read_text()))
    else:
        args.manifest = args.manifest or [Path("bench/results/nano_data_manifest.json")]
        files = unseen_files([json.loads(m.read_text()) for m in args.manifest], args.package_kb * 1000)
    cases = make_cases(files, args.next_line, args.seed, fim_per_kind=args.fim)
    print(f"{len(files)} held-out files here, {len(cases)} cases", flush=True)
    cmp_mode = json.loads((args.compare / "tokenizer_config.json").read_text()).get("completion_prompt", "psm")
    modes = args.modes.split(",")
    # the model's first mode, then the shipped model, then the model's other modes: the main comparison first,
    # and the JSON rewritten after each run, so an interrupted run still leaves what it finished
    runs = [("shipped", args.compare, cmp_mode)]
    if args.run:
        runs = [("ling-nano", args.run / "ling-nano", modes[0]), ("shipped before", args.compare, cmp_mode)]
        runs += [("ling-nano", args.run / "ling-nano", m) for m in modes[1:]]
    raw, scores, seconds, losses, loaded = {}, {}, {}, {}, {}
    for label, path, mode in runs:
        if label not in loaded:
            loaded.clear()  # one model in memory at a time
            loaded[label] = (load_model(path, device="cpu", dtype=torch.float32).eval(),
                             Tokenizer.from_file(str(path / "tokenizer.json")))
        model, tok = loaded[label]
        if label not in losses:
            losses[label] = plain_loss(model, tok, files, args.windows)
            print(label, losses[label], flush=True)
        t = time.time()
        name = f"{label} ({MODE_NAMES[mode]})"
        completer = StatefulCompleter(model, tok, "cpu", mode, prefix_tokens=args.prefix_tokens,
                                      max_new_tokens=args.max_new_tokens, whole_word=args.heal == "word")
        raw[name] = completer.complete_all(cases)
        scores[name] = completer.line_logprobs
        seconds[name] = round(time.time() - t, 1)
        print(f"{name}: {seconds[name]}s", flush=True)
        results, degenerate = write_report(args, files, cases, raw, scores, losses, seconds)
    print(summary_table(results))
    gate = json.loads(args.out.read_text())["gate"]
    if args.plot:
        from training.plots import gate_chart

        gate_chart(gate, args.out.with_suffix(".png"), f"confidence gate, {len(cases)} cursors in code the model "
                   "never saw (greedy line, prefix-only prompt)")
    for name, by_group in gate.items():
        for (group, bar), g in [((grp, b), g) for grp, by_bar in by_group.items() for b, g in by_bar.items()]:
            print(f"{name}, {group}, gate {bar}: shown {g['shown']:.3f} (right {g['shown_right']:.3f}, wrong "
                  f"{g['shown_wrong']:.3f}), of shown: exact match {g['exact_match_of_shown']:.3f}, edit "
                  f"similarity {g['edit_similarity_of_shown']:.3f}")
    print("degenerate (raw -> shown):", json.dumps(degenerate))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
