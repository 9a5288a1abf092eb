"""The training step's faster forms against the eager ones they replace, on CPU: the chunked linear
cross-entropy (training.linear_ce) and the compiled layers (training.train.compile_for_training, traced through
torch.compile with the aot_eager backend: the same graphs inductor compiles on the GPU, run by torch's kernels)."""

import pytest
import torch
import torch.nn.functional as F

from lingls.model import LingConfig, LingForCausalLM, ling
from training import linear_ce
from training.linear_ce import linear_cross_entropy
from training.train import ExpertBalancer, compile_for_training, losses, route_by_kernel

CFG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, head_dim=16,
           layer_group_size=3, first_k_dense_replace=1, intermediate_size=64, moe_intermediate_size=16,
           num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=1)


def model(seed: int = 0) -> LingForCausalLM:
    m = LingForCausalLM(LingConfig.from_dict(CFG))
    m.init_weights(0.2, generator=torch.Generator().manual_seed(seed))
    return m


def grads(m: LingForCausalLM) -> dict:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("rows,chunk", [(1, 4), (37, 8), (64, 64), (50, 1000)])
def test_linear_cross_entropy_is_cross_entropy_of_the_logits(rows, chunk):
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 24, generator=g, requires_grad=True)
    w = torch.randn(40, 24, generator=g, requires_grad=True)
    t = torch.randint(0, 40, (rows,), generator=g)
    got = linear_cross_entropy(h, w, t, chunk_rows=chunk)
    (3 * got).backward()
    got_h, got_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    want = F.cross_entropy(F.linear(h, w), t)
    (3 * want).backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_h, h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_w, w.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk_rows=chunk), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows,chunk", [(37, 8), (50, 1000)])
def test_compiled_chunks_give_the_eager_chunks_loss_and_gradients(monkeypatch, rows, chunk):
    """`compile_chunks` (traced through torch.compile with the aot_eager backend: the graph inductor compiles on
    the GPU, run by torch's kernels) against the eager chunks, values and both gradients."""
    monkeypatch.setattr(linear_ce, "_chunk", linear_ce._chunk)
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 24, generator=g, requires_grad=True)
    w = torch.randn(40, 24, generator=g, requires_grad=True)
    t = torch.randint(0, 40, (rows,), generator=g)
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        linear_ce.compile_chunks(compiled, backend="aot_eager")
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, t, chunk_rows=chunk)
        (2 * loss).backward()
        out[compiled] = (loss.detach(), h.grad.clone(), w.grad.clone())
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_kernel_routing_trains_as_the_reference_routing():
    """`route_by_kernel`: the routing kernel's choice (Triton's interpreter on a CPU) and torch's weights on it
    give the reference routing's losses, gradients (the routers' included) and expert counts; off, the routers'
    own forward is back."""
    x = torch.randint(0, 64, (2, 41), generator=torch.Generator().manual_seed(3))
    out = {}
    for on in (False, True):
        m = model(4)
        route_by_kernel(m, on)
        bal = ExpertBalancer(m, rate=0.01)
        main, mtp = losses(m, x)
        (main + 0.3 * mtp).backward()
        out[on] = (main.detach(), mtp.detach(), grads(m), [c.clone() for c in bal.counts])
        route_by_kernel(m, False)
        assert all("forward" not in r.__dict__ for r in bal.routers)
    (main0, mtp0, g0, c0), (main1, mtp1, g1, c1) = out[False], out[True]
    torch.testing.assert_close(main1, main0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mtp1, mtp0, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(c0, c1)) and sum(c.sum() for c in c0) > 0
    assert g0.keys() == g1.keys() and any(".gate.weight" in n for n in g0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)


def test_fused_losses_equal_the_eager_heads():
    m = model()
    x = torch.randint(0, 64, (2, 41), generator=torch.Generator().manual_seed(1))
    got = losses(m, x, fused_ce=True)
    sum(got[0:1] + (0.3 * got[1],)).backward()
    got_g = grads(m)
    m.zero_grad(set_to_none=True)
    want = losses(m, x, fused_ce=False)
    sum(want[0:1] + (0.3 * want[1],)).backward()
    # the eager MTP head, as the model computes it for inference
    h = m.hidden(x[:, :-1])
    mtp = m.mtp_logits(h[:, :-1], x[:, 1:-1])
    torch.testing.assert_close(want[1], F.cross_entropy(mtp[:, :-1].flatten(0, 1), x[:, 2:-1].flatten()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    want_g = grads(m)
    assert got_g.keys() == want_g.keys()
    for n in want_g:
        torch.testing.assert_close(got_g[n], want_g[n], rtol=1e-4, atol=1e-6, msg=n)


def test_compiled_layers_train_as_the_eager_ones(monkeypatch):
    monkeypatch.setattr(ling, "delta_rule", ling.delta_rule)  # compile_for_training swaps it: restored after
    monkeypatch.setattr(linear_ce, "_chunk", linear_ce._chunk)  # and compiles the loss's chunks
    monkeypatch.setattr(ling.Experts, "forward",  # the experts' form on CUDA
                        lambda self, x, w, idx, plus=None: self._dense(x, w, idx) + (0 if plus is None else plus))
    torch._dynamo.reset()
    eager, compiled = model(), model()
    compile_for_training(compiled, backend="aot_eager")
    x = torch.randint(0, 64, (2, 41), generator=torch.Generator().manual_seed(2))
    out = {}
    for name, m in (("eager", eager), ("compiled", compiled)):
        bal = ExpertBalancer(m, rate=0.01)
        main, mtp = losses(m, x)
        (main + 0.3 * mtp).backward()
        out[name] = (main.detach(), mtp.detach(), grads(m), [c.clone() for c in bal.counts])
        bal.remove()
    (em, et, eg, ec), (cm, ct, cg, cc) = out["eager"], out["compiled"]
    torch.testing.assert_close(cm, em, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ct, et, rtol=1e-5, atol=1e-6)
    for n in eg:
        torch.testing.assert_close(cg[n], eg[n], rtol=1e-4, atol=1e-5, msg=n)
    assert all(torch.equal(a, b) for a, b in zip(cc, ec)) and sum(c.sum() for c in ec) > 0
    torch._dynamo.reset()
