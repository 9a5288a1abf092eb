"""MODEL_CARD.md for the shipped ling-nano, written from the numbers the reproduce run measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from training.evaluate import MODE_NAMES, summary_table
from training.fim import FimMix
from training.tokenizer import SPECIAL_TOKENS


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _verdict(results: dict, used: str) -> str:
    """One honest sentence: does ling-nano, prompted the way lingls prompts it, beat the baselines and the model
    shipped before on both metrics (next-line cases)?"""
    nano = results[used]["next_line"]
    others = {k: v["next_line"] for k, v in results.items() if not k.startswith("ling-nano")}
    lost = [f"{metric.replace('_', ' ')} vs {name}" for name, m in others.items()
            for metric in ("exact_match", "edit_similarity") if nano[metric] <= m[metric]]
    if not lost:
        return f"**{used} beats every other predictor here on both next-line metrics.**"
    return (f"**{used} does not beat the baselines yet** (not better on: " + ", ".join(lost) +
            "). The weights ship so that lingls has a real model of the right architecture and format; a longer "
            "run should replace them.")


def _mfu(tr: dict) -> str:
    if not tr.get("mfu"):
        return "unknown"
    return f"{tr['mfu']:.1%} of {tr['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16"


def _before(ev: dict) -> str:
    """What the `shipped before` rows are, where the run had the model it replaces at hand (--compare)."""
    if not any(name.startswith("shipped before") for name in ev["results"]):
        return (" The model it replaces was not at hand in the run (its weights did not travel with it); "
                "docs/training-log.md compares the two.")
    return " `shipped before` is the ling-nano this one replaces, prompted as its card said, on the same cases."


def _init(log: dict) -> str:
    return f", starting from the weights of an earlier distillation (`--init {log['init']}`)" if log.get("init") else ""


def draft_section(log: dict) -> str:
    """The drafter's part of the card, from the `distill_log.json` that training.draft.distill writes."""
    cfg, st, last = log["config"], log["settings"], log["log"][-1]
    dflash = cfg["dflash_config"]
    return f"""## Draft model (`draft/`)
A DSpark drafter for speculative decoding (`lingls serve --draft lingls/assets/ling-nano/draft`), in the published
Ling-3.0-flash-DSpark layout: {cfg['num_hidden_layers']} attention layers of width {cfg['hidden_size']} that read
ling-nano's residual stream after layers {dflash['target_layer_ids']} and draft a block of {cfg['block_size']}
tokens in one forward (anchor token + mask tokens), through ling-nano's own embedding and lm_head, plus a
rank-{dflash['markov_rank']} Markov bias from the previous token. Distilled from the frozen ling-nano by \
`python -m training.draft.distill` for
{last['seconds']:.0f} s ({last['step']} steps of {st['batch_size']} windows of {st['seq_len']} tokens,
{st['anchors']} blocks each, peak learning rate {st['lr']}){_init(log)} on the same training files.
Loss = KL(ling-nano || drafter) per block slot
- {st['accept_weight']} x the expected accepted length / K, where the expected length sums, over the slots, the
product of the per-slot probabilities that the rejection rule accepts (sum_v min(p_v, q_v)): early slots
weigh more, since a miss there wastes every slot after it. Held-out at the end: KL {last['heldout_kl']:.3f},
expected accepted drafts per block {last['heldout_expected_accepted']:.2f}, greedy (argmax agrees) accepted
{last['heldout_greedy_accepted']:.2f}. bf16 weights; `distill_log.json` has the whole curve.
"""


def segments(log_path: Path) -> list[dict]:
    """The training run's segments (one per reproduce call; a resumed call is a new one) from its log: each one's
    seconds, tokens and peak learning rate."""
    out, start, peak = [], {"tokens": 0, "seconds": 0.0}, 0.0
    for line in log_path.read_text().splitlines() if log_path.is_file() else []:
        rec = json.loads(line)
        if rec.get("final"):
            out.append({"seconds": rec["seconds"] - start["seconds"], "tokens": rec["tokens"] - start["tokens"],
                        "lr": rec.get("peak_lr", peak)})  # older logs: the highest logged rate
            start, peak = rec, 0.0
        else:
            peak = max(peak, rec.get("lr", 0.0))
    return out


def _schedule(s: dict, runs: list[dict]) -> str:
    per = (f"linear warm-up over {s['warmup']:.0%} of a segment then cosine to {s['min_lr_ratio']}x, on the segment's "
           "time budget")
    if len(runs) < 2:
        return (f"peak learning rate {s['lr']}, linear warm-up over {s['warmup']:.0%} of the run then cosine to "
                f"{s['min_lr_ratio']}x (the schedule runs on the {s['max_seconds']:.0f} s time budget)")
    parts = ", then ".join(f"{r['seconds']:.0f} s ({r['tokens'] / 1e6:.0f}M tokens) at peak learning rate "
                           f"{r['lr']:.2g}" for r in runs)
    return (f"{len(runs)} segments, one per GPU call, each resumed from the one before's bf16 weights with fresh "
            f"AdamW moments: {parts}; {per}")


def model_card(report: dict, package_bytes: dict[str, int], licenses: dict[str, dict],
               draft_log: dict | None = None, runs: list[dict] | None = None) -> str:
    """The card's markdown; `runs`: the training's segments (`segments`), for a run resumed across calls."""
    cfg, data, tr, held, ev = (report["config"], report["data"], report["training"], report["heldout"],
                               report["evaluation"])
    s = tr["settings"]
    layers = ", ".join(f"{i}:{'KDA' if t == 'linear_attention' else 'MLA'}/{m}"
                       for i, (t, m) in enumerate(zip(cfg["layer_types"], cfg["mlp_layer_types"])))
    top = list(package_bytes.items())[:40]
    lic_rows = "\n".join(f"| {k} | {_mb(v)} | {licenses.get(k, {}).get('distribution', '?')} | "
                         f"{licenses.get(k, {}).get('license', '?')} |" for k, v in top)
    ngram_rows = "\n".join(f"| {o} | {r['all']['exact_match']:.3f} | {r['all']['edit_similarity']:.3f} |"
                           for o, r in ev["ngram_by_order"].items())
    used = f"ling-nano ({MODE_NAMES[ev['lingls_mode']]})"
    verdict = _verdict(ev["results"], used)
    mix = FimMix()
    specials = ", ".join(f"`{t}` = {i}" for i, t in enumerate(SPECIAL_TOKENS))
    return f"""# ling-nano

The model lingls runs when nothing else is configured: a {report['parameters'] / 1e6:.1f}M-parameter model with the
Ling-3.0 (`bailing_hybrid`) architecture, trained from scratch by this project on Python source, for
fill-in-the-middle code completion on a laptop CPU. It is small and was trained for minutes; the evaluation below
says how it compares with two simple baselines. It is no substitute for a real Ling-3.0 model (configure
`endpoint` or `--model` for that).

## Files
| file | what |
|---|---|
| config.json | official Ling-3.0 config keys (`LingConfig.from_json`) |
| model.safetensors.zlib | bf16 weights ({_mb(report['weights_bytes'])}), packed (`lingls.model.packed`), official \
tensor names, MTP layer at \
`model.layers.{cfg['num_hidden_layers']}` |
| tokenizer.json, tokenizer_config.json | byte-level BPE, {cfg['vocab_size']} tokens; the config names the FIM tokens |
| generation_config.json | greedy; any special token ends a completion |
| training_curve.png | the training curve below |

## Architecture
hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers ({layers}), {cfg['num_attention_heads']} heads,
KDA head size {cfg['head_dim']}, MLA kv_lora_rank {cfg['kv_lora_rank']} (nope {cfg['qk_nope_head_dim']} + rope
{cfg['qk_rope_head_dim']}, v {cfg['v_head_dim']}), dense MLP {cfg['intermediate_size']}, \
MoE {cfg['num_experts']} experts
of width {cfg['moe_intermediate_size']} + {cfg['num_shared_experts']} shared, top-{cfg['num_experts_per_tok']} with
grouped routing ({cfg['n_group']} groups, top {cfg['topk_group']}), sigmoid router with expert bias, one MTP layer
(MLA + MoE), untied lm_head, vocab {cfg['vocab_size']}, trained context {s['seq_len']} tokens.
{report['parameters']:,} parameters.

## Prompt format
Special tokens: {specials}.
- PSM: `<|fim_prefix|>{{prefix}}<|fim_suffix|>{{suffix}}<|fim_middle|>` -> the model writes the middle, \
then `<|endoftext|>`.
- SPM (also trained): `<|fim_suffix|>{{suffix}}<|fim_prefix|>{{prefix}}<|fim_middle|>`.
- Context from other files may precede either: `<|file_sep|>{{path}}\\n{{text}}\\n` per file, then
  `<|file_sep|>{{current path}}\\n` (the layout lingls.lsp.prompt builds).
- Plain left-to-right text also works ({1 - mix.fim_rate:.0%} of the training examples were plain).

## Data
Python source found on the training machine: the standard library and the installed site-packages
({data['files_found']:,} `.py` files found; files over 256 kB, generated-looking files and files that spell a special
token were skipped). The held-out set is whole packages, so the evaluation measures code the model never saw in
any form: {len(data['heldout_packages'])} packages of 20-800 kB taken in the order of a hash of their name
({', '.join(p.split(':')[1] for p in data['heldout_packages'])}). Training files whose content equals a held-out
file's (after whitespace normalisation) were dropped ({data['dropped_as_copy_of_heldout']}), and so were files that
look like vendored copies of a held-out package ({data['dropped_as_vendored_heldout_package']}); training files were
deduplicated by content ({data['dropped_as_duplicate']} dropped); no package fills more than 12% of the training
bytes. Training set: {data['train_files']:,} files, {_mb(data['train_bytes'])},
{data['training_stream_tokens']:,} tokens as FIM/plain examples. Held-out set: {data['heldout_files']} files,
{data['heldout_tokens']:,} tokens. {mix.fim_rate:.0%} of the examples are FIM ({mix.spm_rate:.0%} SPM, \
{1 - mix.spm_rate:.0%} PSM; {mix.line_rate:.0%} of the middles run from a cursor to the end of a line or a few lines,
{mix.inline_rate:.0%} end inside the cursor's
line, before its closing punctuation or at a later column, the rest are random spans; no middle is empty; the
suffix is the rest of the cursor's line and {mix.suffix_lines[0]}-{mix.suffix_lines[1]} whole lines,
at most {mix.suffix_chars:,} characters, as lingls' prompt cuts it), the rest plain text.

## Training
On {report['machine']['device']} (torch {report['machine']['torch']}): {tr['steps']} steps of \
{s['batch_size']} x {s['seq_len']}
tokens, {tr['train_tokens'] / 1e6:.0f}M tokens ({tr['epochs_over_data']} passes over the examples) in
{tr['train_seconds']:.0f} s ({tr['tokens_per_second']:,} tokens/s, \
{tr['model_flops_per_token'] / 1e6:.0f} MFLOP of model work per
token: {_mfu(tr)} model FLOPs utilisation; KDA by {tr.get('kda_kernel', 'the torch chunked form')});
stopped by {tr['stopped_by']}. AdamW (betas 0.9/0.95,
weight decay {s['weight_decay']}), {_schedule(s, runs or [])}, \
gradient clip {s['grad_clip']}, bf16 autocast, seed {s['seed']}. Loss = next-token cross-entropy +
{s['mtp_weight']} x MTP cross-entropy (token after next). MoE balance without an auxiliary loss: after each step every
expert's selection bias moves by {s['bias_rate']} towards the mean load. Whole reproduce run (data, tokenizer,
training, evaluation; the sum of its stages): {report['timings_seconds']['total']:.0f} s.

![training curve](training_curve.png)

## Evaluation
Held-out loss (shipped bf16 weights, fp32 compute, {held['windows']} windows of {held['seq_len']} tokens, plain text):
**{held['loss_nats_per_token']:.3f} nats/token** (about {data['bytes_per_token_heldout']} bytes per token); MTP layer
(token after next): {held['mtp_loss_nats_per_token']:.3f}.

Completion on the held-out packages, the same cases for every predictor: next-line, {ev['cases_per_kind']} cursors
of each kind (`line_start`: cursor after the line's indentation, expected completion = the line's code;
`mid_line`: cursor at a random column inside the code, expected = the rest of the line), and suffix-aware,
{ev['fim_cases_per_kind']} of each kind, where the code after the cursor says what belongs there (`block_middle`: a
line in the middle of an indented block; `arg_list`: the cursor just after an opening bracket whose closing
bracket is typed, expected = what is between them; `line_end_typed`: the line's closing punctuation is typed,
the cursor at a random column before it). ling-nano is prompted three ways: PSM
and SPM (last 768 prefix tokens, first 256 suffix tokens) and the prefix alone, left to right; always with token
healing (the prefix's last token, or the half-typed word at the cursor with the whitespace before it, is dropped
and the completion must agree with its text until a token covers it, because a cursor after indentation or inside
a word cuts the text where the tokenizer would not); greedy, cut at the
first newline; then, for every predictor, lingls' own one-line post-processing (the degeneration guard, the end
that repeats the text after the cursor dropped). lingls prompts it the way that scored best here over all cases:
**{MODE_NAMES[ev['lingls_mode']]}** (`completion_prompt` in tokenizer_config.json).{_before(ev)} \
Baselines: the previous non-blank line
(minus what was typed), and a token n-gram model counted over the same training token stream \
(greedy with backoff and token
healing; the best order on these cases is shown). Exact match compares after stripping trailing whitespace; edit
similarity is rapidfuzz's normalised Indel similarity.

{summary_table(ev['results'])}

{verdict}

Degenerate completions (a repeated line or a looping unit), raw model line -> what lingls shows:
{', '.join(f"{k}: {v['raw']} -> {v['shown']}" for k, v in ev['degenerate'].items())}.

n-gram order vs score (all cases):

| order | exact match | edit similarity |
|---|---|---|
{ngram_rows}

## On a CPU
lingls runs this model in fp32 on one torch thread (`LINGLS_THREADS` to change) through `lingls.runtime.cpu_step`:
a decode step, and the few tokens a one-line edit re-prefills after prefix reuse, in a few large torch ops per
layer, each token handed over as soon as its step returns. `lingls bench prefix --model nano` times the first
token after a one-line edit and a whole one-line completion at the 1,536-token prompt budget, through the runner
and through the engine the language server uses; docs/performance.md has the figures.

{draft_section(draft_log) if draft_log else ""}
## License notes on the data
The weights were trained on source code that carries its own licenses. The Python standard library is under the
PSF License Agreement. Each site-packages package is under its own license, as its distribution metadata states;
the largest contributors to the training bytes:

| package | training bytes | distribution | license (from metadata) |
|---|---|---|---|
{lic_rows}

## Reproduce
`python -m training.reproduce --out DIR` on a machine with a CUDA GPU (training/README.md); it writes this
directory's files under DIR/ling-nano and the evaluation under DIR/results.
"""


def render(out: Path) -> str:
    """The card for a reproduce run's directory (DIR/results, DIR/ling-nano), from what it wrote: for a drafter
    distilled after the run wrote its card."""
    res, model = out / "results", out / "ling-nano"
    draft_log = model / "draft" / "distill_log.json"
    return model_card(json.loads((res / "nano_eval.json").read_text()),
                      json.loads((res / "data_manifest.json").read_text())["train_package_bytes"],
                      json.loads((res / "data_licenses.json").read_text()),
                      json.loads(draft_log.read_text()) if draft_log.is_file() else None,
                      segments(res / "train_log.jsonl"))


if __name__ == "__main__":  # python -m training.card DIR: rewrite DIR/ling-nano/MODEL_CARD.md
    (Path(sys.argv[1]) / "ling-nano" / "MODEL_CARD.md").write_text(render(Path(sys.argv[1])))
