"""Train a Ling-3.0-architecture model (lingls.model) on a packed token stream.

Loss = next-token cross-entropy + `mtp_weight` * the MTP layer's cross-entropy for the token after next.
MoE balance is aux-loss-free, as in Ling/DeepSeek-V3: a forward hook on every router (`mlp.gate`) counts how
many tokens each expert received; after each optimizer step every expert's selection bias moves by
`bias_rate` towards the mean load (up when under-used, down when over-used). The bias only changes which
experts are chosen, never their weights, so no gradient flows through it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lingls.model import LingConfig, LingForCausalLM


@dataclass(frozen=True)
class TrainSettings:
    seq_len: int = 2048
    batch_size: int = 32
    steps: int = 100_000
    max_seconds: float = 300.0  # the schedule runs on whichever of steps and seconds runs out first
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: float = 0.03  # share of the schedule spent warming up
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    bias_rate: float = 1e-3
    eval_seconds: float = 30.0  # held-out probe loss at the first log step after this many seconds
    log_every: int = 10
    seed: int = 1234
    tf32: bool = True  # TF32 for the fp32 matmuls left under autocast (the chunked KDA's): bench/train_throughput.py


class PackedStream:
    """Non-overlapping windows of seq_len + 1 tokens over one long stream, visited in a seeded shuffled order."""

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int):
        self.stream, self.seq_len = stream, seq_len
        n = (stream.numel() - 1) // seq_len
        if n < 1:
            raise ValueError(f"stream of {stream.numel()} tokens is shorter than one window of {seq_len + 1}")
        self.starts = torch.arange(n, device=stream.device) * seq_len
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.pos, self.epochs = torch.randperm(n, generator=self.gen), 0, 0
        self.offsets = torch.arange(seq_len + 1, device=stream.device)

    def __len__(self) -> int:
        return self.starts.numel()

    def batch(self, size: int) -> torch.Tensor:
        picks = []
        while len(picks) < size:
            if self.pos == len(self.order):
                self.order, self.pos = torch.randperm(len(self), generator=self.gen), 0
                self.epochs += 1
            take = min(size - len(picks), len(self.order) - self.pos)
            picks.extend(self.order[self.pos:self.pos + take].tolist())
            self.pos += take
        starts = self.starts[torch.tensor(picks, device=self.starts.device)]
        return self.stream[starts[:, None] + self.offsets].long()


class ExpertBalancer:
    """Counts expert load through router hooks and nudges each router's expert_bias towards balance."""

    def __init__(self, model: LingForCausalLM, rate: float):
        self.rate = rate
        self.routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
        self.counts = [torch.zeros_like(r.expert_bias) for r in self.routers]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(module, inputs, output):
            _, idx = output
            self.counts[i] += torch.bincount(idx.flatten(), minlength=self.counts[i].numel()).float()
        return hook

    @torch.no_grad()
    def update(self) -> float:
        """Apply the bias step; returns the mean over routers of max load / mean load since the last update."""
        ratios = []
        for router, c in zip(self.routers, self.counts):
            mean = c.mean()
            if mean > 0:
                router.expert_bias += self.rate * torch.sign(mean - c)
                ratios.append(c.max() / mean)
            c.zero_()
        return float(torch.stack(ratios).mean()) if ratios else 1.0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def lr_at(progress: float, s: TrainSettings) -> float:
    """Linear warm-up, then cosine from `lr` to `min_lr_ratio * lr`, over progress in [0, 1].

    Progress is max(step / steps, seconds / max_seconds): the step rate of the GPU code is not known in
    advance, so the time budget fixes the schedule and the decay always completes.
    """
    if progress < s.warmup:
        return s.lr * max(progress / s.warmup, 1e-3)
    x = min(1.0, (progress - s.warmup) / (1 - s.warmup))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * x)))


def losses(model: LingForCausalLM, x: torch.Tensor, with_mtp: bool = True):
    """x: [B, T+1] ids -> (next-token loss, MTP loss or None)."""
    inp, tgt = x[:, :-1], x[:, 1:]
    h = model.hidden(inp)
    logits = model.head(h)
    main = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
    if not with_mtp or not model.config.num_nextn_predict_layers:
        return main, None
    # MTP at position t sees h_t and token t+1 and predicts token t+2
    mtp = model.mtp_logits(h[:, :-1], inp[:, 1:])
    mtp_loss = F.cross_entropy(mtp[:, :-1].float().flatten(0, 1), x[:, 2:-1].flatten())
    return main, mtp_loss


@torch.no_grad()
def mean_loss(model: LingForCausalLM, windows: torch.Tensor, batch: int, device: str, bf16: bool = True,
              with_mtp: bool = False) -> tuple[float, float | None]:
    """Mean next-token loss (and MTP loss) in nats/token over [N, T+1] windows."""
    was_training = model.training
    model.eval()
    total, total_mtp, n = 0.0, 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch].to(device).long()
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16,
                            enabled=bf16 and device.startswith("cuda")):
            main, mtp = losses(model, x, with_mtp=with_mtp)
        total += main.item() * x.shape[0]
        total_mtp += mtp.item() * x.shape[0] if mtp is not None else 0.0
        n += x.shape[0]
    model.train(was_training)
    return total / max(n, 1), (total_mtp / max(n, 1) if with_mtp else None)


def windows_of(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = (stream.numel() - 1) // seq_len
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)
    return stream.cpu()[idx]


def train(cfg: LingConfig, stream: torch.Tensor, heldout: torch.Tensor, s: TrainSettings, log_path: Path,
          device: str = "cuda") -> tuple[LingForCausalLM, dict]:
    """Train from scratch; returns the model and a summary. One JSON line per log step goes to log_path."""
    torch.manual_seed(s.seed)
    torch.backends.cuda.matmul.allow_tf32 = s.tf32
    model = LingForCausalLM(cfg).to(device)
    model.init_weights(0.02, generator=torch.Generator(device=device).manual_seed(s.seed))
    model.train()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue  # expert_bias: moved by the balancer only
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=s.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.startswith("cuda"))
    data = PackedStream(stream.to(device), s.seq_len, s.seed)
    held = windows_of(heldout, s.seq_len)
    held_probe = held[: max(1, min(len(held), 2 * s.batch_size))]
    balancer = ExpertBalancer(model, s.bias_rate)
    autocast = dict(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    log = log_path.open("w")
    t0 = time.time()
    tokens = 0
    acc = {"loss": 0.0, "mtp": 0.0, "imbalance": 0.0, "n": 0}
    step, stopped_by, last_eval = 0, "steps", t0
    while step < s.steps:
        progress = max(step / s.steps, (time.time() - t0) / s.max_seconds)
        if progress >= 1.0:
            stopped_by = "time"
            break
        lr = lr_at(progress, s)
        for g in opt.param_groups:
            g["lr"] = lr
        x = data.batch(s.batch_size)
        with torch.autocast(**autocast):
            main, mtp = losses(model, x)
            loss = main + s.mtp_weight * mtp if mtp is not None else main
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        imbalance = balancer.update()
        tokens += x.shape[0] * s.seq_len
        acc["loss"] += main.item()
        acc["mtp"] += mtp.item() if mtp is not None else 0.0
        acc["imbalance"] += imbalance
        acc["n"] += 1
        step += 1
        if step % s.log_every == 0 or step == 1:
            rec = {"step": step, "tokens": tokens, "seconds": round(time.time() - t0, 2), "lr": lr,
                   "loss": acc["loss"] / acc["n"], "mtp_loss": acc["mtp"] / acc["n"],
                   "expert_max_over_mean": acc["imbalance"] / acc["n"]}
            if time.time() - last_eval >= s.eval_seconds:
                last_eval = time.time()
                rec["heldout_loss"] = mean_loss(model, held_probe, s.batch_size, device)[0]
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)
            acc = {"loss": 0.0, "mtp": 0.0, "imbalance": 0.0, "n": 0}
    steps_done = step
    seconds = time.time() - t0
    balancer.remove()
    summary = {"steps": steps_done, "stopped_by": stopped_by, "train_seconds": round(seconds, 1),
               "train_tokens": tokens, "tokens_per_second": round(tokens / max(seconds, 1e-9)),
               "epochs_over_data": round(tokens / stream.numel(), 3), "settings": asdict(s)}
    rec = {"step": steps_done, "tokens": tokens, "seconds": round(seconds, 2), "final": True}
    log.write(json.dumps(rec) + "\n")
    log.close()
    return model, summary
