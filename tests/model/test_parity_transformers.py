"""The model is the same function as transformers' BailingHybridForCausalLM (random weights, float32)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import BailingHybridConfig, BailingHybridForCausalLM  # noqa: E402

from lingls.model import load_model  # noqa: E402

from .conftest import randomize  # noqa: E402

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8,
            head_dim=8, pad_token_id=0, eos_token_id=1)

CASES = {
    # two MLA layers, one dense layer, 2 expert groups
    "mla-x2": dict(num_hidden_layers=4, layer_group_size=2, first_k_dense_replace=1, num_local_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=1),
    # three MLA layers, two dense layers, 4 groups keeping 2, top-4 of 16, no renormalisation
    "groups-x4": dict(num_hidden_layers=7, layer_group_size=3, first_k_dense_replace=2, num_local_experts=16,
                      num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.7),
    # explicit layer list: MLA first and last, all MoE
    "explicit": dict(num_hidden_layers=4, layer_types=["full_attention", "linear_attention", "linear_attention",
                                                        "full_attention"], first_k_dense_replace=0,
                     num_local_experts=8, num_experts_per_tok=3, n_group=2, topk_group=2),
}


def hf_checkpoint(tmp_path, case: str, seed: int):
    torch.manual_seed(seed)
    model = BailingHybridForCausalLM(BailingHybridConfig(**BASE, **CASES[case])).eval()
    randomize(model, seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed, length", [(0, 1), (1, 37), (2, 150)])
def test_logits_match_transformers(tmp_path, case, seed, length):
    reference = hf_checkpoint(tmp_path, case, seed)
    ours = load_model(tmp_path)
    ids = torch.randint(0, BASE["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed + 100))
    with torch.no_grad():
        want = reference(ids[None]).logits[0]
    got = ours.logits(ids)
    assert got.shape == (length, BASE["vocab_size"])
    assert (got - want).abs().max().item() <= 1e-4


def test_batched_full_forward_matches_transformers(tmp_path):
    reference = hf_checkpoint(tmp_path, "groups-x4", 5)
    ours = load_model(tmp_path)
    ids = torch.randint(0, BASE["vocab_size"], (3, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max().item() <= 1e-4
