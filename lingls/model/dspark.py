"""DSpark: the block drafter of Ling-3.0-flash (`Ling-3.0-flash-DSpark`), in its public checkpoint layout.

One forward drafts a whole block (docs/dspark.md gathers what public sources say; this module is that math):
- Context: for every committed position, the target's residual stream after the layers `target_layer_ids`
  (0-based decoder layers), concatenated -> `fc` -> `hidden_norm`. These rows are keys and values of every
  draft layer (`k_proj` -> per-head `k_norm` -> RoPE; `v_proj`), with no input layernorm. The runtime keeps them
  as the drafter's own KV cache, appended from the target's prefill and verify forwards.
- Block: the target's embedding of [anchor, mask_token_id x (B-1)] at positions P..P+B-1, the anchor being the
  token the target produced and has not consumed. Queries `q_proj` -> `q_norm` -> RoPE (NeoX halves); block
  keys/values the same way from the block's own normed stream. Attention is bidirectional inside the block and
  sees the context rows before P. GQA when num_key_value_heads < num_attention_heads.
- Layers: RMSNorm pre-norms, SwiGLU MLP, final `norm`, then the target's lm_head. Slot k predicts the token
  at anchor+k+1, so B rows give B drafts.
- Markov head (vanilla, rank r): logits += markov_w2(markov_w1[prev]); the block is sampled left to right from
  the anchor (greedy: slot by slot argmax, the previous slot's choice as prev).
- Confidence head: sigmoid(proj(cat[h, markov_w1[prev]])); loaded when present, never needed (ignoring it, as
  SGLang's static verify length does, is exact).

The checkpoint may also hold copies of the target's `embed_tokens` and `lm_head` (the card's 1,363,707,905
parameters count them): they are checked for shape and not loaded; the target's own are used.

This module is the math as training (`training.draft.distill`) and the tests' reference read it; the runtime
(`runtime.spec.round.DSparkRuntime`) runs the same round through the fused kernels on CUDA (`lingls.kernels.dspark`).

Tensor parallelism (`Parallel`): attention heads and the MLP's intermediate are split across ranks (row-parallel
outputs all-reduced, as the target's layers), the Markov head's output over the vocabulary (as the lm_head); fc,
the norms, markov_w1 and the confidence head are replicated. Every matrix is a contiguous [out, in] nn.Linear
weight (one GEMV per projection at B rows), and a round has fixed shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn

from lingls.kernels import reference as ref
from lingls.model.config import LingConfig
from lingls.model.ling import Parallel, RMSNorm, SwiGLU
from lingls.model.loader import WEIGHTLESS, CheckpointError, CheckpointReader, shard_range, write_shards
from lingls.model.packed import PackedFileError, open_tensors

ARCHITECTURE = "DSparkDraftModel"
IGNORED_COPIES = ("embed_tokens.weight", "lm_head.weight")  # the target's, stored in the checkpoint, not used
FLASH_TARGET_LAYERS = [1, 11, 23, 29, 35]


class DSparkConfigError(ValueError):
    """Not a DSpark drafter this runtime can run, or not one for this target; the message names the key."""


@dataclass
class DSparkConfig:
    hidden_size: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    intermediate_size: int = 6144
    block_size: int = 8
    markov_rank: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_target_layers: int | None = None
    extra: dict = field(default_factory=dict, compare=False)  # the config.json's other keys, written back as read

    # ---- config.json ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> "DSparkConfig":
        """Parse a DSpark config.json: the drafter keys at the top level or under `dflash_config` (which wins)."""
        flat = {**raw, **(raw.get("dflash_config") or {})}

        def need(key):
            if flat.get(key) is None:
                raise DSparkConfigError(f"config.json lacks {key!r}")
            return flat[key]

        archs = raw.get("architectures") or []
        if archs and not any("DSpark" in a for a in archs):
            raise DSparkConfigError(f"architectures {archs}: not a DSpark drafter (DFlash-style drafters whose "
                                    "slot k predicts the anchor+k token are not supported)")
        if raw.get("speculators_model_type") or raw.get("speculators_config"):
            raise DSparkConfigError("speculators_config: the 'speculators' alignment (slot k predicts anchor+k) is "
                                    "not DSpark's (slot k predicts anchor+k+1)")
        if flat.get("projector_type", "dspark") != "dspark":
            raise DSparkConfigError(f"projector_type {flat['projector_type']!r}: only 'dspark' is supported")
        kind = flat.get("markov_head_type", "vanilla")
        if kind != "vanilla":
            raise DSparkConfigError(f"markov_head_type {kind!r}: only the 'vanilla' Markov head is supported")
        if flat.get("attention_mode", "mha") not in ("mha", "gqa"):
            raise DSparkConfigError(f"attention_mode {flat['attention_mode']!r}: only full attention (mha/gqa) "
                                    "is supported")
        types = flat.get("layer_types") or []
        if any(t != "full_attention" for t in types):
            raise DSparkConfigError(f"layer_types {sorted(set(types))}: only full_attention layers are supported")
        if flat.get("use_sliding_window"):
            raise DSparkConfigError("use_sliding_window: only full attention is supported")
        rope_params = flat.get("rope_parameters") or {}
        scaling = flat.get("rope_scaling")
        if scaling or rope_params.get("rope_type", "default") != "default":
            raise DSparkConfigError("rope_scaling: scaled RoPE is not supported (plain rope_theta only)")
        theta = flat.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        try:
            cfg = cls(
                hidden_size=hidden, vocab_size=int(need("vocab_size")),
                target_layer_ids=[int(i) for i in need("target_layer_ids")],
                mask_token_id=int(need("mask_token_id")), num_hidden_layers=int(need("num_hidden_layers")),
                num_attention_heads=heads, num_key_value_heads=int(flat.get("num_key_value_heads") or heads),
                head_dim=int(flat.get("head_dim") or hidden // heads),
                intermediate_size=int(need("intermediate_size")), block_size=int(need("block_size")),
                markov_rank=int(need("markov_rank")), rms_norm_eps=float(flat.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta), confidence_head=bool(flat.get("enable_confidence_head", False)),
                confidence_head_with_markov=bool(flat.get("confidence_head_with_markov", True)),
                num_target_layers=flat.get("num_target_layers"),
                extra={k: v for k, v in raw.items() if k not in _WRITTEN})
        except (TypeError, ValueError) as e:
            raise DSparkConfigError(f"config.json: {e}") from None
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DSparkConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                                    f"(vocab_size {self.vocab_size})")
        if self.block_size < 1 or not self.target_layer_ids:
            raise DSparkConfigError("block_size must be >= 1 and target_layer_ids non-empty")
        if self.markov_rank < 1:
            raise DSparkConfigError(f"markov_rank {self.markov_rank}: DSpark has a Markov head (rank >= 1)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DSparkConfigError(f"num_key_value_heads {self.num_key_value_heads} does not divide "
                                    f"num_attention_heads {self.num_attention_heads}")
        if self.head_dim % 2:
            raise DSparkConfigError(f"head_dim {self.head_dim} must be even (RoPE)")

    def to_dict(self) -> dict:
        """config.json in the published layout (drafter keys under `dflash_config`)."""
        return {
            **self.extra, "architectures": [ARCHITECTURE], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "block_size": self.block_size,
            "num_target_layers": self.num_target_layers, "hidden_act": "silu", "attention_bias": False,
            "dflash_config": {"target_layer_ids": self.target_layer_ids, "mask_token_id": self.mask_token_id,
                              "markov_rank": self.markov_rank, "markov_head_type": "vanilla",
                              "enable_confidence_head": self.confidence_head,
                              "confidence_head_with_markov": self.confidence_head_with_markov,
                              "projector_type": "dspark", "attention_mode": "mha"},
        }

    @classmethod
    def for_target(cls, target: LingConfig, **kw) -> "DSparkConfig":
        """The published drafter's widths for Ling-3.0-flash (5 layers, 32 x 128 heads, 6144, rank 256, taps
        [1, 11, 23, 29, 35]); for another target its hidden size and vocabulary, taps spread over its depth,
        and the other widths from `kw`."""
        n = target.num_hidden_layers
        taps = FLASH_TARGET_LAYERS if n == 42 else sorted({max(0, round(n * (i + 1) / 5) - 1) for i in range(5)})
        mask = target.vocab_size - 1 if target.pad_token_id is None else target.pad_token_id
        base = dict(hidden_size=target.hidden_size, vocab_size=target.vocab_size, target_layer_ids=list(taps),
                    mask_token_id=mask, num_target_layers=n, rope_theta=target.rope_theta)
        cfg = cls(**{**base, **kw})
        cfg.validate()
        return cfg

    def check_target(self, target: LingConfig) -> None:
        if self.hidden_size != target.hidden_size:
            raise DSparkConfigError(f"hidden_size {self.hidden_size} does not match the target's {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise DSparkConfigError(f"vocab_size {self.vocab_size} does not match the target's {target.vocab_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise DSparkConfigError(f"target_layer_ids {bad} outside the target's {target.num_hidden_layers} layers")


_WRITTEN = {"architectures", "model_type", "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "rope_parameters",
            "block_size", "num_target_layers", "dflash_config", "target_layer_ids", "mask_token_id", "markov_rank",
            "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "projector_type",
            "attention_mode", "hidden_act", "attention_bias"}


# ---- the module ---------------------------------------------------------------------------------------------
def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX RoPE (halves rotated) of x [..., T, H, D] by positions [..., T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[..., None] * inv
    return ref.apply_rope(x, ang.cos(), ang.sin(), interleave=False, heads=True)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class DSparkAttention(nn.Module):
    def __init__(self, cfg: DSparkConfig, par: Parallel):
        super().__init__()
        self.heads = par.split(cfg.num_attention_heads, "num_attention_heads")
        self.kv_heads = par.split(cfg.num_key_value_heads, "num_key_value_heads")
        self.head_dim, self.theta, self.par = cfg.head_dim, cfg.rope_theta, par
        d, hid = cfg.head_dim, cfg.hidden_size
        self.q_proj, self.k_proj = _linear(hid, self.heads * d), _linear(hid, self.kv_heads * d)
        self.v_proj, self.o_proj = _linear(hid, self.kv_heads * d), _linear(self.heads * d, hid)
        self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, positions: torch.Tensor):
        """Keys (normed, rotated) and values [..., T, kv_heads, D] of rows x [..., T, hidden]."""
        k = self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        return rope(self.k_norm(k), positions, self.theta), self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))

    def forward(self, x, positions, ctx_k, ctx_v, visible):
        """Block rows x [..., B, hidden] (normed) against ctx_k/v [..., S, kv_heads, D] and themselves;
        visible [..., B, S + B] bool. Returns this rank's partial o_proj output (all-reduce it)."""
        q = rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))), positions, self.theta)
        k, v = self.kv(x, positions)
        keys = torch.cat([ctx_k.to(k.dtype), k], -3).transpose(-3, -2)
        vals = torch.cat([ctx_v.to(v.dtype), v], -3).transpose(-3, -2)
        o = F.scaled_dot_product_attention(q.transpose(-3, -2), keys, vals, attn_mask=visible.unsqueeze(-3),
                                           enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(o.transpose(-3, -2).flatten(-2))


class DSparkLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig, par: Parallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, par.split(cfg.intermediate_size, "intermediate_size"))
        self.par = par

    def forward(self, h, positions, ctx_k, ctx_v, visible):
        h = h + self.par.all_reduce(self.self_attn(self.input_layernorm(h), positions, ctx_k, ctx_v, visible))
        return h + self.par.all_reduce(self.mlp(self.post_attention_layernorm(h)))


class MarkovHead(nn.Module):
    """logits bias = markov_w2(markov_w1[prev]): w1 [V, r] whole on every rank, w2 [V_local, r] split like the
    lm_head."""

    def __init__(self, cfg: DSparkConfig, par: Parallel):
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_w2 = _linear(cfg.markov_rank, par.split(cfg.vocab_size, "vocab_size"))

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.with_markov = cfg.confidence_head_with_markov
        self.proj = nn.Linear(cfg.hidden_size + (cfg.markov_rank if self.with_markov else 0), 1)


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: DSparkConfig, par: Parallel | None = None):
        super().__init__()
        self.config, self.par = cfg, par or Parallel()
        hid = cfg.hidden_size
        self.fc = _linear(len(cfg.target_layer_ids) * hid, hid)
        self.hidden_norm = RMSNorm(hid, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkLayer(cfg, self.par) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(hid, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg, self.par)
        self.confidence_head = ConfidenceHead(cfg) if cfg.confidence_head else None

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor):
        """Target features [..., T, len(target_layer_ids) * hidden] at positions [..., T] -> every layer's
        context keys and values, stacked: ([L, ..., T, kv_heads, D], same)."""
        c = self.hidden_norm(self.fc(feats))
        kvs = [layer.self_attn.kv(c, positions) for layer in self.layers]
        return torch.stack([k for k, _ in kvs]), torch.stack([v for _, v in kvs])

    def block_hidden(self, x, positions, ctx_k, ctx_v, visible) -> torch.Tensor:
        """Block rows x [..., B, hidden] at positions [..., B] -> final-normed rows (the lm_head's input)."""
        for layer, k, v in zip(self.layers, ctx_k, ctx_v):
            x = layer(x, positions, k, v, visible)
        return self.norm(x)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard of the Markov logit bias [..., V_local] after tokens prev [...]."""
        return self.markov_head(prev)

    def confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The confidence head's acceptance estimate per slot (unused by the runtime: ignoring it is exact)."""
        x = torch.cat([h, self.markov_head.markov_w1(prev).to(h.dtype)], -1) if self.confidence_head.with_markov else h
        return torch.sigmoid(self.confidence_head.proj(x)).squeeze(-1)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Training start: unit norms, zero Markov output (the plain block drafter), small normal elsewhere."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)
        self.markov_head.markov_w2.weight.zero_()


# ---- files --------------------------------------------------------------------------------------------------
def checkpoint_tensors(cfg: DSparkConfig) -> Iterator[tuple[str, torch.Size]]:
    """(name, shape) of every tensor of a published-layout checkpoint, the embed_tokens / lm_head copies last."""
    with torch.device("meta"):
        layout = DSparkDrafter(cfg)
    for name, p in layout.named_parameters():
        yield name, p.shape
    for name in IGNORED_COPIES:
        yield name, torch.Size([cfg.vocab_size, cfg.hidden_size])


def is_dspark_dir(path: str | Path) -> bool:
    """Whether `path` holds a config.json that says DSpark (its architectures or its `dflash_config`)."""
    p = Path(path) / "config.json"
    try:
        raw = json.loads(p.read_text()) if p.is_file() else None
    except (OSError, ValueError):
        return False
    if not isinstance(raw, dict):
        return False
    return "dflash_config" in raw or any("DSpark" in a or "DFlash" in a for a in raw.get("architectures") or [])


class _Tensors:
    """A checkpoint's tensors by name (the optional `model.` prefix removed): safetensors files read lazily, or
    a dict already in memory."""

    def __init__(self, path: Path | None = None, tensors: dict[str, torch.Tensor] | None = None):
        self.slices: dict = {}
        if tensors is not None:
            self.slices = dict(tensors)
            return
        try:
            files = CheckpointReader._files(path)
        except CheckpointError as e:
            raise DSparkConfigError(str(e)) from None
        for f in files:
            try:
                h = open_tensors(f)
            except (SafetensorError, PackedFileError) as e:
                raise DSparkConfigError(f"{f}: truncated, or not a safetensors file ({e})") from None
            for key in h.keys():
                name = key.removeprefix("model.")
                if name in self.slices:
                    raise DSparkConfigError(f"{path}: tensor {name} appears twice")
                self.slices[name] = h.get_slice(key)

    def shape(self, name: str) -> list[int]:
        s = self.slices[name]
        return list(s.shape) if isinstance(s, torch.Tensor) else list(s.get_shape())

    def read(self, name: str, dim: int | None, lo: int, hi: int | None) -> torch.Tensor:
        s = self.slices[name]
        index = [slice(None)] * len(self.shape(name))
        if dim is not None:
            index[dim] = slice(lo, hi)
        return s[tuple(index)]


def load_dspark(path: str | Path, target: LingConfig, par: Parallel | None = None, device="cpu",
                dtype: torch.dtype = torch.float32) -> DSparkDrafter:
    """Rank `par.rank`'s shard of the DSpark drafter in `path`, made for `target`; DSparkConfigError if unusable
    (the message names the key or tensor). A weightless directory (random_weights.json) gets random weights."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DSparkConfigError(f"{path}/config.json: {e}") from None
    if not isinstance(raw, dict):
        raise DSparkConfigError(f"{path}/config.json: not a JSON object")
    cfg = DSparkConfig.from_dict(raw)
    cfg.check_target(target)
    par = par or Parallel()
    if (path / WEIGHTLESS).is_file():
        try:
            seed = int(json.loads((path / WEIGHTLESS).read_text())["seed"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DSparkConfigError(f"{path / WEIGHTLESS}: needs an integer 'seed' ({e})") from None
        return random_dspark(cfg, par, device, dtype, seed)
    return fill_shards(cfg, par, device, dtype, _Tensors(path), str(path))


def fill_shards(cfg: DSparkConfig, par: Parallel, device, dtype: torch.dtype, tensors: "_Tensors | dict",
                where: str) -> DSparkDrafter:
    """A DSparkDrafter (rank `par.rank`'s shard) from checkpoint tensors under the module's names, after
    checking every name and shape: the embed_tokens / lm_head copies may be present (shape-checked, not
    loaded), the confidence head is loaded when the config enables it and ignored otherwise."""
    if isinstance(tensors, dict):
        tensors = _Tensors(tensors=tensors)
    with torch.device("meta"):
        full = DSparkDrafter(cfg)
        drafter = DSparkDrafter(cfg, par)
    expected = dict(checkpoint_tensors(cfg))
    optional = set(IGNORED_COPIES)
    missing = [n for n in expected if n not in tensors.slices and n not in optional]
    if missing:
        raise DSparkConfigError(f"{where}: tensor {missing[0]} is missing" +
                                (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if not cfg.confidence_head:
        optional |= {n for n in tensors.slices if n.startswith("confidence_head.")}
    unexpected = [n for n in tensors.slices if n not in expected and n not in optional]
    if unexpected:
        raise DSparkConfigError(f"{where}: unexpected tensor {unexpected[0]} (does config.json match the checkpoint?)")
    for name, shape in expected.items():
        if name in tensors.slices and tensors.shape(name) != list(shape):
            raise DSparkConfigError(f"{where}: tensor {name} has shape {tensors.shape(name)}, config.json implies "
                                    f"{list(shape)}")
    drafter = drafter.to_empty(device=device).to(dtype)
    full_params = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            d, lo, hi = shard_range(full_params[name].shape, p.shape, par, name)
            p.copy_(tensors.read(name, d, lo, hi))
    return drafter.eval()


def random_dspark(cfg: DSparkConfig, par: Parallel | None = None, device="cpu", dtype: torch.dtype = torch.float32,
                  seed: int = 0, std: float = 0.02) -> DSparkDrafter:
    """Rank `par.rank`'s shard of random weights built on `device` (weightless benchmark checkpoints): every rank
    draws its equally shaped shard from the same seed, so the replicated tensors agree."""
    with torch.device("meta"):
        drafter = DSparkDrafter(cfg, par)
    drafter = drafter.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=device))
            else:
                p.normal_(0.0, std, generator=gen)
    return drafter.eval()


def save_dspark(drafter: DSparkDrafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                copies: dict[str, torch.Tensor] | None = None, prefix: str = "",
                max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write an unsharded drafter in the published layout: config.json, safetensors (numbered shards + index past
    `max_shard_bytes`), names under `prefix`; `copies`: embed_tokens / lm_head tensors to store beside it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(drafter.config.to_dict(), indent=2) + "\n")
    tensors = {n: p.detach() for n, p in drafter.state_dict().items()}
    tensors.update(copies or {})
    write_shards(((prefix + n, t.to("cpu", dtype).contiguous()) for n, t in tensors.items()), out_dir,
                 max_shard_bytes)
    return out_dir
