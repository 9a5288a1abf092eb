"""A reproduce run's model against the shipped one on a CPU, on the held-out packages that run named.

    python -m training.heldout_cpu --run DIR [--compare lingls/assets/ling-nano] [--next-line 50] [--fim 30]

For a run whose GPU command ran out of time before its evaluation: DIR holds its ling-nano/ and
results/data_manifest.json. The held-out set is rebuilt from this machine's Python source, restricted to the
packages the run held out (so neither their files nor vendored copies were in its training data; the versions
here may differ from the GPU image's), deduplicated by content, and cased as `training.evaluate` cases it (same
kinds, same post-processing and metrics). Completion runs at batch 1 with the model's recurrent/KV state (a
prefill, then one token per step), which a CPU can afford where the GPU evaluation's re-run of the whole window
per token cannot. The token n-gram baseline is left out (it counts the whole training stream). Held-out loss is
over the first windows of the plain held-out text, per token (each model's own tokenizer) and per byte.
Writes DIR/results/heldout_cpu.json and prints the summary table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lingls.engine.healing import strip_tail
from lingls.engine.local import EMBEDDED
from lingls.model import load_model
from lingls.runtime.cpu_step import CpuStep
from training.baselines import repeat_previous_line
from training.data import content_key, iter_files, source_roots
from training.evaluate import (
    MODE_NAMES,
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
            generated, text, pos = [], "", len(ids)
            for _ in range(self.max_new):
                token = int(logits.argmax())
                if token < len(SPECIAL_TOKENS):
                    break
                generated.append(token)
                text = strip_tail(self.tok.decode(generated), tail)
                if "\n" in text:
                    break
                h, normed = fast.step(torch.tensor([token]), state, torch.tensor([pos]), kv_len=pos + 1, normed=True)
                logits = fast.head(h, normed)[0].float()
                pos += 1
            texts.append(text)
        return texts


def heldout_files(manifest: dict) -> list:
    packages = set(manifest["stats"]["heldout_packages"])
    files, keys = [], set()
    for f in iter_files(source_roots()):
        if f.package in packages and (k := content_key(f.text)) not in keys:
            keys.add(k)
            files.append(f)
    return files


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


def write_report(args, files, cases, raw: dict, losses: dict, seconds: dict) -> tuple[dict, dict]:
    raw = {**raw, "repeat previous line": [repeat_previous_line(c.prefix) for c in cases]}
    preds, degenerate = {}, {}
    for name, lines in raw.items():
        preds[name], before, after = postprocess(cases, lines)
        degenerate[name] = {"raw": before, "shown": after}
    results = {name: score(cases, p) for name, p in preds.items()}
    report = {"run": str(args.run), "compare": str(args.compare), "heldout_files_here": len(files),
              "max_new_tokens": args.max_new_tokens,
              "cases_per_kind": {"next_line": args.next_line, "fim": args.fim}, "results": results,
              "degenerate": degenerate, "heldout_loss": losses, "seconds": seconds,
              "samples": [case_record(c, {n: p[i] for n, p in preds.items()}) for i, c in enumerate(cases)]}
    (args.run / "results" / "heldout_cpu.json").write_text(json.dumps(report, indent=1) + "\n")
    return results, degenerate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a reproduce --out DIR")
    ap.add_argument("--compare", type=Path, default=EMBEDDED)
    ap.add_argument("--next-line", type=int, default=50, help="cases of each next-line kind")
    ap.add_argument("--fim", type=int, default=30, help="cases of each suffix-aware kind")
    ap.add_argument("--modes", default="prefix,spm", help="the run's model's prompt modes (psm, spm, prefix)")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows of 2048 tokens for the loss")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    manifest = json.loads((args.run / "results" / "data_manifest.json").read_text())
    files = heldout_files(manifest)
    cases = make_cases(files, args.next_line, args.seed, fim_per_kind=args.fim)
    print(f"{len(files)} held-out files here, {len(cases)} cases", flush=True)
    cmp_mode = json.loads((args.compare / "tokenizer_config.json").read_text()).get("completion_prompt", "psm")
    modes = args.modes.split(",")
    # the model's first mode, then the shipped model, then the model's other modes: the main comparison first,
    # and the JSON rewritten after each run, so an interrupted run still leaves what it finished
    runs = [("ling-nano", args.run / "ling-nano", modes[0]), ("shipped before", args.compare, cmp_mode)]
    runs += [("ling-nano", args.run / "ling-nano", m) for m in modes[1:]]
    raw, seconds, losses, loaded = {}, {}, {}, {}
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
        raw[name] = StatefulCompleter(model, tok, "cpu", mode, max_new_tokens=args.max_new_tokens).complete_all(cases)
        seconds[name] = round(time.time() - t, 1)
        print(f"{name}: {seconds[name]}s", flush=True)
        results, degenerate = write_report(args, files, cases, raw, losses, seconds)
    print(summary_table(results))
    print("degenerate (raw -> shown):", json.dumps(degenerate))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
