"""Train a Ling-3.0-architecture model (lingls.model) on a packed token stream.

Loss = next-token cross-entropy + `mtp_weight` * the MTP layer's cross-entropy for the token after next.
MoE balance is aux-loss-free, as in Ling/DeepSeek-V3: a forward hook on every router (`mlp.gate`) counts how
many tokens each expert received; after each optimizer step every expert's selection bias moves by
`bias_rate` towards the mean load (up when under-used, down when over-used). The bias only changes which
experts are chosen, never their weights, so no gradient flows through it.

Resuming: a run continues from a saved model (the shipped bf16 weights, expert biases included) and its
`train_state.json` (tokens and steps so far, where the data order stood). Only that comes back from the GPU
machine within its transfer limits, so AdamW's moments start afresh; with betas 0.9/0.95 they are re-estimated
within a few dozen steps, which the resumed segment's own short warm-up covers.
"""

from __future__ import annotations

import json
import math
import os
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lingls.kernels import prefill_moe
from lingls.model import LingConfig, LingForCausalLM, ling
from lingls.model.ling import MoE, Router
from training.linear_ce import compile_chunks, linear_cross_entropy


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
    eval_seconds: float = 45.0  # held-out probe loss at the first log step after this many seconds
    log_every: int = 10
    seed: int = 1234
    tf32: bool = True  # TF32 for the fp32 matmuls left under autocast (the chunked KDA's): bench/train_throughput.py
    compile: bool = False  # compile_for_training (CUDA): bench/train_throughput.py measures both
    compile_ce: bool = True  # with compile: the cross-entropy's chunks compiled too (linear_ce.compile_chunks)
    kernel_route: bool = False  # the routers' choice by the routing kernel (route_by_kernel), as the benchmark chose


class PackedStream:
    """Non-overlapping windows of seq_len + 1 tokens over one long stream, visited in a seeded shuffled order."""

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int):
        self.stream, self.seq_len = stream, seq_len
        n = (stream.numel() - 1) // seq_len
        if n < 1:
            raise ValueError(f"stream of {stream.numel()} tokens is shorter than one window of {seq_len + 1}")
        self.starts = torch.arange(n, device=stream.device) * seq_len
        self.gen = torch.Generator().manual_seed(seed)
        self.pos, self.epochs = 0, 0
        self.order = self._shuffle()
        self.offsets = torch.arange(seq_len + 1, device=stream.device)

    def _shuffle(self) -> torch.Tensor:
        """The next epoch's window order, on the stream's device (indexing with it needs no host copy)."""
        return torch.randperm(len(self.starts), generator=self.gen).to(self.starts.device)

    def __len__(self) -> int:
        return self.starts.numel()

    def state(self) -> dict:
        return {"epochs": self.epochs, "pos": self.pos}

    def restore(self, state: dict) -> None:
        """Move to where `state()` was taken on a stream built the same way (same tokens, seq_len and seed)."""
        for _ in range(state["epochs"]):
            self.order = self._shuffle()
        self.epochs, self.pos = state["epochs"], min(state["pos"], len(self))

    def batch(self, size: int) -> torch.Tensor:
        picks, got = [], 0
        while got < size:
            if self.pos == len(self.order):
                self.order, self.pos = self._shuffle(), 0
                self.epochs += 1
            take = min(size - got, len(self.order) - self.pos)
            picks.append(self.order[self.pos:self.pos + take])
            self.pos += take
            got += take
        starts = self.starts[torch.cat(picks)]
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
            flat = idx.flatten()  # index_add_, not bincount: CUDA's bincount reads the max back to the host
            self.counts[i].index_add_(0, flat, torch.ones_like(flat, dtype=self.counts[i].dtype))
        return hook

    @torch.no_grad()
    def update(self) -> torch.Tensor:
        """Apply the bias step; returns (as a tensor: no host sync in the training loop) the mean over routers of
        max load / mean load since the last update."""
        ratios = []
        for router, c in zip(self.routers, self.counts):
            mean = c.mean()
            router.expert_bias += self.rate * torch.sign(mean - c)  # all zero (no change) when nothing was routed
            ratios.append(c.max() / mean.clamp(min=1e-9))
            c.zero_()
        return torch.stack(ratios).mean() if ratios else torch.ones(())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def torch_ops_only() -> None:
    """Make lingls.model run its torch forms on CUDA too (LINGLS_KERNELS=0), for training and for the evaluation
    under autocast. Its prefill kernels (kernels/prefill_moe.py: the router's grouped top-k and the grouped
    experts; kernels/prefill_kda.py) are inference-only Triton kernels: no backward (the router would get no
    gradient), and the router's expects fp32 logits where autocast gives bf16 (a CompilationError on the GPU)."""
    os.environ["LINGLS_KERNELS"] = "0"


def lr_at(progress: float, s: TrainSettings) -> float:
    """Linear warm-up, then cosine from `lr` to `min_lr_ratio * lr`, over progress in [0, 1].

    Progress is max(step / steps, seconds / max_seconds): the step rate of the GPU code is not known in
    advance, so the time budget fixes the schedule and the decay always completes.
    """
    if progress < s.warmup:
        return s.lr * max(progress / s.warmup, 1e-3)
    x = min(1.0, (progress - s.warmup) / (1 - s.warmup))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * x)))


def losses(model: LingForCausalLM, x: torch.Tensor, with_mtp: bool = True, fused_ce: bool = True):
    """x: [B, T+1] ids -> (next-token loss, MTP loss or None).

    fused_ce: both heads' cross-entropy through `training.linear_ce` (row chunks, no logits kept); False is the
    eager form it replaces (lm_head logits, upcast to fp32, F.cross_entropy), kept as the benchmark's baseline."""
    inp, tgt = x[:, :-1], x[:, 1:]
    h = model.hidden(inp)
    normed = model.model.norm(h)
    weight = model.lm_head.weight
    if fused_ce:
        main = linear_cross_entropy(normed.flatten(0, 1), weight, tgt.flatten())
    else:
        main = F.cross_entropy(model.head(h, normed).float().flatten(0, 1), tgt.flatten())
    if not with_mtp or not model.config.num_nextn_predict_layers:
        return main, None
    # MTP at position t sees h_t and token t+1 and predicts token t+2 (LingForCausalLM.mtp_logits, its head apart)
    layer = model.mtp_layers[0]
    m = layer.mix(model.model.word_embeddings(inp[:, 1:]), normed[:, :-1])
    m = layer.final_layernorm(model._layer_full(layer, m, torch.arange(m.shape[1], device=x.device)))[:, :-1]
    if fused_ce:
        mtp_loss = linear_cross_entropy(m.flatten(0, 1), weight, x[:, 2:-1].flatten())
    else:
        mtp_loss = F.cross_entropy(model.lm_head(m).float().flatten(0, 1), x[:, 2:-1].flatten())
    return main, mtp_loss


def route_by_kernel(model: LingForCausalLM, on: bool = True) -> None:
    """Each router's choice of experts by the prefill's routing kernel (`prefill_moe.route`: one launch a
    router, where the reference's three torch.topk calls took 8.1 ms of a 160 ms batch-64 step on the H200), its
    weights by torch ops on the chosen experts' scores, so the gradient reaches the router as through the
    reference (`reference.route_grouped_topk`); on=False gives the routers their own forward back. The kernel
    chooses by fp32 scores (the reference, under bf16 autocast, by bf16 ones: they differ only at near-ties);
    where Triton is absent, or off a GPU without its interpreter, `route` is the reference itself."""
    for router in (m for m in model.modules() if isinstance(m, Router)):
        if on:
            router.forward = types.MethodType(_kernel_routed, router)
        else:
            router.__dict__.pop("forward", None)


def _kernel_routed(router: Router, x: torch.Tensor):
    logits = router.logits(x)
    with torch.no_grad():
        _, idx = prefill_moe.route(logits.float(), router.expert_bias, router.top_k, router.n_group,
                                   router.topk_group, router.normalize, router.scale)
    weights = logits.sigmoid().gather(1, idx)
    if router.normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * router.scale, idx


_EAGER_DELTA_RULE = torch.compiler.disable(ling.delta_rule)


def compile_for_training(model: LingForCausalLM, backend: str = "inductor") -> None:
    """torch.compile every layer's attention, MLP (the experts, the shared expert) and norms, so their many small
    elementwise ops (fp32 gates, norms, SwiGLU, the dense experts' weighting) fuse; the KDA recurrence between
    (fla-core's Triton chunk_kda, or lingls' torch forms) runs as it is, outside the compiled graphs, and so do
    the routers (their forward hooks count expert load for the balancer). The loss's chunks are compiled too
    (`linear_ce.compile_chunks`)."""
    if ling.delta_rule is not _EAGER_DELTA_RULE:  # KimiDeltaAttention.forward looks it up at each call
        ling.delta_rule = _EAGER_DELTA_RULE
    for layer in model.model.layers:
        mods = [layer.attention, layer.input_layernorm, layer.post_attention_layernorm]
        if isinstance(layer.mlp, MoE):
            mods += [layer.mlp.experts] + ([layer.mlp.shared_experts] if layer.mlp.shared_experts else [])
        else:
            mods.append(layer.mlp)
        for m in mods:
            m.compile(backend=backend)
    compile_chunks(backend=backend)


@torch.no_grad()
def mean_loss(model: LingForCausalLM, windows: torch.Tensor, batch: int, device: str, bf16: bool = True,
              with_mtp: bool = False) -> tuple[float, float | None]:
    """Mean next-token loss (and MTP loss) in nats/token over [N, T+1] windows. A model compiled by
    `compile_for_training` runs eagerly here: a no-grad graph for a short probe is not worth its compile time."""
    was_training = model.training
    model.eval()
    total, total_mtp, n = 0.0, 0.0, 0
    with torch.compiler.set_stance("force_eager"):
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


PEAK_BF16_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12}  # dense bf16, the datasheets


def model_flops_per_token(model: LingForCausalLM, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward) of the work the model needs, not of the
    implementation: every matrix product a token takes part in (2 x its active weights: routed experts at
    top-k / experts, the embedding lookup free), MLA's attention over the causal mean of seq_len / 2 keys,
    and KDA's chunked recurrence (per head: the state read and write, 4 dk dv, and the chunk's pairwise
    products, 4 C (dk + dv))."""
    cfg = model.config
    k_over_e = cfg.num_experts_per_tok / cfg.num_experts
    forward = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name or "conv1d" in name:
            continue
        share = k_over_e if name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name else 1.0
        forward += 2 * p.numel() * share
    n_mla = len(cfg.mla_layers) + cfg.num_nextn_predict_layers
    forward += n_mla * 2 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len / 2
    chunk = 16
    forward += len(cfg.kda_layers) * cfg.num_attention_heads * (4 * cfg.head_dim ** 2 + 8 * chunk * cfg.head_dim)
    return 3 * forward


def windows_of(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = (stream.numel() - 1) // seq_len
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)
    return stream.cpu()[idx]


def train(cfg: LingConfig, stream: torch.Tensor, heldout: torch.Tensor, s: TrainSettings, log_path: Path,
          device: str = "cuda", init: LingForCausalLM | None = None, resume: dict | None = None
          ) -> tuple[LingForCausalLM, dict]:
    """Train from scratch, or on from `init` (a loaded model) and `resume` (the previous run's train_state);
    returns the model and a summary, whose `state` is the next run's `resume`. One JSON line per log step
    goes to log_path (appended to when resuming)."""
    torch.manual_seed(s.seed)
    torch.backends.cuda.matmul.allow_tf32 = s.tf32
    if init is None:
        model = LingForCausalLM(cfg).to(device)
        model.init_weights(0.02, generator=torch.Generator(device=device).manual_seed(s.seed))
    else:
        model = init.to(device=device, dtype=torch.float32)
    model.train()
    if s.compile:
        compile_for_training(model)
    if not (s.compile and s.compile_ce):  # the chunks' form is module state: set it either way
        compile_chunks(False)
    route_by_kernel(model, s.kernel_route)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue  # expert_bias: moved by the balancer only
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=s.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.startswith("cuda"))
    data = PackedStream(stream.to(device), s.seq_len, s.seed)
    before = resume or {"tokens": 0, "steps": 0, "seconds": 0.0, "segments": 0}
    if resume:
        data.restore(resume["data"])
    held = windows_of(heldout, s.seq_len)
    held_probe = held[: max(1, min(len(held), 32))]
    balancer = ExpertBalancer(model, s.bias_rate)
    autocast = dict(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    log = log_path.open("a" if resume else "w")
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
        # summed on the GPU and read at log steps only: a read per step would stall the launch queue
        acc["loss"] += main.detach()
        acc["mtp"] += mtp.detach() if mtp is not None else 0.0
        acc["imbalance"] += imbalance
        acc["n"] += 1
        step += 1
        if step % s.log_every == 0 or step == 1:
            rec = {"step": before["steps"] + step, "tokens": before["tokens"] + tokens,
                   "seconds": round(before["seconds"] + time.time() - t0, 2), "lr": lr,
                   "loss": float(acc["loss"]) / acc["n"], "mtp_loss": float(acc["mtp"]) / acc["n"],
                   "expert_max_over_mean": float(acc["imbalance"]) / acc["n"]}
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
    flops = model_flops_per_token(model, s.seq_len)
    tps = tokens / max(seconds, 1e-9)
    peak = PEAK_BF16_FLOPS.get(torch.cuda.get_device_name() if device.startswith("cuda") else "", 0.0)
    state = {"tokens": before["tokens"] + tokens, "steps": before["steps"] + steps_done,
             "seconds": round(before["seconds"] + seconds, 1), "segments": before["segments"] + 1,
             "data": data.state(), "seq_len": s.seq_len, "seed": s.seed}
    summary = {"steps": state["steps"], "stopped_by": stopped_by, "train_seconds": state["seconds"],
               "train_tokens": state["tokens"], "segment_seconds": round(seconds, 1), "segment_tokens": tokens,
               "tokens_per_second": round(tps), "model_flops_per_token": round(flops),
               "mfu": round(flops * tps / peak, 4) if peak else None, "peak_flops": peak,
               "epochs_over_data": round(state["tokens"] / stream.numel(), 3), "settings": asdict(s), "state": state}
    rec = {"step": state["steps"], "tokens": state["tokens"], "seconds": state["seconds"], "peak_lr": s.lr,
           "final": True}
    log.write(json.dumps(rec) + "\n")
    log.close()
    return model, summary
