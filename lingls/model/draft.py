"""The older lingls-only block-drafter format (`model_type: lingls-block-drafter`), read into the DSpark module.

ling-nano's shipped drafter (`lingls/assets/ling-nano/draft`) was distilled in this format before lingls ran
DSpark checkpoints. It is the DSpark math (`lingls.model.dspark`) with three differences, which the converted
module keeps: no q/k norms, a learned mask vector instead of the target's embedding of a mask token, and no
confidence head; its names differ (`context_norm`, `markov_in`/`markov_out`, projections directly under each
layer). One runtime path (`speculative.DSparkRuntime`) serves both. The format stays loadable until a
DSpark-layout ling-nano drafter ships (`training/draft/distill.py` now writes that layout); nothing writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lingls.model.config import LingConfig
from lingls.model.dspark import DSparkConfig, DSparkConfigError, DSparkDrafter, fill_shards
from lingls.model.ling import Parallel

MODEL_TYPE = "lingls-block-drafter"
_KEYS = {"hidden_size", "vocab_size", "target_layers", "block_size", "num_layers", "num_heads", "head_dim",
         "intermediate_size", "markov_rank", "rms_norm_eps", "rope_theta"}
_RENAMES = {"context_norm.weight": "hidden_norm.weight", "markov_in.weight": "markov_head.markov_w1.weight",
            "markov_out.weight": "markov_head.markov_w2.weight"}


def is_drafter_dir(path: str | Path) -> bool:
    p = Path(path) / "config.json"
    try:
        return p.is_file() and json.loads(p.read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def config_from_dict(d: dict) -> DSparkConfig:
    """The old config.json as the equivalent DSparkConfig."""
    d = dict(d)
    if d.pop("model_type", None) != MODEL_TYPE:
        raise DSparkConfigError(f"model_type must be {MODEL_TYPE!r}")
    unknown = sorted(set(d) - _KEYS)
    missing = sorted({"hidden_size", "vocab_size", "target_layers"} - set(d))
    if unknown or missing:
        raise DSparkConfigError(f"unknown keys {unknown}" if unknown else f"config.json lacks {missing[0]!r}")
    heads = int(d.get("num_heads", 4))
    cfg = DSparkConfig(
        hidden_size=int(d["hidden_size"]), vocab_size=int(d["vocab_size"]), target_layer_ids=list(d["target_layers"]),
        mask_token_id=0, num_hidden_layers=int(d.get("num_layers", 2)), num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=int(d.get("head_dim", 64)),
        intermediate_size=int(d.get("intermediate_size", 768)), block_size=int(d.get("block_size", 8)),
        markov_rank=int(d.get("markov_rank", 32)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(d.get("rope_theta", 10000.0)), confidence_head=False, qk_norm=False, learned_mask=True)
    cfg.validate()
    return cfg


def _new_name(old: str) -> str:
    if old in _RENAMES:
        return _RENAMES[old]
    parts = old.split(".")
    if parts[0] == "layers" and parts[2] in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return ".".join(parts[:2] + ["self_attn"] + parts[2:])
    return old


def load_drafter(path: str | Path, target: LingConfig, par: Parallel | None = None, device="cpu",
                 dtype: torch.dtype = torch.float32) -> DSparkDrafter:
    """Load an old-format drafter directory (config.json + model.safetensors) for `target` as a DSparkDrafter
    (rank `par.rank`'s shard); DSparkConfigError if unusable."""
    from safetensors.torch import load_file

    path = Path(path)
    if not is_drafter_dir(path) or not (path / "model.safetensors").is_file():
        raise DSparkConfigError(f"{path}: not a block-drafter directory (config.json with model_type "
                                f"{MODEL_TYPE!r} and model.safetensors)")
    cfg = config_from_dict(json.loads((path / "config.json").read_text()))
    cfg.check_target(target)
    tensors = {_new_name(n): t for n, t in load_file(str(path / "model.safetensors")).items()}
    return fill_shards(cfg, par or Parallel(), device, dtype, tensors, str(path))
