"""Distil a DSpark drafter (`lingls.model.dspark`, the published layout) from a frozen target: match its output
distribution and reward acceptance length.

    python -m training.draft.distill --out DIR [--seconds 600] [--device cuda] [--init DIR]

`--init DIR` starts from a DSpark-layout drafter (its config decides the widths and taps) instead of random
weights: a resumed or fine-tuned run.

Data: the same examples ling-nano was trained on (this machine's Python source, FIM and plain, `training.fim`),
packed into windows. Each step:
1. The frozen target runs the window once (full-sequence form) and gives, per position, its residual stream
   after the drafter's `target_layers` (the features) and its logits (the teacher).
2. A anchors per window are drawn; the drafter runs every block [token at a, mask_token_id x (K-1)] (embedded
   by the target) at positions a..a+K-1 against the context rows < a (one batched forward, blocks never see
   each other). Block slot i predicts position a+1+i; its logits are the target's lm_head over the drafter's
   output plus the Markov bias of the token before (the window's own token: the chain the drafter continues at
   run time is the one the target accepted, which the teacher's context also is).
3. Loss = KL(teacher || drafter) averaged over slots - lambda * E[accepted] / K, where E[accepted] =
   sum_i prod_{j<=i} alpha_j and alpha_j = sum_v min(p_v, q_v) is the probability that the standard rejection
   rule accepts slot j. The KL fits every slot; the second term weights early slots more, since a miss there
   wastes every slot after it (it is the expected accept length minus one, differentiable).
Reports the held-out KL, expected accept length and the greedy (argmax-match) accept length per eval.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lingls.model import LingForCausalLM, load_model
from lingls.model.dspark import DSparkConfig, DSparkDrafter, load_dspark, save_dspark


@dataclass
class DistillSettings:
    seq_len: int = 512
    batch_size: int = 16
    anchors: int = 16  # blocks per window
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    accept_weight: float = 1.0  # lambda
    seconds: float = 600.0
    max_steps: int | None = None
    eval_every: int = 200
    seed: int = 0


@torch.no_grad()
def teacher(target: LingForCausalLM, ids: torch.Tensor, layers: list[int]):
    """ids [B, S] -> (features [B, S, len(layers) * hidden], logits [B, S, V] fp32)."""
    h = target.model.word_embeddings(ids)
    positions = torch.arange(ids.shape[1], device=ids.device)
    kept = {}
    for i, layer in enumerate(target.decoder_layers):
        h = target._layer_full(layer, h, positions)
        if i in layers:
            kept[i] = h
    return torch.cat([kept[i] for i in layers], -1), target.head(h).float()


def draw_anchors(b: int, s: int, k: int, a: int, gen: torch.Generator, device) -> torch.Tensor:
    """[B, A] anchors in [1, S-K]: at least one context row, and the block's last target inside the window."""
    return torch.randint(1, s - k + 1, (b, a), generator=gen).to(device)


def block_logits(drafter: DSparkDrafter, target: LingForCausalLM, feats, ids, anchors, k: int) -> torch.Tensor:
    """The drafter's logits [B, A, K, V] for every block (Markov bias included)."""
    b, s = ids.shape
    a = anchors.shape[1]
    dev = ids.device
    ctx_k, ctx_v = drafter.context_kv(feats, torch.arange(s, device=dev))  # [N, B, S, H, D]
    slots = torch.arange(k, device=dev)
    positions = (anchors[..., None] + slots).reshape(b, a * k)
    block_ids = torch.where(slots == 0, ids.gather(1, anchors)[..., None], drafter.config.mask_token_id)
    x = target.model.word_embeddings(block_ids).reshape(b, a * k, -1)
    ctx_visible = torch.arange(s, device=dev) < anchors.reshape(b, a, 1, 1)  # [B, A, 1, S]
    ctx_visible = ctx_visible.expand(b, a, k, s).reshape(b, a * k, s)
    block_id = torch.arange(a * k, device=dev) // k
    own = (block_id[:, None] == block_id[None, :]).expand(b, a * k, a * k)
    h = drafter.block_hidden(x, positions, ctx_k, ctx_v, torch.cat([ctx_visible, own], -1))
    prev = ids.gather(1, positions)  # slot i follows the token at a + i
    logits = target.lm_head(h) + drafter.markov_bias(prev)
    return logits.float().view(b, a, k, -1)


def losses(teacher_logits, draft_logits, accept_weight: float):
    """(loss, metrics as detached tensors: read them only when logging). teacher/draft logits [B, A, K, V]."""
    logp = teacher_logits.log_softmax(-1)
    logq = draft_logits.log_softmax(-1)
    p = logp.exp()
    kl = (p * (logp - logq)).sum(-1).mean()
    alpha = torch.minimum(p, logq.exp()).sum(-1)  # [B, A, K] acceptance probability of each slot
    expected = alpha.cumprod(-1).sum(-1).mean()  # accepted drafts per block (sampling rule)
    k = teacher_logits.shape[-2]
    loss = kl - accept_weight * expected / k
    greedy = (teacher_logits.argmax(-1) == draft_logits.argmax(-1)).long().cumprod(-1).sum(-1).float().mean()
    return loss, {"kl": kl.detach(), "expected_accepted": expected.detach(), "greedy_accepted": greedy}


def step_batch(drafter, target, ids, settings: DistillSettings, gen, bf16: bool):
    cfg = drafter.config
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        feats, logits = teacher(target, ids, cfg.target_layer_ids)
        anchors = draw_anchors(ids.shape[0], ids.shape[1], cfg.block_size, settings.anchors, gen, ids.device)
        k = cfg.block_size
        want = logits.gather(1, (anchors[..., None] + torch.arange(k, device=ids.device)).reshape(ids.shape[0], -1)
                             [..., None].expand(-1, -1, logits.shape[-1])).view(*anchors.shape, k, -1)
        got = block_logits(drafter, target, feats, ids, anchors, k)
    return losses(want.float(), got, settings.accept_weight)


def train(target: LingForCausalLM, drafter: DSparkDrafter, windows: torch.Tensor, held: torch.Tensor,
          settings: DistillSettings, log=print) -> list[dict]:
    """windows/held: [N, seq_len] token ids. Trains `drafter` in place; returns the log records."""
    device = target.lm_head.weight.device
    bf16 = device.type == "cuda"
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    gen = torch.Generator().manual_seed(settings.seed)
    eval_gen = torch.Generator().manual_seed(settings.seed + 1)
    records, t0, step = [], time.perf_counter(), 0
    while True:
        elapsed = time.perf_counter() - t0
        done = elapsed >= settings.seconds or (settings.max_steps is not None and step >= settings.max_steps)
        if step % settings.eval_every == 0 or done:
            drafter.eval()
            with torch.no_grad():
                picks = held[torch.randperm(len(held), generator=eval_gen)[: settings.batch_size]].to(device)
                _, metrics = step_batch(drafter, target, picks, settings, eval_gen, bf16)
            drafter.train()
            records.append({"step": step, "seconds": round(elapsed, 1),
                            **{f"heldout_{k}": float(v) for k, v in metrics.items()}})
            log(json.dumps(records[-1]))
        if done:
            return records
        progress = min(1.0, elapsed / settings.seconds)
        lr = settings.lr * min(1.0, (step + 1) / settings.warmup_steps) * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = lr
        ids = windows[torch.randint(len(windows), (settings.batch_size,), generator=gen)].to(device)
        loss, _ = step_batch(drafter, target, ids, settings, gen, bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1


def windows_from(ids: list[list[int]], seq_len: int) -> torch.Tensor:
    flat = torch.tensor([t for ex in ids for t in ex], dtype=torch.long)
    n = flat.numel() // seq_len
    return flat[: n * seq_len].view(n, seq_len)


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer

    from lingls.engine.local import EMBEDDED
    from training import fla_kernels
    from training.data import collect
    from training.fim import FimMix, build_examples, encode_examples
    from training.train import torch_ops_only

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=EMBEDDED)
    ap.add_argument("--out", type=Path, required=True,
                    help="drafter directory to write (e.g. lingls/assets/ling-nano/draft)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default: the target's)")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 3 x hidden)")
    ap.add_argument("--markov-rank", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--max-train-bytes", type=int, default=50_000_000)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--accept-weight", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--init", type=Path, default=None, help="start from this DSpark-layout drafter's weights")
    ap.add_argument("--fla", action="store_true",
                    help="run the target's KDA with fla-core's chunk_kda (autotuning bounded as in training)")
    args = ap.parse_args(argv)
    torch_ops_only()  # the target runs under autocast: lingls' prefill kernels need fp32 router logits
    fla_kernels.enable(args.fla and args.device.startswith("cuda"))

    target = load_model(args.target, device=args.device, dtype=torch.float32)
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    corpus = collect(args.max_train_bytes)
    mix = FimMix()
    train_ids = encode_examples(tok, build_examples(corpus.train, 1, mix))
    held_ids = encode_examples(tok, build_examples(corpus.heldout, 2, mix))
    windows, held = windows_from(train_ids, args.seq_len), windows_from(held_ids, args.seq_len)
    settings = DistillSettings(seq_len=args.seq_len, batch_size=args.batch_size, seconds=args.seconds,
                               max_steps=args.max_steps, accept_weight=args.accept_weight, lr=args.lr,
                               eval_every=args.eval_every)
    if args.init is not None:
        drafter = load_dspark(args.init, target.config, device=args.device)
        cfg = drafter.config
    else:
        t = target.config
        heads = args.heads or t.num_attention_heads
        cfg = DSparkConfig.for_target(t, block_size=args.block_size, num_hidden_layers=args.layers,
                                      num_attention_heads=heads, num_key_value_heads=args.kv_heads or heads,
                                      head_dim=t.hidden_size // heads,
                                      intermediate_size=args.intermediate or 3 * t.hidden_size,
                                      markov_rank=args.markov_rank, confidence_head=False)
        drafter = DSparkDrafter(cfg)
        drafter.init_weights(generator=torch.Generator().manual_seed(0))
        drafter.to(args.device)
    records = train(target, drafter, windows, held, settings)
    save_dspark(drafter, args.out, dtype=torch.bfloat16)  # shipped like ling-nano: bf16
    (args.out / "distill_log.json").write_text(json.dumps({"settings": asdict(settings), "config": cfg.to_dict(),
                                                           "init": str(args.init) if args.init else None,
                                                           "train_windows": len(windows), "heldout_windows": len(held),
                                                           "log": records}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
