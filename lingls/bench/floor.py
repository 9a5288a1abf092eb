"""The floors every benchmark divides by, computed in one place.

- A decode or verify step (T <= 16 tokens) is bound by what it must read: every weight of the decoder layers but
  the routed experts, the routed experts the step actually routes to (distinct per layer), the embedding rows,
  the KDA recurrent and conv state (read and written) and the MLA latent rows of the context; with `head`, the
  final norm and the lm_head shard too. Over the device-to-device copy rate measured in the same run
  (`copy_bandwidth`), that is the step's byte floor (`step_bytes`).
- A prefill is bound by its arithmetic (`prefill_flops`, over the bf16 matmul rate measured in the same run,
  `matmul_peak_tflops`) or by reading its weights once (`prefill_bytes`: a prompt of a thousand tokens already
  routes to every expert of a layer, ~1.5 GB per MoE layer at a TP=4 rank of Ling-3.0-flash); its floor is the
  larger of the two (`prefill_floor_ms`).

The distinct routed experts come from the routing the step computed (`routed_experts`): the model's torch step
routes through `Router` modules, which a forward hook observes; the fused step routes inside its MoE kernel,
past any hook, so there the reference router is run on the very hidden states the kernel receives. (A hook on
the Router alone saw nothing of a fused step: `lingls bench step` printed 0.0 experts per layer.)
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from lingls.model.ling import LingForCausalLM, MoE, Router


# ---- what the GPU can do, measured in the run ----------------------------------------------------------------
def copy_bandwidth(device="cuda", gib: float = 2.0) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    x = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    ms = median_ms(lambda: y.copy_(x), 20, warm=0)
    return 2 * x.numel() * 2 / (ms / 1e3)


def matmul_peak_tflops(n: int = 8192, reps: int = 10) -> float:
    """bf16 n x n x n matrix products per second on this GPU, in TFLOP/s (the prefill floor's divisor)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    return 2 * n ** 3 / (median_ms(lambda: a @ b, reps, warm=0) * 1e-3) / 1e12


def median_ms(fn: Callable[[], object], reps: int = 50, warm: int = 5) -> float:
    """Median of `reps` timed calls of fn (CUDA events around each), after `warm` untimed ones."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


# ---- the routing a step did ------------------------------------------------------------------------------------
def routed_experts(model: LingForCausalLM, run: Callable[[], object], fused=None) -> list[int]:
    """Distinct routed experts of each MoE layer, in the order the layers ran, in what `run()` computes (eagerly:
    a graph replay routes without calling anything). `fused`: the `FusedStep` run() may call (its MoE kernel
    routes on the GPU; the reference router is run on the hidden states that kernel receives)."""
    seen: list[int] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(int(out[1].unique().numel())))
             for m in model.modules() if isinstance(m, Router)]
    if fused is not None:
        kernel_mlp = fused._mlp

        def mlp(entry, x, layer_index):
            moe = entry["layer"].mlp
            if isinstance(moe, MoE):
                moe.gate(x)  # the hook above counts its choice
            return kernel_mlp(entry, x, layer_index)

        fused._mlp = mlp
    try:
        with torch.inference_mode():
            run()
    finally:
        for h in hooks:
            h.remove()
        if fused is not None:
            del fused._mlp  # the class's method again
    return seen


def _per_layer(model: LingForCausalLM, experts: int | float | list) -> list[float]:
    """Distinct experts for each MoE decoder layer: a list as given, or one number for every layer."""
    n = sum(isinstance(layer.mlp, MoE) for layer in model.decoder_layers)
    if isinstance(experts, (int, float)):
        return [experts] * n
    if len(experts) != n:
        raise ValueError(f"{len(experts)} expert counts for {n} MoE layers")
    return list(experts)


def _decoder_params(model: LingForCausalLM):
    """(name, parameter) of the decoder: the MTP layers' left out (a step does not run them)."""
    for name, p in model.named_parameters():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= model.n_layers:
            continue
        yield name, p


def _expert_bytes(model: LingForCausalLM) -> int:
    """Bytes of one routed expert (gate, up and down rows) of one layer at this rank."""
    moe = next(layer.mlp for layer in model.decoder_layers if isinstance(layer.mlp, MoE))
    e = moe.experts
    return (e.gate_up_proj[0].numel() * e.gate_up_proj.element_size()
            + e.down_proj[0].numel() * e.down_proj.element_size())


def _state_bytes(model: LingForCausalLM) -> tuple[int, int]:
    """(KDA recurrent + conv state bytes, bytes of one latent row across the MLA layers) at this rank."""
    cfg = model.config
    heads = cfg.num_attention_heads // model.par.size
    dtype_size = model.lm_head.weight.element_size()
    kda = len(cfg.kda_layers) * (heads * cfg.head_dim ** 2 * 4
                                 + 3 * heads * cfg.head_dim * (cfg.short_conv_kernel_size - 1) * dtype_size)
    return kda, len(cfg.mla_layers) * cfg.latent_dim * dtype_size


# ---- decode and verify steps ---------------------------------------------------------------------------------
def step_bytes(model: LingForCausalLM, t: int, context: int, experts: int | float | list,
               head: bool = True) -> dict[str, float]:
    """What a T-token step after `context` tokens must read, in bytes, by part. experts: distinct routed experts
    per MoE layer (`routed_experts`), or one number for all. head: the final norm and lm_head shard count."""
    size = lambda p: p.numel() * p.element_size()  # noqa: E731
    always = 0
    for name, p in _decoder_params(model):
        if ".mlp.experts." in name or "word_embeddings" in name:
            continue
        if not head and (name.startswith("lm_head.") or name == "model.norm.weight"):
            continue
        always += size(p)
    kda, latent_row = _state_bytes(model)
    return {
        "weights_always": always,
        "weights_routed": sum(_per_layer(model, experts)) * _expert_bytes(model),
        "embedding_rows": t * size(model.model.word_embeddings.weight[0]),
        "kda_state_rw": 2 * kda,
        "mla_kv": (context + t) * latent_row,
    }


def step_floor_ms(model: LingForCausalLM, t: int, context: int, experts, bandwidth: float,
                  head: bool = True) -> float:
    """The step's byte floor in ms at `bandwidth` bytes/s (`copy_bandwidth`)."""
    return sum(step_bytes(model, t, context, experts, head).values()) / bandwidth * 1e3


# ---- prefill ---------------------------------------------------------------------------------------------------
def prefill_flops(model: LingForCausalLM, t: int) -> float:
    """Arithmetic of a cold t-token prefill on this rank: 2 FLOPs per weight a token multiplies by (its share of
    the routed experts: top_k / E of them; the embedding is a lookup; the lm_head runs for the last token only),
    causal MLA attention (q.k over 192 columns and p.v over 128, per head), and the KDA recurrence in fla's
    chunked form (64-token chunks: about 4*64*d + 6*d^2 per token and head)."""
    cfg = model.config
    per_token, routed, head = 0, 0, 0
    for name, p in _decoder_params(model):
        if p.dim() < 2 or "word_embeddings" in name:
            continue
        if ".mlp.experts." in name:
            routed += p.numel()
        elif name.startswith("lm_head"):
            head += p.numel()
        else:
            per_token += p.numel()
    per_token += routed * cfg.num_experts_per_tok // cfg.num_experts
    heads = cfg.num_attention_heads // model.par.size
    d = cfg.head_dim
    mla = len(cfg.mla_layers) * heads * (t * (t + 1) / 2) * (cfg.qk_head_dim + cfg.v_head_dim) * 2
    kda = len(cfg.kda_layers) * heads * t * (4 * 64 * d + 6 * d * d)
    return 2.0 * per_token * t + 2.0 * head + mla + kda


def prefill_bytes(model: LingForCausalLM, t: int, experts: int | float | list) -> float:
    """What a cold t-token prefill must read or write at least once: its weights (the routed experts it routes
    to, `routed_experts` of its step, or one number for all layers), the embedding rows, the KDA states written
    and the t latent rows."""
    parts = step_bytes(model, t, 0, experts, head=True)
    return parts["weights_always"] + parts["weights_routed"] + parts["embedding_rows"] + parts["kda_state_rw"] / 2 \
        + parts["mla_kv"]


def prefill_floor_ms(flops: float, nbytes: float, peak_tflops: float, bandwidth: float) -> dict[str, float]:
    """{'flop_ms', 'byte_ms', 'floor_ms' (the larger)} at the measured matmul peak and copy rate."""
    flop_ms = flops / (peak_tflops * 1e12) * 1e3
    byte_ms = nbytes / bandwidth * 1e3
    return {"flop_ms": flop_ms, "byte_ms": byte_ms, "floor_ms": max(flop_ms, byte_ms)}
