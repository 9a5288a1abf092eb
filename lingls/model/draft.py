"""A DSpark-style block drafter: K draft tokens from one small forward, reading the target's hidden states.

Why this shape: at batch 1 a target step costs about the same for 1 or K+1 tokens, so the speed of speculative
decoding is set by how many drafted tokens get accepted per target step and by how cheap drafting is. A chained
drafter (MTP) pays one sequential forward per drafted token; this one drafts a whole block at once:

- Context: the target's residual stream after a few chosen layers (`target_layers`), concatenated per position,
  projected by `fc` to the hidden size and RMS-normed, becomes every draft layer's keys and values (through that
  layer's own k/v projections). The drafter keeps these as its own KV cache, filled from the target's forwards
  (prefill and verify), so it never re-reads the prompt.
- Block: [anchor, mask x (K-1)] at positions P .. P+K-1, the anchor being the last sampled token (not yet seen by
  the target) and `mask` a learned vector. The block attends to the context rows before P and bidirectionally to
  itself; output i (final norm + the *target's* lm_head) is the draft for position P+1+i. The target's embedding
  and lm_head are used, not copied, so the drafter stays small (for ling-nano most parameters are those two).
- Markov head: block outputs are computed in parallel, so draft i does not see draft i-1. A rank-r bilinear bias
  from the previous token (markov_out(markov_in[prev])) is added to the logits of each position, and the block
  is sampled left to right (semi-autoregressive): cheap, and it fixes most "two plausible continuations mixed"
  errors of parallel drafting.

The module is pure math over explicit tensors; the runtime side (KV buffers, device-side drafting) lives in
`lingls.runtime.speculative`, the distillation in `training/draft/`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lingls.kernels import reference as ref
from lingls.model.config import LingConfig
from lingls.model.ling import RMSNorm, SwiGLU

MODEL_TYPE = "lingls-block-drafter"


class DraftConfigError(ValueError):
    pass


@dataclass
class DraftConfig:
    hidden_size: int  # must equal the target's (the drafter uses its embedding and lm_head)
    vocab_size: int
    target_layers: list[int] = field(default_factory=list)  # residual stream after these target layers (0-based)
    block_size: int = 8  # K: drafts per forward
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 768
    markov_rank: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @classmethod
    def for_target(cls, target: LingConfig, **kw) -> "DraftConfig":
        """Defaults sized from the target: layers spread over its depth, ending at its last layer."""
        n = target.num_hidden_layers
        layers = kw.pop("target_layers", None) or sorted({max(0, n * (i + 1) // 3 - 1) for i in range(3)})
        return cls(hidden_size=target.hidden_size, vocab_size=target.vocab_size, target_layers=list(layers), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        d = dict(d)
        if d.pop("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise DraftConfigError(f"model_type must be {MODEL_TYPE!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise DraftConfigError(f"unknown keys {unknown}")
        try:
            cfg = cls(**d)
        except TypeError as e:
            raise DraftConfigError(str(e)) from None
        if cfg.block_size < 1 or not cfg.target_layers:
            raise DraftConfigError("block_size must be >= 1 and target_layers non-empty")
        return cfg

    def to_dict(self) -> dict:
        return {"model_type": MODEL_TYPE, **asdict(self)}

    def check_target(self, target: LingConfig) -> None:
        if (self.hidden_size, self.vocab_size) != (target.hidden_size, target.vocab_size):
            raise DraftConfigError(f"drafter hidden/vocab {self.hidden_size}/{self.vocab_size} do not match the "
                                   f"target's {target.hidden_size}/{target.vocab_size}")
        bad = [i for i in self.target_layers if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise DraftConfigError(f"target_layers {bad} outside the target's {target.num_hidden_layers} layers")


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [..., T, H, D] by positions [..., T] (any leading dims, unlike the target's 1-D form)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[..., None] * inv
    return ref.apply_rope(x, ang.cos(), ang.sin(), interleave=False, heads=True)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        hid, inner = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.heads, self.head_dim, self.theta = cfg.num_heads, cfg.head_dim, cfg.rope_theta
        self.input_layernorm = RMSNorm(hid, cfg.rms_norm_eps)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hid, inner, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(inner, hid, bias=False)
        self.post_attention_layernorm = RMSNorm(hid, cfg.rms_norm_eps)
        self.mlp = SwiGLU(hid, cfg.intermediate_size)

    def _heads(self, x):
        return x.view(*x.shape[:-1], self.heads, self.head_dim)

    def kv(self, x, positions):
        """Keys (rotated) and values [..., T, H, D] of inputs x [..., T, hidden]."""
        return rope(self._heads(self.k_proj(x)), positions, self.theta), self._heads(self.v_proj(x))

    def forward(self, h, positions, ctx_k, ctx_v, visible):
        """h [..., K, hidden] block stream; ctx_k/v [..., S, H, D]; visible [..., K, S + K] bool."""
        x = self.input_layernorm(h)
        q = rope(self._heads(self.q_proj(x)), positions, self.theta)
        k, v = self.kv(x, positions)
        keys, vals = torch.cat([ctx_k, k], -3), torch.cat([ctx_v, v], -3)
        o = F.scaled_dot_product_attention(q.transpose(-3, -2), keys.transpose(-3, -2).to(q.dtype),
                                           vals.transpose(-3, -2).to(q.dtype), attn_mask=visible.unsqueeze(-3))
        h = h + self.o_proj(o.transpose(-3, -2).flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))


class BlockDrafter(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        hid = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layers) * hid, hid, bias=False)
        self.context_norm = RMSNorm(hid, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(hid))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(hid, cfg.rms_norm_eps)
        self.markov_in = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_out = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor):
        """Target features [..., T, len(target_layers) * hidden] -> per-layer (keys, values), stacked [N, ..., T, H, D]."""
        c = self.context_norm(self.fc(feats))
        kvs = [layer.kv(c, positions) for layer in self.layers]
        return torch.stack([k for k, _ in kvs]), torch.stack([v for _, v in kvs])

    def block_input(self, embed: nn.Embedding, anchor: torch.Tensor, k: int) -> torch.Tensor:
        """[anchor, mask x (k-1)]: anchor ids [...] -> [..., k, hidden]."""
        a = embed(anchor).unsqueeze(-2)
        m = self.mask_embedding.to(a.dtype).expand(*a.shape[:-2], k - 1, a.shape[-1])
        return torch.cat([a, m], -2)

    def blocks(self, x, positions, ctx_k, ctx_v, visible) -> torch.Tensor:
        """The block forward: x [..., K, hidden] -> final-normed hidden [..., K, hidden] (apply lm_head)."""
        for layer, k, v in zip(self.layers, ctx_k, ctx_v):
            x = layer(x, positions, k, v, visible)
        return self.norm(x)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """Logit bias [..., vocab] from the previous token ids [...]."""
        return self.markov_out(self.markov_in(prev))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)
        self.markov_out.weight.zero_()  # starts as the plain block drafter; training learns the bias


# ---- files -------------------------------------------------------------------------------------------------
def save_drafter(drafter: BlockDrafter, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(drafter.config.to_dict(), indent=2) + "\n")
    tensors = {n: p.detach().to("cpu", dtype).contiguous() for n, p in drafter.state_dict().items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def is_drafter_dir(path: str | Path) -> bool:
    p = Path(path) / "config.json"
    try:
        return p.is_file() and json.loads(p.read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError):
        return False


def load_drafter(path: str | Path, target: LingConfig, device="cpu", dtype: torch.dtype = torch.float32) -> BlockDrafter:
    """Load a drafter directory (config.json + model.safetensors) made for `target`; DraftConfigError if unusable."""
    from safetensors.torch import load_file

    path = Path(path)
    if not is_drafter_dir(path) or not (path / "model.safetensors").is_file():
        raise DraftConfigError(f"{path}: not a block-drafter directory (config.json with model_type "
                               f"{MODEL_TYPE!r} and model.safetensors)")
    cfg = DraftConfig.from_dict(json.loads((path / "config.json").read_text()))
    cfg.check_target(target)
    drafter = BlockDrafter(cfg)
    tensors = load_file(str(path / "model.safetensors"))
    expected = drafter.state_dict()
    if set(tensors) != set(expected):
        diff = sorted(set(tensors) ^ set(expected))
        raise DraftConfigError(f"{path}: tensors do not match config.json (first difference: {diff[0]})")
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise DraftConfigError(f"{path}: {name} has shape {list(t.shape)}, config.json implies "
                                   f"{list(expected[name].shape)}")
    drafter.load_state_dict(tensors)
    return drafter.to(device, dtype).eval()


def write_random_drafter(target: LingConfig, out_dir: str | Path, seed: int = 0, **kw) -> Path:
    """A random-weight drafter for `target` (tests, and a stand-in until a trained one exists)."""
    drafter = BlockDrafter(DraftConfig.for_target(target, **kw))
    drafter.init_weights(generator=torch.Generator().manual_seed(seed))
    return save_drafter(drafter, out_dir)
