"""Every way of running the model computes the same function: stateful == full, chunked == recurrent,
absorbed MLA == expanded MLA; and the two paths transformers lacks (q_lora_rank, MTP) match their math."""

import pytest
import torch
import torch.nn.functional as F

from lingls.kernels import reference as ref
from lingls.model.ling import LingForCausalLM

from .conftest import randomize, small_config


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def build(seed=0, **over):
    torch.manual_seed(seed)
    model = LingForCausalLM(small_config(**over))
    model.init_weights()
    randomize(model, seed)
    return model.eval()


@pytest.mark.parametrize("over", [{}, {"q_lora_rank": 12},
                                  {"num_hidden_layers": 6, "layer_group_size": 3,
                                   "expert_swiglu_limit_list": [0, 0, 0.5, 0.5, 0.5, 0.5],
                                   "share_expert_swiglu_limit_list": [0, 0, 0.3, 0.3, 0.3, 0.3]}])
def test_prefill_then_steps_equal_full_forward(over):
    model = build(1, **over)
    ids = torch.randint(0, 96, (160,), generator=torch.Generator().manual_seed(3))
    full = model.logits(ids)
    state = model.new_state(capacity=192)
    pieces, pos = [], 0
    for n in (70, 1, 1, 9, 1, 16, 62):  # a chunked prefill, single steps, multi-token (verify-sized) steps
        h = model.step(ids[pos:pos + n], state, torch.arange(pos, pos + n), kv_len=pos + n)
        pieces.append(model.head(h))
        pos += n
    assert (torch.cat(pieces) - full).abs().max().item() < 1e-4


def test_fixed_shape_step_reads_whole_cache_masked():
    model = build(2)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(4))
    full = model.logits(ids)
    state = model.new_state(capacity=64)
    state.latent.normal_()  # garbage beyond the sequence must be masked, never read
    out = [model.head(model.step(ids[i:i + 1], state, torch.tensor([i]))) for i in range(40)]
    assert (torch.cat(out) - full).abs().max().item() < 1e-4


def _kda_inputs(b, t, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = ref.l2_normalize(torch.randn(b, t, h, d, generator=g)) * d ** -0.5
    k = ref.l2_normalize(torch.randn(b, t, h, d, generator=g))
    v = torch.randn(b, t, h, d, generator=g)
    gate = -5.0 * torch.rand(b, t, h, d, generator=g)
    beta = torch.rand(b, t, h, generator=g)
    s0 = torch.randn(b, h, d, d, generator=g) * 0.1
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("t, chunk", [(1, 16), (31, 8), (100, 16), (129, 16), (50, 64), (16 * 13, 16)])
def test_chunked_kda_equals_recurrent(t, chunk, scan):
    q, k, v, g, beta, s0 = _kda_inputs(2, t, 3, 16, t)
    o_ref, s_ref = ref.kda_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(), s0.double())
    o, s = ref.kda_chunked(q, k, v, g, beta, s0, chunk=chunk, scan=scan)
    assert (o - o_ref).abs().max().item() < 1e-4
    assert (s - s_ref).abs().max().item() < 1e-4


def test_scan_and_loop_carry_the_same_gradients():
    """Training runs the scan form on GPUs: its backward must be the loop's."""
    grads = []
    for scan in (False, True):
        xs = [x.requires_grad_() for x in _kda_inputs(1, 70, 2, 8, 3)]
        with torch.enable_grad():
            o, s = ref.kda_chunked(*xs, chunk=8, scan=scan)
            (o.square().sum() + s.square().sum()).backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_recurrent_kda_is_the_delta_rule():
    q, k, v, g, beta, s0 = _kda_inputs(1, 5, 2, 4, 9)
    o, s_end = ref.kda_recurrent(q, k, v, g, beta, s0)
    s = s0[0].clone()
    for t in range(5):
        for hh in range(2):
            st = torch.diag(g[0, t, hh].exp()) @ s[hh]
            kt = k[0, t, hh]
            st = st + beta[0, t, hh] * torch.outer(kt, v[0, t, hh] - st.T @ kt)
            s[hh] = st
            assert torch.allclose(o[0, t, hh], st.T @ q[0, t, hh], atol=1e-5)
    assert torch.allclose(s_end[0], s, atol=1e-5)


def plain_mla(attn, x, positions):
    """Gated MLA written out head by head from the definitions in ling3-flash.md."""
    if hasattr(attn, "q_a_proj"):
        q = attn.q_b_proj(ref.rms_norm(attn.q_a_proj(x), attn.q_a_layernorm.weight, 1e-6))
    else:
        q = attn.q_proj(x)
    t = x.shape[0]
    q = q.view(t, attn.heads, attn.nope + attn.rope)
    kv_a = attn.kv_a_proj_with_mqa(x)
    c = ref.rms_norm(kv_a[:, : attn.rank], attn.kv_a_layernorm.weight, 1e-6)
    half = attn.rope // 2
    inv = 1.0 / (attn.theta ** (torch.arange(half, dtype=torch.float32) * 2 / attn.rope))
    ang = positions[:, None].float() * inv

    def rot(z):  # interleaved pairs rotated by the pair's angle, written [evens | odds]
        e, o = z[..., 0::2], z[..., 1::2]
        return torch.cat([e * ang.cos() - o * ang.sin(), o * ang.cos() + e * ang.sin()], -1)

    k_rope = rot(kv_a[:, attn.rank:])
    kv = attn.kv_b_proj(c).view(t, attn.heads, attn.nope + attn.vdim)
    gate = torch.sigmoid(attn.g_proj(x))
    outs = []
    for h in range(attn.heads):
        qh = torch.cat([q[:, h, : attn.nope], rot(q[:, h, attn.nope:])], -1)
        kh = torch.cat([kv[:, h, : attn.nope], k_rope], -1)
        scores = qh @ kh.T / (attn.nope + attn.rope) ** 0.5
        scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        outs.append((scores.softmax(-1) @ kv[:, h, attn.nope:]) * gate[:, h:h + 1])
    return attn.dense(torch.cat(outs, -1))


@pytest.mark.parametrize("q_lora", [None, 12])
def test_mla_forms_match_plain_math(q_lora):
    model = build(3, **({"q_lora_rank": q_lora} if q_lora else {}))
    attn = model.model.layers[1].attention
    x = torch.randn(23, 32, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(23)
    want = plain_mla(attn, x, pos)
    expanded = attn(x[None], pos)[0]
    cache = torch.zeros(32, attn.rank + attn.rope)
    cache[:23] = attn.latent(x, pos)
    absorbed = attn.attend_latent(x, pos, cache, kv_len=32)
    assert (expanded - want).abs().max().item() < 1e-5
    assert (absorbed - want).abs().max().item() < 1e-5


def test_mtp_layer_matches_its_definition():
    model = build(4, num_nextn_predict_layers=1)
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(1))
    h = model.hidden(ids)
    got = model.mtp_logits(h[:, :-1], ids[:, 1:])
    mtp = model.model.layers[model.n_layers]
    emb = model.model.word_embeddings(ids[0, 1:])
    x = mtp.eh_proj(torch.cat([ref.rms_norm(emb, mtp.enorm.weight, 1e-6),
                               ref.rms_norm(ref.rms_norm(h[0, :-1], model.model.norm.weight, 1e-6), mtp.hnorm.weight,
                                            1e-6)], -1))
    x = x + plain_mla(mtp.attention, ref.rms_norm(x, mtp.input_layernorm.weight, 1e-6), torch.arange(29))
    y = ref.rms_norm(x, mtp.post_attention_layernorm.weight, 1e-6)
    w, idx = ref.route_grouped_topk(F.linear(y, mtp.mlp.gate.weight), mtp.mlp.gate.expert_bias, 2, 2, 1, True, 2.5)
    routed = torch.zeros_like(y)
    for t in range(29):
        for j in range(2):
            e = idx[t, j]
            gate, up = mtp.mlp.experts.gate_up_proj[e].chunk(2, 0)
            routed[t] += w[t, j] * (mtp.mlp.experts.down_proj[e] @ (F.silu(gate @ y[t]) * (up @ y[t])))
    x = x + routed + mtp.mlp.shared_experts(y)
    want = model.lm_head(ref.rms_norm(x, mtp.final_layernorm.weight, 1e-6))
    assert (got[0] - want).abs().max().item() < 1e-4
    # the stateful MTP step computes the same
    state = model.new_state(capacity=32)
    hs = model.step(ids[0], state, torch.arange(30))
    xs = model.mtp_step(hs[:-1], ids[0, 1:], state, torch.arange(29))
    assert (model.mtp_head(xs) - want).abs().max().item() < 1e-4


def test_router_keeps_only_the_best_groups():
    logits = torch.full((1, 8), -4.0)
    logits[0, 1] = 3.0  # group 0: one strong expert
    logits[0, 4], logits[0, 5] = 1.0, 1.0  # group 1: two fair experts: higher top-2 sum
    w, idx = ref.route_grouped_topk(logits, torch.zeros(8), top_k=2, n_group=2, topk_group=1, normalize=True, scale=2.5)
    assert sorted(idx[0].tolist()) == [4, 5]
    assert torch.allclose(w.sum(), torch.tensor(2.5))
    # the bias steers the choice but not the weights
    bias = torch.zeros(8)
    bias[1] = 5.0
    w, idx = ref.route_grouped_topk(logits, bias, top_k=1, n_group=2, topk_group=1, normalize=False, scale=1.0)
    assert idx[0].tolist() == [1] and torch.allclose(w[0], torch.sigmoid(torch.tensor([3.0])))


def test_swiglu_clamp():
    gate, up = torch.tensor([10.0, -1.0]), torch.tensor([20.0, -20.0])
    assert torch.allclose(ref.swiglu(gate, up, 0.0), F.silu(gate) * up)
    assert torch.allclose(ref.swiglu(gate, up, 7.0), torch.minimum(F.silu(gate), torch.tensor(7.0)) * up.clamp(-7, 7))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_experts_equal_every_expert_densely(dtype, tol):
    """Many experts (the grouped GEMM path, as at Ling-3.0-flash's 512) compute what every expert on every
    token, weighted 0 where unchosen, computes; here 44 of the 64 experts are empty groups. On a GPU too
    (bf16: torch's grouped GEMM kernel; fp32: its per-group fallback)."""
    import copy

    from lingls.model.ling import Experts

    cfg = small_config(num_experts=64, num_experts_per_tok=4, n_group=4, topk_group=2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    experts = Experts(cfg, inter=32, limit=0.7).to(dev, dtype)  # widths the GPU kernel can take (16-byte rows)
    gen = torch.Generator().manual_seed(9)
    experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * 0.2)
    experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * 0.2)
    n = 40
    x = torch.randn(n, cfg.hidden_size, generator=gen).to(dev, dtype)
    idx = torch.stack([torch.randperm(20, generator=gen)[:4] for _ in range(n)]).to(dev)  # experts 20..63 idle
    weights = torch.rand(n, 4, generator=gen).to(dev)
    got = experts(x, weights, idx)
    want = copy.deepcopy(experts).float()._dense(x.float(), weights, idx)
    assert got.dtype == dtype
    assert (got.float() - want.float()).norm() / want.float().norm() < tol
