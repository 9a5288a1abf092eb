"""The benchmarks' one floor computation (`lingls.bench.floor`) at tiny shapes on a CPU: the experts a step routes
to, counted on the torch step and on the fused step (whose kernel routes past any Router hook), and the bytes
and FLOPs the floors divide."""

import pytest
import torch

from lingls.bench import floor
from lingls.model.ling import LingForCausalLM, MoE
from tests.model.conftest import randomize, small_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LingForCausalLM(small_config(num_hidden_layers=4, num_experts=16, n_group=4, topk_group=2,
                                     num_experts_per_tok=3))
    m.init_weights()
    randomize(m, 0)
    return m.eval()


def _moe_layers(model):
    return [layer.mlp for layer in model.decoder_layers if isinstance(layer.mlp, MoE)]


def test_routed_experts_of_the_torch_step(model):
    ids = torch.randint(0, 96, (5,), generator=torch.Generator().manual_seed(1))
    state = model.new_state(32)
    seen = floor.routed_experts(model, lambda: model.step(ids, state, torch.arange(5)))
    assert len(seen) == len(_moe_layers(model)) == 3
    assert all(3 <= n <= 15 for n in seen)  # 5 tokens x 3 experts of 16, some shared


def test_routed_experts_of_the_fused_step_are_the_torch_steps(model):
    """The fused step's routing is counted (its kernel bypasses the Router module: a hook alone saw 0 experts),
    and it is the routing of the torch step on the same tokens."""
    pytest.importorskip("triton")
    from lingls.runtime.fused_step import FusedStep

    fused = FusedStep(model, kernels=False)
    ids = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(6)
    by_fused = floor.routed_experts(model, lambda: fused.step(ids, model.new_state(32), pos), fused=fused)
    by_torch = floor.routed_experts(model, lambda: model.step(ids, model.new_state(32), pos))
    assert by_fused == by_torch and len(by_fused) == 3 and min(by_fused) >= 3
    assert "_mlp" not in vars(fused)  # the fused step is left as it was


def test_step_bytes_by_part(model):
    cfg = model.config
    size = lambda p: p.numel() * p.element_size()  # noqa: E731
    experts = [4, 5, 6]
    parts = floor.step_bytes(model, t=2, context=10, experts=experts)
    moe = _moe_layers(model)[0].experts
    assert parts["weights_routed"] == 15 * (size(moe.gate_up_proj[0]) + size(moe.down_proj[0]))
    assert parts["embedding_rows"] == 2 * cfg.hidden_size * 4
    assert parts["mla_kv"] == 12 * len(cfg.mla_layers) * cfg.latent_dim * 4
    heads = cfg.num_attention_heads
    assert parts["kda_state_rw"] == 2 * len(cfg.kda_layers) * (heads * cfg.head_dim ** 2 * 4 + 3 * heads * cfg.head_dim
                                                               * (cfg.short_conv_kernel_size - 1) * 4)
    routed_all = sum(size(p) for n, p in model.named_parameters() if ".mlp.experts." in n)
    embedding = size(model.model.word_embeddings.weight)
    assert parts["weights_always"] == sum(size(p) for p in model.parameters()) - routed_all - embedding
    no_head = floor.step_bytes(model, 2, 10, experts, head=False)
    head = size(model.lm_head.weight) + size(model.model.norm.weight)
    assert parts["weights_always"] - no_head["weights_always"] == head
    assert floor.step_bytes(model, 2, 10, 5)["weights_routed"] == parts["weights_routed"]  # one number for all layers
    assert floor.step_floor_ms(model, 2, 10, experts, 1e9) == pytest.approx(sum(parts.values()) / 1e6)
    with pytest.raises(ValueError):
        floor.step_bytes(model, 2, 10, [1, 2])


def test_prefill_flops_and_floor(model):
    cfg = model.config
    total, active = model.parameter_counts()
    vectors = sum(p.numel() for p in model.parameters() if p.dim() < 2)
    head = model.lm_head.weight.numel()
    t = 40
    attention = floor.prefill_flops(model, t) - 2.0 * (active - vectors - head) * t - 2.0 * head
    heads, d = cfg.num_attention_heads, cfg.head_dim
    assert attention == pytest.approx(len(cfg.mla_layers) * heads * t * (t + 1) / 2 * (cfg.qk_head_dim + cfg.v_head_dim)
                                      * 2 + len(cfg.kda_layers) * heads * t * (4 * 64 * d + 6 * d * d))
    nbytes = floor.prefill_bytes(model, t, 16)  # every expert of every layer
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "word_embeddings" not in n)
    assert nbytes > weights
    f = floor.prefill_floor_ms(2e12, 3e9, peak_tflops=1.0, bandwidth=1e12)
    assert f == {"flop_ms": 2000.0, "byte_ms": 3.0, "floor_ms": 2000.0}
