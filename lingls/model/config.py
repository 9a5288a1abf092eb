"""LingConfig: the shape of a Ling-3.0 (`bailing_hybrid`) model, read from its config.json.

Two spellings of config.json exist: the official one (Ling-3.0-flash/-tiny: `head_dim` is the KDA head size,
`num_experts`, `n_group`, ...) and the one transformers writes (`linear_head_dim`, `num_experts_per_token`,
`num_expert_group`, `moe_renormalize`, and `head_dim` = the rope head size). Both are read here into one set of
fields. Keys that only describe metadata are ignored; a value this code cannot honour (another activation, a
rope scaling type, attention biases, ...) or an inconsistent set of values is a ConfigError naming the key.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

KDA = "kda"
MLA = "mla"
_LAYER_TYPE_NAMES = {"linear_attention": KDA, "kda": KDA, "full_attention": MLA, "mla": MLA, "attention": MLA}
_MLP_TYPE_NAMES = {"dense": "dense", "sparse": "moe", "moe": "moe"}

# transformers' spelling -> ours
_ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_expert_group": "n_group",
    "n_shared_experts": "num_shared_experts",
    "moe_renormalize": "norm_topk_prob",
    "num_mtp_layers": "num_nextn_predict_layers",
    "linear_conv_kernel_dim": "short_conv_kernel_size",
    "model_max_length": "max_position_embeddings",
    "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
}

# Keys that do not change the function the model computes (or are derived from others).
_IGNORED = {
    "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "initializer_range", "output_router_logits", "attention_dropout", "embedding_dropout", "output_dropout",
    "mtp_loss_scaling_factor", "pretraining_tp", "bos_token_id", "qk_head_dim", "linear_num_heads",
    "router_dtype", "moe_router_enable_expert_bias", "use_rmsnorm", "max_window_layers", "tokenizer_class",
    "_name_or_path", "name_or_path", "use_sliding_window", "sliding_window", "keys_to_ignore_at_inference",
    "aux_loss_alpha", "seq_aux", "router_aux_loss_coef", "z_loss_coef", "quantization_config", "is_decoder",
    "num_key_value_heads", "head_dim", "linear_head_dim", "rope_parameters", "layer_group_size",
    "first_k_dense_replace", "mlp_layer_types", "rotary_dim", "partial_rotary_factor", "moe_layer_freq",
}

# Keys whose value must be this for the math here to be the model's.
_REQUIRED_VALUES = {
    "hidden_act": "silu",
    "score_function": "sigmoid",
    "attention_bias": False,
    "use_bias": False,
    "use_qkv_bias": False,
    "use_qk_norm": False,
}


# The range of every size key. Ling-3.0-flash's and -tiny's values (/work/shared/docs/ling3-flash.md) and
# ling-nano's lie far inside; a value beyond is a typo or a config that does not describe its checkpoint, and
# building it would exhaust memory (modules on the meta device and tensor names cost memory too) before the
# checkpoint could say so. max_position_embeddings must leave room for a prompt and a completion.
_BOUNDS = {
    "vocab_size": (1, 2**20),
    "hidden_size": (1, 2**16),
    "num_hidden_layers": (1, 512),
    "num_attention_heads": (1, 1024),
    "head_dim": (1, 1024),
    "short_conv_kernel_size": (1, 64),
    "q_lora_rank": (1, 2**16),
    "kv_lora_rank": (1, 2**16),
    "qk_nope_head_dim": (1, 1024),
    "qk_rope_head_dim": (1, 1024),
    "v_head_dim": (1, 1024),
    "max_position_embeddings": (16, 2**24),
    "intermediate_size": (1, 2**20),
    "moe_intermediate_size": (1, 2**18),
    "shared_expert_intermediate_size": (1, 2**20),
    "num_experts": (1, 4096),
    "num_experts_per_tok": (1, 4096),
    "num_shared_experts": (0, 64),
    "n_group": (1, 4096),
    "topk_group": (1, 4096),
    "num_nextn_predict_layers": (0, 16),
}
_OPTIONAL = ("q_lora_rank", "shared_expert_intermediate_size")  # null is allowed


class ConfigError(ValueError):
    """config.json cannot describe a model this code computes; the message names the key."""


@dataclass
class LingConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: list[str]  # per layer: "kda" or "mla"
    mlp_types: list[str]  # per layer: "dense" or "moe"
    # KDA
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 6_000_000.0
    rope_interleave: bool = True
    max_position_embeddings: int = 131072
    # MLPs
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    shared_expert_intermediate_size: int | None = None  # default: moe_intermediate_size * num_shared_experts
    num_experts: int = 512
    num_experts_per_tok: int = 8
    num_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    expert_swiglu_limit_list: list[float] | None = None  # per layer, 0 = no clamp
    share_expert_swiglu_limit_list: list[float] | None = None
    # the rest
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    ignored_keys: list[str] = field(default_factory=list, compare=False, repr=False)

    # ---- derived ---------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one MLA latent-cache row: the compressed KV plus the shared rope key (576 for flash)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate(self) -> int:
        if self.shared_expert_intermediate_size is not None:
            return self.shared_expert_intermediate_size
        return self.moe_intermediate_size * self.num_shared_experts

    def expert_limit(self, layer: int) -> float:
        return _limit(self.expert_swiglu_limit_list, layer)

    def shared_limit(self, layer: int) -> float:
        return _limit(self.share_expert_swiglu_limit_list, layer)

    def parameter_count(self) -> int:
        """How many numbers the model's tensors hold, MTP layers included: what its checkpoint must hold,
        computed from the config alone (LingForCausalLM builds exactly these; a test keeps the two equal)."""
        hid, heads = self.hidden_size, self.num_attention_heads
        c = heads * self.head_dim
        kda = (5 * hid * c + hid * heads + 3 * c * self.short_conv_kernel_size + heads + c + self.head_dim
               + c * hid)  # q k v f g, b, the three convs, A_log, dt_bias, o_norm, dense
        qdim = heads * self.qk_head_dim
        query = (hid * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * qdim if self.q_lora_rank
                 else hid * qdim)
        mla = (query + hid * self.latent_dim + self.kv_lora_rank + self.kv_lora_rank * heads * (self.qk_nope_head_dim
               + self.v_head_dim) + hid * heads + heads * self.v_head_dim * hid)
        dense = 3 * hid * self.intermediate_size
        moe = (self.num_experts * hid + self.num_experts + 3 * self.num_experts * hid * self.moe_intermediate_size
               + (3 * hid * self.shared_intermediate if self.num_shared_experts else 0))
        norms = 2 * hid
        layers = sum(norms + (kda if kind == KDA else mla) + (dense if mlp == "dense" else moe)
                     for kind, mlp in zip(self.layer_types, self.mlp_types))
        mtp = norms + mla + moe + 2 * hid + 2 * hid * hid + hid  # enorm, hnorm, eh_proj, final_layernorm
        return 2 * self.vocab_size * hid + hid + layers + self.num_nextn_predict_layers * mtp

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == MLA]

    # ---- reading and writing ----------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | Path) -> "LingConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, raw: dict) -> "LingConfig":
        if not isinstance(raw, dict):
            raise ConfigError("config.json must hold a JSON object")
        model_type = raw.get("model_type", "bailing_hybrid")
        if model_type not in ("bailing_hybrid", "bailing_moe_v3", "ling"):
            raise ConfigError(f"model_type: {model_type!r} is not a Ling-3.0 (bailing_hybrid) model")
        d = {_ALIASES.get(k, k): v for k, v in raw.items()}
        for key, want in _REQUIRED_VALUES.items():
            if key in d and d[key] is not None and d[key] != want:
                raise ConfigError(f"{key}: {d[key]!r} is not supported (only {want!r})")
        known = {f.name for f in fields(cls)} - {"ignored_keys", "layer_types", "mlp_types"}
        kwargs = {k: d[k] for k in known if k in d and d[k] is not None}
        if "linear_head_dim" in d:  # transformers' spelling: head_dim there is the rope head size
            kwargs["head_dim"] = d["linear_head_dim"]
        if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict):
            kwargs["rope_theta"] = d["rope_parameters"].get("rope_theta", cls.rope_theta)
        for key in ("rope_scaling", "rope_parameters"):
            spec = d.get(key)
            if isinstance(spec, dict) and spec.get("rope_type", spec.get("type", "default")) not in ("default", None):
                raise ConfigError(f"{key}: rope type {spec.get('rope_type', spec.get('type'))!r} is not supported")
        if d.get("q_lora_rank") is None:
            kwargs.pop("q_lora_rank", None)
        for req in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if req not in d:
                raise ConfigError(f"{req}: missing")
        n = _bounded("num_hidden_layers", d["num_hidden_layers"])  # before the per-layer lists are built
        kwargs["layer_types"] = _layer_types(d, n)
        kwargs["mlp_types"] = _mlp_types(d, n)
        if "num_key_value_heads" in d and d["num_key_value_heads"] not in (None, d["num_attention_heads"]):
            raise ConfigError("num_key_value_heads: must equal num_attention_heads (MLA has no grouped KV here)")
        cfg = cls(**kwargs)
        cfg.ignored_keys = sorted(k for k in d if k not in known and k not in _IGNORED and k not in _REQUIRED_VALUES
                                  and k not in ("rope_scaling", "layer_types", "mlp_layer_types"))
        cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        """The official config.json spelling (what the real checkpoint ships)."""
        d = asdict(self)
        d.pop("ignored_keys")
        layer_types, mlp_types = d.pop("layer_types"), d.pop("mlp_types")
        d = {k: v for k, v in d.items() if v is not None}
        d["layer_types"] = ["linear_attention" if t == KDA else "full_attention" for t in layer_types]
        d["mlp_layer_types"] = ["dense" if t == "dense" else "sparse" for t in mlp_types]
        d["first_k_dense_replace"] = next((i for i, t in enumerate(mlp_types) if t == "moe"), len(mlp_types))
        return {"architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_hybrid", **d}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    # ---- consistency ------------------------------------------------------------------------------------
    def validate(self) -> None:
        for key in _BOUNDS:
            value = getattr(self, key)
            if value is not None or key not in _OPTIONAL:
                _bounded(key, value)
        for key in ("rope_theta", "rms_norm_eps", "routed_scaling_factor"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{key}: must be a positive finite number, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim: must be even, got {self.qk_rope_head_dim}")
        bound = self.kda_lower_bound
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not -math.inf < bound < 0:
            raise ConfigError(f"kda_lower_bound: must be a negative finite number, got {bound!r}")
        n = self.num_hidden_layers
        for key in ("layer_types", "mlp_types"):
            if len(getattr(self, key)) != n:
                raise ConfigError(f"{key}: {len(getattr(self, key))} entries for num_hidden_layers={n}")
        if "moe" in self.mlp_types:
            if self.num_experts % self.n_group:
                raise ConfigError(f"n_group: num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
            per_group = self.num_experts // self.n_group
            if self.topk_group > self.n_group:
                raise ConfigError(f"topk_group: {self.topk_group} > n_group={self.n_group}")
            if per_group < 2:
                raise ConfigError(f"n_group: groups of {per_group} expert(s); group scores need at least 2")
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise ConfigError(f"num_experts_per_tok: {self.num_experts_per_tok} > "
                                  f"the {self.topk_group * per_group} experts in the kept groups")
        for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            limits = getattr(self, key)
            if limits is not None:
                if not isinstance(limits, list) or len(limits) not in (n, n + self.num_nextn_predict_layers):
                    raise ConfigError(f"{key}: must be a list of one limit per layer ({n}), got {limits!r}")
                if any(not isinstance(x, (int, float)) or x < 0 for x in limits):
                    raise ConfigError(f"{key}: limits must be numbers >= 0 (0 = no clamp)")


def _bounded(key: str, value) -> int:
    """`value` if it is an integer in the range of `key` (_BOUNDS), else a ConfigError naming the key."""
    low, high = _BOUNDS[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{key}: {value} is outside [{low}, {high}], the sizes a Ling-3.0 model can have")
    return value


def _limit(limits: list[float] | None, layer: int) -> float:
    if not limits or layer >= len(limits):
        return 0.0
    return float(limits[layer])


def _layer_types(d: dict, n: int) -> list[str]:
    if d.get("layer_types") is not None:
        types = d["layer_types"]
        if not isinstance(types, list):
            raise ConfigError("layer_types: must be a list")
        out = []
        for t in types:
            if t not in _LAYER_TYPE_NAMES:
                raise ConfigError(f"layer_types: unknown layer type {t!r} (known: linear_attention, full_attention)")
            out.append(_LAYER_TYPE_NAMES[t])
        if len(out) != n:
            raise ConfigError(f"layer_types: {len(out)} entries for num_hidden_layers={n}")
        return out
    group = d.get("layer_group_size")
    if not isinstance(group, int) or group <= 0:
        raise ConfigError(f"layer_group_size: must be a positive integer when layer_types is absent, got {group!r}")
    return [MLA if (i + 1) % group == 0 else KDA for i in range(n)]


def _mlp_types(d: dict, n: int) -> list[str]:
    if d.get("mlp_layer_types") is not None:
        types = d["mlp_layer_types"]
        if not isinstance(types, list) or len(types) != n:
            raise ConfigError(f"mlp_layer_types: must be a list of {n} entries")
        for t in types:
            if t not in _MLP_TYPE_NAMES:
                raise ConfigError(f"mlp_layer_types: unknown type {t!r} (known: dense, sparse)")
        return [_MLP_TYPE_NAMES[t] for t in types]
    k = d.get("first_k_dense_replace", 0)
    if not isinstance(k, int) or not 0 <= k <= n:
        raise ConfigError(f"first_k_dense_replace: must be an integer in [0, {n}], got {k!r}")
    return ["dense" if i < k else "moe" for i in range(n)]


def flash_config(num_hidden_layers: int = 42) -> LingConfig:
    """Ling-3.0-flash's shapes (optionally fewer layers, for benchmarks that fit one GPU)."""
    return LingConfig.from_dict({
        "vocab_size": 157184, "hidden_size": 2560, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 32, "head_dim": 128, "layer_group_size": 6, "first_k_dense_replace": 2,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 512, "num_experts_per_tok": 8,
        "num_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "rope_theta": 6e6, "num_nextn_predict_layers": 1, "eos_token_id": 156895, "pad_token_id": 156892,
    })


def tiny_config(num_hidden_layers: int = 24) -> LingConfig:
    """Ling-3.0-tiny's shapes: q_lora_rank set, 128 experts, no MTP."""
    return LingConfig.from_dict({
        "vocab_size": 157184, "hidden_size": 1536, "num_hidden_layers": num_hidden_layers, "num_attention_heads": 16,
        "head_dim": 128, "layer_group_size": 4, "first_k_dense_replace": 1, "intermediate_size": 4608,
        "moe_intermediate_size": 512, "num_experts": 128, "num_experts_per_tok": 8, "num_shared_experts": 1,
        "n_group": 8, "topk_group": 4, "q_lora_rank": 256, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "num_nextn_predict_layers": 0,
    })
