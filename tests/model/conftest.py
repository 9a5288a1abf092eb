"""Shared builders: small random Ling configs and transformers reference models."""

from __future__ import annotations

import pytest
import torch

from lingls.model.config import LingConfig


def small_config(**over) -> LingConfig:
    raw = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=8,
               layer_group_size=2, first_k_dense_replace=1, intermediate_size=48, moe_intermediate_size=16,
               num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16,
               qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_nextn_predict_layers=0)
    raw.update(over)
    return LingConfig.from_dict(raw)


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    """Perturb every parameter (norm weights and the router bias too) so no term hides behind a 0 or a 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture
def small():
    return small_config
