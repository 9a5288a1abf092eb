"""One command from nothing to the shipped ling-nano files:

    python -m training.reproduce --out DIR

data (this machine's Python source) -> tokenizer -> FIM examples -> training (GPU) -> bf16 checkpoint ->
held-out loss and the evaluation (next-line and suffix-aware cases) against both baselines and the model shipped
before -> plots -> model card. Writes DIR/ling-nano/ (what lingls/assets/ling-nano/ ships) and DIR/results/
(bench/results/nano_* and logs, with train_state.json).

    python -m training.reproduce --out DIR --resume PREV    # train on from PREV's ling-nano/ and train_state
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lingls.engine.local import has_weights
from lingls.model import LingConfig, load_model, save_checkpoint
from training import card, fla_kernels, plots
from training.baselines import NGramCompleter, repeat_previous_line
from training.data import collect, package_bytes, write_manifest
from training.evaluate import (
    MODE_NAMES,
    PROMPT_MODES,
    ModelCompleter,
    case_record,
    make_cases,
    newline_token_ids,
    postprocess,
    score,
    summary_table,
)
from training.fim import FimMix, build_examples, encode_examples
from training.licenses import package_licenses
from training.ngram import NGramModel
from training.tokenizer import SPECIAL_TOKENS, save_tokenizer, special_ids, train_tokenizer
from training.train import TrainSettings, mean_loss, torch_ops_only, train, windows_of

CONFIG = Path(__file__).parent / "configs" / "ling-nano.json"
SHIPPED = Path(__file__).resolve().parents[1] / "lingls" / "assets" / "ling-nano"  # the model to beat
TOKENIZER_SAMPLE_BYTES = 40_000_000
NGRAM_ORDERS = (3, 4, 5, 6)


def generation_config(cfg: LingConfig) -> dict:
    return {
        "eos_token_id": list(range(len(SPECIAL_TOKENS))),  # any special token ends a completion
        "pad_token_id": 0,
        "do_sample": False,
        "max_new_tokens": 64,
        "max_length": cfg.max_position_embeddings,
    }


def stream_of(tok, texts: list[str]) -> torch.Tensor:
    """Plain left-to-right ids of each text followed by <|endoftext|>, as one int16 tensor."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.int16)


def wait_for_choice(path: Path, seconds: float) -> dict:
    """The `choice` record of the throughput benchmark's JSON once the benchmark has finished (`final`); when it
    has not within `seconds`, the choice among the rows it measured so far, else {} (the torch form at the given
    batch size)."""
    end, last = time.time() + seconds, None
    while time.time() < end:
        try:
            record = json.loads(path.read_text())
            last = record["choice"]
            if record.get("final", True):
                return last
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    print(f"no final kernel choice in {path} after {seconds:.0f}s: "
          f"{'the best form measured so far' if last else 'the torch form'}", flush=True)
    return last or {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config", type=Path, default=CONFIG, help="the model's architecture (LingConfig JSON)")
    ap.add_argument("--max-train-bytes", type=int, default=320_000_000)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=TrainSettings.batch_size)
    ap.add_argument("--train-seconds", type=float, default=TrainSettings.max_seconds)
    ap.add_argument("--finish-by", type=float, default=None,
                    help="a wall-clock time (Unix seconds): train no longer than leaves --after-train seconds "
                         "before it for the evaluation and report")
    ap.add_argument("--after-train", type=float, default=150.0)
    ap.add_argument("--kernel-choice", type=Path, default=None,
                    help="JSON written by `python -m bench.train_throughput` (run alongside the data steps): "
                         "waited for before training, its `choice` gives the batch size and the KDA kernel "
                         "(fla or the torch scan)")
    ap.add_argument("--kernel-wait", type=float, default=240.0, help="seconds to wait for --kernel-choice")
    ap.add_argument("--cases-per-kind", type=int, default=300, help="next-line cases of each kind")
    ap.add_argument("--fim-cases-per-kind", type=int, default=200, help="suffix-aware cases of each kind")
    ap.add_argument("--max-new-tokens", type=int, default=40, help="per evaluated completion")
    ap.add_argument("--lr", type=float, default=TrainSettings.lr)
    ap.add_argument("--resume", type=Path, default=None,
                    help="an earlier --out DIR: train on from its ling-nano/ and results/train_state.json")
    ap.add_argument("--compare", type=Path, default=SHIPPED,
                    help="a model evaluated on the same cases, prompted as its tokenizer_config says (default: "
                         "the shipped ling-nano, read before this run replaces anything)")
    ap.add_argument("--heldout-windows", type=int, default=None,
                    help="cap on held-out windows for the loss (default: all)")
    ap.add_argument("--seed", type=int, default=TrainSettings.seed)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--eval-only", action="store_true",
                    help="keep DIR's trained model, tokenizer and training log; redo the data, evaluation and card")
    ap.add_argument("--train-only", action="store_true",
                    help="train and save the model and train_state.json, no evaluation: a segment that a later "
                         "--resume run goes on from")
    args = ap.parse_args(argv)

    torch_ops_only()
    t_start = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model_dir, res_dir = args.out / "ling-nano", args.out / "results"
    model_dir.mkdir(parents=True, exist_ok=True)
    res_dir.mkdir(parents=True, exist_ok=True)
    timings = {}

    def mark(what: str, since: float) -> float:
        timings[what] = round(time.time() - since, 1)
        print(f"[{time.time() - t_start:7.1f}s] {what}: {timings[what]}s", flush=True)
        return time.time()

    t = time.time()
    corpus = collect(args.max_train_bytes)
    write_manifest(corpus, res_dir / "data_manifest.json")
    print(json.dumps(corpus.stats), flush=True)
    t = mark("collect", t)

    cfg_dict = json.loads(args.config.read_text())
    cfg_dict["vocab_size"] = args.vocab_size
    cfg = LingConfig.from_dict(cfg_dict)
    sample, size = [], 0
    for f in corpus.train:  # the training files are in name-hash order: a spread over packages
        if size >= TOKENIZER_SAMPLE_BYTES:
            break
        sample.append(f.text)
        size += len(f.text)
    if args.resume:
        tok = Tokenizer.from_file(str(args.resume / "ling-nano" / "tokenizer.json"))
        save_tokenizer(tok, model_dir, cfg.max_position_embeddings)
    elif args.eval_only:
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    else:
        tok = train_tokenizer(sample, args.vocab_size)
        save_tokenizer(tok, model_dir, cfg.max_position_embeddings)
    assert special_ids(tok) == {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    t = mark("tokenizer", t)

    examples = build_examples(corpus.train, args.seed, FimMix())
    ids = encode_examples(tok, examples)
    stream = torch.tensor([i for ex in ids for i in ex], dtype=torch.int16)
    heldout_stream = stream_of(tok, [f.text for f in corpus.heldout])
    t = mark("encode", t)
    print(f"training stream {stream.numel()} tokens, held-out {heldout_stream.numel()}", flush=True)

    if not args.train_only:  # the baseline counts the very token stream the model trains on
        ngram = NGramModel.train(stream, max(NGRAM_ORDERS), device=args.device)
        t = mark("ngram", t)

    batch_size, kda, compiled, compiled_ce, kernel_route = args.batch_size, "scan", False, True, False
    if args.kernel_choice is not None:
        choice = wait_for_choice(args.kernel_choice, args.kernel_wait)
        batch_size, kda = choice.get("batch", batch_size), choice.get("kda", kda)
        compiled = choice.get("compile", False) and args.device.startswith("cuda")
        compiled_ce, kernel_route = choice.get("compile_ce", True), choice.get("kernel_route", False)
        t = mark("kernel_choice_wait", t)
    fla = fla_kernels.enable(kda == "fla" and args.device.startswith("cuda"))
    print(f"training batch {batch_size}, KDA kernel: {'fla-core chunk_kda' if fla else 'torch scan'}, "
          f"layers {'compiled' if compiled else 'eager'}", flush=True)
    train_seconds = args.train_seconds
    if args.finish_by is not None:
        train_seconds = max(10.0, min(train_seconds, args.finish_by - args.after_train - time.time()))
    settings = TrainSettings(batch_size=batch_size, max_seconds=train_seconds, seed=args.seed, lr=args.lr,
                             compile=compiled, compile_ce=compiled_ce, kernel_route=kernel_route)
    compare = None
    # loaded now: --out may be its own dir; the shipped model's weights are packed (lingls.model.packed)
    if args.compare and not args.train_only and has_weights(args.compare):
        compare = (load_model(args.compare, device=args.device, dtype=torch.float32),
                   Tokenizer.from_file(str(args.compare / "tokenizer.json")),
                   json.loads((args.compare / "tokenizer_config.json").read_text()).get("completion_prompt", "psm"))
    if args.eval_only:  # the training summary the run wrote (train_summary.json), else its finished evaluation's
        done = res_dir / "train_summary.json"
        summary = (json.loads(done.read_text()) if done.is_file()
                   else json.loads((res_dir / "nano_eval.json").read_text())["training"])
        timings["train"] = summary["segment_seconds"]
    else:
        init, resume = None, None
        if args.resume:
            init = load_model(args.resume / "ling-nano", device=args.device, dtype=torch.float32)
            resume = json.loads((args.resume / "results" / "train_state.json").read_text())
            log = args.resume / "results" / "train_log.jsonl"
            if log.resolve() != (res_dir / "train_log.jsonl").resolve():
                (res_dir / "train_log.jsonl").write_bytes(log.read_bytes())
        model, summary = train(cfg, stream, heldout_stream, settings, res_dir / "train_log.jsonl", device=args.device,
                               init=init, resume=resume)
        summary["kda_kernel"] = "fla-core chunk_kda" if fla else "torch chunked (parallel-scan carry)"
        summary["layers"] = "torch.compile (training.train.compile_for_training)" if compiled else "eager"
        summary["routing"] = "routing kernel (training.train.route_by_kernel)" if kernel_route else "torch"
        (res_dir / "train_state.json").write_text(json.dumps(summary["state"], indent=1) + "\n")
        (res_dir / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        t = mark("train", t)
        save_checkpoint(model, model_dir, dtype=torch.bfloat16)
        (model_dir / "generation_config.json").write_text(json.dumps(generation_config(cfg), indent=2) + "\n")
        del model
        if args.train_only:
            return 0
    # evaluation in the torch form: its batches shrink step by step, and fla's kernels re-tune for each new batch
    # size (with them, and the drafter distilling beside it, an evaluation did not finish in 160 s on an H200)
    fla_kernels.enable(False)
    shipped = load_model(model_dir, device=args.device, dtype=torch.float32)
    held_windows = windows_of(heldout_stream, settings.seq_len)[: args.heldout_windows]
    held_loss, held_mtp = mean_loss(shipped, held_windows, 16, args.device, bf16=False, with_mtp=True)
    t = mark("heldout_loss", t)

    cases = make_cases(corpus.heldout, args.cases_per_kind, args.seed, fim_per_kind=args.fim_cases_per_kind)
    raw, model_seconds = {}, {}
    for mode in PROMPT_MODES:
        t_mode = time.time()
        raw[f"ling-nano ({MODE_NAMES[mode]})"] = ModelCompleter(shipped, tok, args.device, mode,
                                                                 max_new_tokens=args.max_new_tokens).complete_all(cases)
        model_seconds[mode] = round(time.time() - t_mode, 1)
    if compare is not None:
        old, old_tok, old_mode = compare
        t_mode = time.time()
        raw[f"shipped before ({MODE_NAMES[old_mode]})"] = ModelCompleter(
            old, old_tok, args.device, old_mode, max_new_tokens=args.max_new_tokens).complete_all(cases)
        model_seconds["shipped_before"] = round(time.time() - t_mode, 1)
        del old, compare
    raw["repeat previous line"] = [repeat_previous_line(c.prefix) for c in cases]
    newline_ids = newline_token_ids(tok)
    ngram_scores = {}
    for order in NGRAM_ORDERS:
        ngram.order = order
        completer = NGramCompleter(ngram, tok, newline_ids, set(range(len(SPECIAL_TOKENS))))
        p, _, _ = postprocess(cases, [completer.complete(c.prefix) for c in cases])
        ngram_scores[order] = (score(cases, p), p)
    best = max(ngram_scores, key=lambda o: ngram_scores[o][0]["all"]["edit_similarity"])
    ngram.order = best
    completer = NGramCompleter(ngram, tok, newline_ids, set(range(len(SPECIAL_TOKENS))))
    raw[f"token {best}-gram"] = [completer.complete(c.prefix) for c in cases]
    preds, degenerate = {}, {}
    for name, lines in raw.items():
        preds[name], before, after = postprocess(cases, lines)
        degenerate[name] = {"raw": before, "shown": after}
    results = {name: score(cases, p) for name, p in preds.items()}
    lingls_mode = max(PROMPT_MODES, key=lambda m: results[f"ling-nano ({MODE_NAMES[m]})"]["all"]["edit_similarity"])
    config_path = model_dir / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "completion_prompt": lingls_mode},
                                      indent=2) + "\n")
    t = mark("evaluate", t)

    n_params = sum(p.numel() for p in shipped.parameters())
    weights_bytes = (model_dir / "model.safetensors").stat().st_size
    report = {
        "model": "ling-nano",
        "machine": {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "config": cfg.to_dict(),
        "parameters": n_params,
        "weights_bytes": weights_bytes,
        "data": {**corpus.stats, "training_stream_tokens": stream.numel(),
                 "heldout_tokens": heldout_stream.numel(), "bytes_per_token_heldout":
                     round(sum(len(f.text) for f in corpus.heldout)
                           / max(1, heldout_stream.numel() - len(corpus.heldout)), 3)},
        "training": summary,
        "heldout": {"loss_nats_per_token": round(held_loss, 4), "mtp_loss_nats_per_token": round(held_mtp, 4),
                    "windows": len(held_windows), "seq_len": settings.seq_len,
                    "note": "shipped bf16 weights computed in fp32, plain left-to-right held-out files"},
        "evaluation": {"cases_per_kind": args.cases_per_kind, "fim_cases_per_kind": args.fim_cases_per_kind,
                       "results": results, "degenerate": degenerate,
                       "ngram_by_order": {str(o): s for o, (s, _) in ngram_scores.items()},
                       "model_eval_seconds": model_seconds, "lingls_mode": lingls_mode,
                       "max_new_tokens": args.max_new_tokens,
                       "prompt": "last 768 prefix tokens (the last one healed), first 256 suffix tokens; "
                                 "greedy, cut at the first newline, then lingls' one-line post-processing"},
        "timings_seconds": timings,
        "samples": [case_record(c, {n: p[i] for n, p in preds.items()}) for kind in {c.kind: 0 for c in cases}
                    for i, c in [(i, c) for i, c in enumerate(cases) if c.kind == kind][:8]],
    }
    report["timings_seconds"]["total"] = round(sum(timings.values()), 1)  # --eval-only: with the earlier training
    (res_dir / "nano_eval.json").write_text(json.dumps(report, indent=1) + "\n")
    plots.training_curve(res_dir / "train_log.jsonl", res_dir / "nano_training_curve.png",
                         f"ling-nano: {n_params / 1e6:.1f}M parameters, {summary['train_tokens'] / 1e6:.0f}M tokens")
    plots.eval_chart(results, res_dir / "nano_eval.png")
    (model_dir / "training_curve.png").write_bytes((res_dir / "nano_training_curve.png").read_bytes())
    licenses = package_licenses(list(package_bytes(corpus.train)) + corpus.stats["heldout_packages"])
    (res_dir / "data_licenses.json").write_text(json.dumps(licenses, indent=1) + "\n")
    draft_log = model_dir / "draft" / "distill_log.json"  # a drafter distilled earlier (training.draft.distill)
    (model_dir / "MODEL_CARD.md").write_text(card.model_card(
        report, package_bytes(corpus.train), licenses,
        json.loads(draft_log.read_text()) if draft_log.is_file() else None, card.segments(res_dir / "train_log.jsonl")))
    mark("report", t)
    print(summary_table(results), flush=True)
    print("degenerate completions (raw -> shown):", json.dumps(degenerate), flush=True)
    print(json.dumps({"heldout": report["heldout"], "training": summary, "timings": timings}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
