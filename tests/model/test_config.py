import json

import pytest
import torch

from lingls.model.config import ConfigError, LingConfig, flash_config, tiny_config
from lingls.model.ling import LingForCausalLM

from .conftest import small_config


def test_flash_layout_and_parameter_counts():
    cfg = flash_config()
    assert cfg.mla_layers == [5, 11, 17, 23, 29, 35, 41]
    assert len(cfg.kda_layers) == 35
    assert cfg.mlp_types[:3] == ["dense", "dense", "moe"]
    assert cfg.latent_dim == 576 and cfg.qk_head_dim == 192
    with torch.device("meta"):
        total, active = LingForCausalLM(cfg).parameter_counts()
    assert round(total / 1e9, 1) == 124.4
    assert round(active / 1e9, 2) == 5.10


def test_tiny_has_query_lora_and_no_mtp():
    cfg = tiny_config()
    assert cfg.q_lora_rank == 256 and cfg.num_nextn_predict_layers == 0
    assert cfg.mla_layers == [3, 7, 11, 15, 19, 23]
    with torch.device("meta"):
        m = LingForCausalLM(cfg)
    assert hasattr(m.model.layers[3].attention, "q_a_proj")


def test_transformers_spelling_is_read():
    raw = {"model_type": "bailing_hybrid", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 2, "head_dim": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 3,
           "num_local_experts": 8, "num_experts_per_token": 2, "num_expert_group": 2, "topk_group": 1,
           "moe_renormalize": False,
           "layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"],
           "qk_rope_head_dim": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
           "transformers_version": "5.23.0", "dtype": "float32"}
    cfg = LingConfig.from_dict(raw)
    assert (cfg.head_dim, cfg.short_conv_kernel_size, cfg.num_experts, cfg.num_experts_per_tok) == (16, 3, 8, 2)
    assert cfg.n_group == 2 and cfg.norm_topk_prob is False and cfg.rope_theta == 1000.0
    assert cfg.layer_types == ["kda", "mla"] and cfg.mlp_types == ["dense", "moe"]


def test_round_trip_through_json(tmp_path):
    cfg = small_config(expert_swiglu_limit_list=[0, 7.0, 7.0, 7.0], q_lora_rank=12)
    cfg.save(tmp_path / "config.json")
    again = LingConfig.from_json(tmp_path / "config.json")
    assert again == cfg


@pytest.mark.parametrize("change, key", [
    ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["linear_attention"]}, "layer_types"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 4}, "topk_group"),
    ({"num_experts_per_tok": 7}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope_scaling"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"expert_swiglu_limit_list": [1.0]}, "expert_swiglu_limit_list"),
    ({"first_k_dense_replace": 9}, "first_k_dense_replace"),
    ({"q_lora_rank": -1}, "q_lora_rank"),
    ({"model_type": "llama"}, "model_type"),
])
def test_bad_values_name_the_key(change, key):
    raw = json.loads(json.dumps(small_config().to_dict()))
    raw.pop("mlp_layer_types") if key == "first_k_dense_replace" else None
    raw.update(change)
    with pytest.raises(ConfigError, match=key):
        LingConfig.from_dict(raw)


def test_missing_required_key_is_named():
    raw = small_config().to_dict()
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        LingConfig.from_dict(raw)


def test_layer_types_from_group_size():
    raw = small_config().to_dict()
    del raw["layer_types"]
    raw.update(num_hidden_layers=6, layer_group_size=3, mlp_layer_types=None, first_k_dense_replace=2)
    cfg = LingConfig.from_dict(raw)
    assert cfg.layer_types == ["kda", "kda", "mla", "kda", "kda", "mla"]
    assert cfg.mlp_types == ["dense", "dense", "moe", "moe", "moe", "moe"]


def nano_config() -> LingConfig:
    from lingls.engine.local import EMBEDDED

    return LingConfig.from_json(EMBEDDED / "config.json")


@pytest.mark.parametrize("make", [flash_config, tiny_config, nano_config, lambda: small_config(q_lora_rank=12,
                                  num_nextn_predict_layers=2, num_shared_experts=0)])
def test_parameter_count_is_what_the_model_builds(make):
    cfg = make()
    with torch.device("meta"):
        model = LingForCausalLM(cfg)
    assert cfg.parameter_count() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("change, key", [
    ({"num_hidden_layers": 1_000_000}, "num_hidden_layers"),
    ({"num_hidden_layers": 10**15}, "num_hidden_layers"),
    ({"num_hidden_layers": "4"}, "num_hidden_layers"),
    ({"num_experts": 10**8, "n_group": 2}, "num_experts"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"max_position_embeddings": 10**12}, "max_position_embeddings"),
    ({"vocab_size": 2**40}, "vocab_size"),
    ({"hidden_size": 10**9}, "hidden_size"),
    ({"moe_intermediate_size": 10**9}, "moe_intermediate_size"),
    ({"num_nextn_predict_layers": 1000}, "num_nextn_predict_layers"),
    ({"num_shared_experts": -1}, "num_shared_experts"),
    ({"rope_theta": float("nan")}, "rope_theta"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"kda_lower_bound": float("-inf")}, "kda_lower_bound"),
])
def test_absurd_sizes_are_refused_naming_the_key(change, key):
    raw = json.loads(json.dumps(small_config().to_dict()))
    raw.update(change)
    if "num_hidden_layers" in change:
        raw.pop("layer_types"), raw.pop("mlp_layer_types")
        raw["layer_group_size"] = 2
    with pytest.raises(ConfigError, match=key):
        LingConfig.from_dict(raw)


def test_every_real_config_is_within_the_bounds():
    for cfg in (flash_config(), tiny_config(), nano_config()):
        assert LingConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
