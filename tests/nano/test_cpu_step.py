"""CpuStep (the lean CPU step for decode and short prefills) computes the model's own step: hidden states, the
head's input and every state tensor, on random weights and inputs, in each of its forms (the chosen experts
gathered or all computed; MLA with and without a query LoRA; the bounded and the softplus KDA gate; SwiGLU
clamps), and the runner greedy-decodes the same tokens with it as without, prefix reuse included."""

from __future__ import annotations

import pytest
import torch

from lingls.model.ling import LingForCausalLM
from lingls.runtime import cpu_step
from lingls.runtime.cpu_step import CpuStep
from lingls.runtime.runner import ModelRunner, Sampling
from tests.model.conftest import randomize, small_config

FORMS = {
    "nano-like": dict(),
    "query-lora, softplus gate, clamps": dict(q_lora_rank=12, kda_safe_gate=False,
                                              expert_swiglu_limit_list=[0, 0, 0.5, 0.5],
                                              share_expert_swiglu_limit_list=[0, 0.4, 0, 0.4]),
    "no shared expert, plain rope": dict(num_shared_experts=0, rope_interleave=False, num_experts=16,
                                         num_experts_per_tok=4, n_group=4, topk_group=2),
}


@pytest.fixture(autouse=True)
def one_thread():
    """As LocalEngine runs a model on the CPU (and the model's own step, the reference here, is ten times slower
    with two threads on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(seed: int = 0, **over) -> LingForCausalLM:
    torch.manual_seed(seed)
    m = LingForCausalLM(small_config(num_hidden_layers=4, **over))
    m.init_weights(std=0.2, generator=torch.Generator().manual_seed(seed))
    randomize(m, seed)
    return m.eval()


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 2e-5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("form", FORMS, ids=list(FORMS))
def test_step_equals_the_models(form):
    model = build(**FORMS[form])
    ids = torch.randint(0, 96, (140,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        prefilled = model.new_state(160)
        model.step(ids[:40], prefilled, torch.arange(40))
        want_state, state = prefilled.clone(), prefilled.clone()
        lean = CpuStep(model)
        start = 40
        # one token (experts gathered), then sizes past the gather's share (experts computed densely), with
        # the keys bounded by a bucket past the position, by the position, and not at all
        for t, kv_len in ((1, 64), (1, None), (2, 64), (5, 45 + 5), (16, None), (1, 128),
                          (cpu_step.MAX_TOKENS, None)):
            pos = torch.arange(start, start + t)
            want, want_normed = model.step(ids[start:start + t], want_state, pos, kv_len=kv_len, normed=True)
            got, normed = lean.step(ids[start:start + t], state, pos, kv_len=kv_len, normed=True)
            close(got, want)
            close(normed, want_normed)
            close(lean.head(got, normed), model.head(want, want_normed))
            close(lean.head(got), model.head(want))
            start += t
        close(state.kda, want_state.kda)
        close(state.conv, want_state.conv)
        close(state.latent, want_state.latent)


def test_joined_weights_are_the_models_own():
    """The joined projections are the memory the model's parameters now view: one copy of each weight."""
    model = build()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lean = CpuStep(model)
    attn = model.model.layers[0].attention
    assert attn.q_proj.weight.data_ptr() == lean.layers[0]["proj_t"].data_ptr()
    assert model.lm_head.weight.data_ptr() == lean.head_t.data_ptr()  # the head's transpose, viewed back
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_cpu_runner_reads_exactly_the_sequences_rows():
    """No CUDA graphs on a CPU, so no power-of-two bucket of latent rows: a step reads the rows it needs."""
    runner = ModelRunner(build(), capacity=256)
    assert [runner.bucket(n) for n in (1, 100, 257)] == [1, 100, 256]


def test_what_it_does_not_serve_is_refused():
    model = build()
    with pytest.raises(ValueError, match="prefill"):
        t = cpu_step.MAX_TOKENS + 1
        CpuStep(model).step(torch.zeros(t, dtype=torch.long), model.new_state(t), torch.arange(t))
    assert not cpu_step.supports(build().to(torch.bfloat16))
    with pytest.raises(ValueError, match="fp32"):
        CpuStep(build().to(torch.bfloat16))


def test_runner_decodes_the_same_tokens():
    """Greedy generations through ModelRunner with and without the lean step: the same tokens, for a fresh
    prompt, a keystroke at its end (the prefix reused) and a prompt longer than the lean step's sizes."""
    model = build(seed=3)
    with torch.no_grad():  # peaked logits: greedy choices far from ties
        model.lm_head.weight.mul_(8)
    plain, lean = ModelRunner(model, capacity=256), ModelRunner(model, capacity=256, lean_cpu=True)
    assert plain.fused is None and isinstance(lean.fused, CpuStep)
    with pytest.raises(ValueError, match="lean_cpu=False"):  # speculative rounds stage KDA: not the lean step's
        lean.attach(object())
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(5, 96, (60,), generator=g).tolist()
    for p in (prompt, prompt + [7], prompt + [7, 9], prompt[:-1] + [11], prompt[:30]):
        want = list(plain.generate(p, 12, Sampling()))
        got = list(lean.generate(p, 12, Sampling()))
        assert got == want
    assert lean.cache.stats.tokens_saved == plain.cache.stats.tokens_saved > 0


def test_cpu_threads_come_from_the_environment(monkeypatch):
    from lingls.engine.local import CPU_THREADS, cpu_threads
    from lingls.engine.protocol import EngineError

    monkeypatch.delenv("LINGLS_THREADS", raising=False)
    assert cpu_threads() == CPU_THREADS == 1
    monkeypatch.setenv("LINGLS_THREADS", " 3 ")
    assert cpu_threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("LINGLS_THREADS", bad)
        with pytest.raises(EngineError, match="LINGLS_THREADS"):
            cpu_threads()


def test_a_cpu_prefill_groups_few_experts_by_expert():
    """A prefill piece on a CPU runs a few experts (ling-nano's 16) grouped by expert, not all of them on every
    token: the same function as the dense form, at a quarter of its expert arithmetic."""
    from lingls.model import ling

    experts = build(num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2).decoder_layers[1].mlp.experts
    gen = torch.Generator().manual_seed(5)
    n = ling.GATHER_EXPERTS_MAX_TOKENS + 50
    x = torch.randn(n, experts.gate_up_proj.shape[-1], generator=gen)
    idx = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(n)])
    weights = torch.rand(n, 4, generator=gen)
    with torch.inference_mode():
        close(experts(x, weights, idx), experts._dense(x, weights, idx))


@pytest.mark.parametrize("groups", [(4, 2), (4, 4), (1, 1), (8, 3)])
def test_the_lean_route_chooses_as_the_reference(groups):
    """The lean router: the reference's experts, in its order, and its weights, with and without group limits."""
    from types import SimpleNamespace

    from lingls.kernels import reference as ref

    n_group, topk_group = groups
    gen = torch.Generator().manual_seed(n_group * 10 + topk_group)
    for normalize in (True, False):
        router = SimpleNamespace(expert_bias=torch.randn(32, generator=gen) * 0.1, top_k=4, n_group=n_group,
                                 topk_group=topk_group, normalize=normalize, scale=2.5)
        logits = torch.randn(7, 32, generator=gen)
        w, idx = cpu_step.route(logits, router)
        want_w, want_idx = ref.route_grouped_topk(logits, router.expert_bias, 4, n_group, topk_group, normalize, 2.5)
        assert torch.equal(idx, want_idx)
        assert torch.equal(w, want_w)


def test_ling_nano_decodes_the_same_lines_with_the_lean_step(assets):
    """On the shipped ling-nano (whatever its size): greedy lines of real code through the lean step and through
    the model's own step, cold and after a one-line edit (prefix reused), are the same tokens."""
    import os
    from pathlib import Path

    from lingls.engine.tokenizer import Tokenizer
    from lingls.model import load_model

    model = load_model(assets, device="cpu", dtype=torch.float32)
    text = Path(os.__file__).with_name("argparse.py").read_text()
    ids = Tokenizer(assets).encode(text)
    # the lean step re-points the model's weights at its layouts: the plain runner reads the same numbers
    plain, lean = ModelRunner(model, capacity=512), ModelRunner(model, capacity=512, lean_cpu=True)
    for start in (3000, 9000):
        prompt = ids[start:start + 300]
        for p in (prompt, prompt + ids[start + 300:start + 302]):
            assert list(lean.generate(p, 10, Sampling())) == list(plain.generate(p, 10, Sampling()))
