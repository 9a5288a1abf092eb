"""The training curve, the evaluation chart and the confidence gate's chart (PNG, matplotlib's headless backend)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def training_curve(log_path: Path, out: Path, title: str) -> None:
    recs = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "loss" in r]
    tok = [r["tokens"] / 1e6 for r in recs]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(tok, [r["loss"] for r in recs], label="train: next token")
    ax.plot(tok, [r["mtp_loss"] for r in recs], label="train: MTP (token after next)", alpha=0.8)
    held = [(r["tokens"] / 1e6, r["heldout_loss"]) for r in recs if "heldout_loss" in r]
    if held:
        ax.plot(*zip(*held), "o-", label="held-out files: next token")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(top=min(6.0, max(r["loss"] for r in recs)))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    ax2.plot(tok, [r["expert_max_over_mean"] for r in recs], color="tab:purple")
    ax2.set_xlabel("training tokens (millions)")
    ax2.set_ylabel("busiest expert's load / mean load")
    ax2.set_title("MoE balance (bias-based, no aux loss)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def eval_chart(results: dict, out: Path) -> None:
    """Grouped bars: predictor x case kind, for exact match and edit similarity."""
    names = list(results)
    kinds = [k for k in ("line_start", "mid_line", "next_line", "block_middle", "arg_list", "line_end_typed", "fim")
             if all(k in r for r in results.values())]
    fig, axes = plt.subplots(2, 1, figsize=(13, 8))
    width = 0.8 / len(names)
    for ax, metric in zip(axes, ("exact_match", "edit_similarity")):
        for j, name in enumerate(names):
            vals = [results[name][k][metric] for k in kinds]
            ax.bar([i + j * width for i in range(len(kinds))], vals, width, label=name)
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(kinds))], kinds)
        ax.set_title(metric.replace("_", " "))
        ax.set_ylim(0, 1)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle("completion on held-out packages: next-line and suffix-aware (FIM) cases")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def gate_chart(gate: dict, out: Path, title: str) -> None:
    """A row per predictor and case group (next-line, suffix-aware), over the gate's bars: the share of cursors
    shown right and shown wrong (left), and exact match and edit similarity over the shown lines (right); `gate`
    is heldout_cpu's report["gate"]."""
    rows = [(name, group, by_bar) for name, by_group in gate.items() for group, by_bar in by_group.items()]
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 3.6 * len(rows)), squeeze=False)
    for (ax, ax2), (name, group, by_bar) in zip(axes, rows):
        bars = list(by_bar)
        x = range(len(bars))
        labels = ["no gate" if float(b) == 0 else f">= {float(b):g}" for b in bars]
        ax.bar([i - 0.2 for i in x], [by_bar[b]["shown_right"] for b in bars], 0.4, label="shown, right")
        ax.bar([i + 0.2 for i in x], [by_bar[b]["shown_wrong"] for b in bars], 0.4, label="shown, wrong")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel(f"{group}: share of cursors")
        ax.set_title(f"{name}, {group.replace('_', '-')} cursors")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
        ax2.plot(labels, [by_bar[b]["exact_match_of_shown"] for b in bars], "o-", label="exact match")
        ax2.plot(labels, [by_bar[b]["edit_similarity_of_shown"] for b in bars], "s-", label="edit similarity")
        ax2.set_ylabel("over the lines shown")
        ax2.set_ylim(0, 1)
        ax2.legend()
        ax2.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("line probability shown at")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
