"""The three-launch fused MoE against its reference (Triton's interpreter on CPU, the real kernel on GPU).

Routing is compared as sets per token, robust to order and to near-ties: where the kernel's fp32 router sum
(a different summation order) picks another expert than the reference, the two choices must score the same
to 1e-5. The experts' arithmetic is then checked on the kernel's own routing, so such a tie cannot hide it:
bf16 activations and output against the fp32 definition, 1e-2. Every buffer the module allocates starts as
NaN (floats) or -1 (ints), so a read of anything unwritten shows.
"""

import pytest
import torch

pytest.importorskip("triton")  # GPU-only dependency: these tests run its interpreter on CPU

from lingls.kernels import moe as M
from tests.kernels.conftest import rel  # noqa: E402
from tests.kernels.test_kda import compile_for_sm90  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(gen, h, e, i, i_s, tied_router=False):
    def r(*s, scale=1.0, dt=torch.bfloat16):
        return (torch.randn(*s, generator=gen) * scale).to(DEV, dt)

    router = r(e, h, scale=h ** -0.5)
    bias = r(e, scale=0.05, dt=torch.float32)
    if tied_router:  # every score 0.5 and only four bias values: exact ties everywhere
        router = torch.zeros_like(router)
        bias = (bias * 20).round().clamp(-2, 1) / 10
    shared = ((r(i_s, h, scale=h ** -0.5), r(i_s, h, scale=h ** -0.5), r(h, i_s, scale=i_s ** -0.5)) if i_s
              else (None,) * 3)
    return M.prepare_moe_weights(router, bias, r(e, 2 * i, h, scale=h ** -0.5), r(e, h, i, scale=i ** -0.5), *shared)


def check_routing(x, w, cfg, tw, ti):
    logits = x.double() @ w.router_w.double().t()
    rw, ri = M.ref.route_grouped_topk(logits, w.expert_bias.double(), cfg["top_k"], cfg["n_group"],
                                      cfg["topk_group"], cfg["normalize"], cfg["scale"])
    choice = logits.sigmoid() + w.expert_bias.double()
    for t in range(x.shape[0]):
        got, want = ti[t].long().cpu(), ri[t].cpu()
        if set(got.tolist()) == set(want.tolist()):
            order = got.argsort(), want.argsort()
            torch.testing.assert_close(tw[t].double().cpu()[order[0]], rw[t].cpu()[order[1]], rtol=1e-5, atol=1e-6)
        else:  # a near-tie decided the other way
            torch.testing.assert_close(choice[t, got].sort().values, choice[t, want].sort().values, rtol=0, atol=1e-5)


# (H, E, I, I_s, top_k, n_group, topk_group, normalize, limit, shared_limit)
CONFIGS = [(128, 32, 32, 48, 4, 4, 2, True, 1.0, 0.0),   # shared expert wider than a routed one, clamp on routed
           (64, 64, 16, 16, 8, 8, 4, True, 0.0, 0.5),    # flash's routing structure at small widths
           (96, 24, 24, 0, 3, 3, 2, False, 0.0, 0.0),    # no shared expert, ragged sizes, no renormalisation
           (128, 512, 16, 16, 8, 8, 4, True, 0.0, 0.0)]  # flash's router: 8 of 512 in 4 of 8 groups


@pytest.mark.parametrize("t", [1, 2, 9, 16])
@pytest.mark.parametrize("conf", CONFIGS, ids=["wide-shared", "flash-like", "no-shared", "flash-router"])
def test_fused_moe_matches_reference(poisoned, t, conf):
    h, e, i, i_s, k, g, tg, norm, lim, slim = conf
    gen = torch.Generator().manual_seed(1000 * t + e)
    w = make(gen, h, e, i, i_s)
    x = (torch.randn(t, h, generator=gen)).to(DEV, torch.bfloat16)
    cfg = dict(top_k=k, n_group=g, topk_group=tg, normalize=norm, scale=2.5, limit=lim, shared_limit=slim)
    out, tw, ti = M.fused_moe(x, *w, return_routing=True, **cfg)
    check_routing(x, w, cfg, tw, ti)
    want = M.fused_moe_reference(x, *w, routing=(tw, ti), **cfg)
    assert out.shape == (t, h) and out.dtype == torch.bfloat16
    assert rel(out, want) < 1e-2


@pytest.mark.parametrize("t,knobs", [(9, dict(split_d=1, block_h=32)),
                                     (9, dict(split_d=3, router_split=2, router_block_e=8)),
                                     (9, dict(split_d=64, block_i=32, router_warps=4)),
                                     (9, dict(route_warps=2, split_d=2)),
                                     (1, dict(route_warps=1, router_warps=8)),
                                     (9, dict(gu_split=2, gu_block_k=32, block_i=16)),
                                     (1, dict(dn_fma=True, gu_split=1, split_d=1)),
                                     (9, dict(dn_block_i=16, split_d=3)), (1, dict(dn_block_i=16, dn_fma=True)),
                                     (1, dict(gu_split=3, gu_block_k=32, dn_fma=True, split_d=4)),
                                     (1, dict(router_block_k=32, router_split=2, router_block_e=4, gu_fma=True,
                                              block_i=16, gu_block_k=32, gu_split=2)),
                                     (1, dict(gu_fma=True, gu_split=1, gu_block_k=64)),
                                     (9, dict(router_block_k=32, router_split=3, router_warps=1)),
                                     (1, dict(block_h=8, split_d=1, dn_fma=True, dn_warps=2)),
                                     (1, dict(block_h=4, split_d=2, dn_fma=True, dn_warps=1, block_i=4, gu_split=1,
                                              gu_fma=True, gu_block_k=64, gu_warps=1)),
                                     (1, dict(dn_ahead=True, dn_fma=True, split_d=1, block_h=8, dn_warps=2)),
                                     (1, dict(dn_ahead=True, dn_fma=True, split_d=3, block_h=16, dn_block_i=16))])
def test_launch_knobs_compute_the_same_function(poisoned, t, knobs):
    """Every tuning candidate (bench/tune_gpu.py) is the same MoE, whatever the split of the slots."""
    h, e, i, i_s, k, g, tg, norm, lim, slim = CONFIGS[0]
    gen = torch.Generator().manual_seed(77)
    w = make(gen, h, e, i, i_s)
    x = torch.randn(t, h, generator=gen).to(DEV, torch.bfloat16)
    res = torch.randn(t, h, generator=gen).to(DEV, torch.bfloat16)
    cfg = dict(top_k=k, n_group=g, topk_group=tg, normalize=norm, scale=2.5, limit=lim, shared_limit=slim)
    out, tw, ti = M.fused_moe(x, *w, residual=res, return_routing=True, **cfg, **knobs)
    assert rel(out, M.fused_moe_reference(x, *w, routing=(tw, ti), residual=res, **cfg)) < 1e-2


def test_ties_and_residual(poisoned):
    """A router with exact ties (lowest id wins in the kernel; any order in torch), plus the residual epilogue."""
    gen = torch.Generator().manual_seed(5)
    w = make(gen, 64, 64, 16, 16, tied_router=True)
    x = torch.randn(9, 64, generator=gen).to(DEV, torch.bfloat16)
    res = torch.randn(9, 64, generator=gen).to(DEV, torch.bfloat16)
    cfg = dict(top_k=8, n_group=8, topk_group=4, normalize=True, scale=2.5)
    out, tw, ti = M.fused_moe(x, *w, residual=res, return_routing=True, **cfg)
    check_routing(x, w, cfg, tw, ti)
    assert rel(out, M.fused_moe_reference(x, *w, routing=(tw, ti), residual=res, **cfg)) < 1e-2


def test_dispatch_on_cpu_is_the_reference():
    w = make(torch.Generator().manual_seed(2), 32, 16, 8, 8)
    w = M.MoEWeights(*(a.cpu() if a is not None else None for a in w))
    x = torch.randn(20, 32).bfloat16()
    cfg = dict(top_k=2, n_group=2, topk_group=1, normalize=True, scale=1.0)
    assert torch.equal(M.moe(x, w, **cfg), M.fused_moe_reference(x, *w, **cfg))


def test_kernels_compile_for_h200():
    """The router (FMA path at T=1, MMA at T=9), the routing (one token alone, or several), gate-up (MMA and
    FMA) and down kernels at flash's shapes, with PDL, through the GPU compiler and ptxas for sm_90 (no GPU
    needed)."""
    lines = compile_for_sm90("""
        from lingls.kernels import moe
        routing = dict(TOP_K=8, K_PAD=8, G=8, G_PAD=8, EPG=64, EPG_PAD=64, E_PAD=512, TOPK_GROUP=4, NORMALIZE=True,
                       HAS_SHARED=True, WRITE_TOPK=False, USE_PDL=True)
        tables = dict(bias_ptr="*fp32", part_ptr="*fp32", topk_w_ptr="*fp32", topk_i_ptr="*i32", experts_ptr="*i32",
                      wt_ptr="*fp32", scale="fp32")
        for fma in (True, False):
            build(moe._router_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", part_ptr="*fp32"),
                  dict(BLOCK_E=8, BLOCK_K=512, K_ITERS=1, FMA=fma, USE_PDL=True, F32_DOT=False), 4, True,
                  divisible=("E", "H", "K_PER"))
        for write_topk in (False, True):
            build(moe._route_token_kernel, tables, dict(routing, SPLIT=5, WRITE_TOPK=write_topk), 4, True)
        for fma in (False, True):  # several tokens (slots deduplicated), one
            build(moe._gate_up_kernel, dict(x_ptr="*bf16", gu_ptr="*bf16", sgu_ptr="*bf16", experts_ptr="*i32",
                  owned_ptr="*i32", wt_ptr="*fp32", act_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32", limit="fp32",
                  shared_limit="fp32"),
                  dict(BLOCK_I=32, BLOCK_K=128, K_ITERS=5, I_PAD=256, SPLIT_K=4, FMA=fma, USE_PDL=True, F32_DOT=False,
                       EARLY_SHARED=True, DEDUP=not fma, TOP_K=8, D_PAD=128),
                  4, True, divisible=("H", "E", "INTER", "I_S", "K_PER"))
        down = dict(act_ptr="*bf16", dn_ptr="*bf16", sdn_ptr="*bf16", experts_ptr="*i32", owned_ptr="*i32",
                    wt_ptr="*fp32", out_ptr="*bf16", res_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32")
        for d_per, fma in ((1, True), (10, False)):
            build(moe._down_kernel, down,
                  dict(D_PER=d_per, D_PER_PAD=triton.next_power_of_2(d_per), SPLIT_D=8, BLOCK_H=64,
                       BLOCK_I=256 if fma else 64, I_CHUNKS=1 if fma else 3, I_PAD=256, HAS_RES=False, FMA=fma,
                       AHEAD=False, DEDUP=not fma, USE_PDL=True, F32_DOT=False),
                  8 if fma else 4, True, divisible=("H", "E", "INTER", "I_S"))
        build(moe._down_kernel, down,  # one token, all 9 slots' tiles before the wait (the TP=4 settings)
              dict(D_PER=9, D_PER_PAD=16, SPLIT_D=1, BLOCK_H=16, BLOCK_I=64, I_CHUNKS=3, I_PAD=256, HAS_RES=False,
                   FMA=True, AHEAD=True, DEDUP=False, USE_PDL=2, F32_DOT=False), 4, True,
              divisible=("H", "E", "INTER", "I_S"))
    """)
    assert len(lines) == 9, lines
    for line in lines[4:]:  # the expert kernels, specialized as at flash's shapes, keep everything in registers
        assert "STACK:0 " in line and "LOCAL:0 " in line, line
    # the verify step's down loop keeps two (slot, chunk) tiles in flight: weights [64, 64] and activations
    # [16, 64], bf16 (one buffer each when a slot id was read inside the loop)
    assert int(lines[7].rsplit("SMEM:", 1)[1]) >= 2 * (64 * 64 + 16 * 64) * 2, lines[7]


def test_unused_slots_are_marked(monkeypatch):
    """Nine tokens choosing the same 8 experts: the 64 slots of tokens 1-8 hold duplicates, which the gate-up
    kernel must mark -1 for the down kernel. Here the scratch starts at 0 (an expert every token chooses,
    through its bias) instead of the usual -1 poison, so a slot left unmarked would count expert 0 again."""
    real = torch.empty

    def empty(*shape, dtype=None, device=None):
        out = real(*shape, dtype=dtype, device=device)
        return out.fill_(float("nan")) if out.is_floating_point() else out.zero_()

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", lambda x: empty(*x.shape, dtype=x.dtype, device=x.device))
    gen = torch.Generator().manual_seed(9)
    w = make(gen, 64, 64, 16, 16)
    w.expert_bias[0] = 10.0
    x = torch.randn(1, 64, generator=gen).to(DEV, torch.bfloat16).expand(9, 64).contiguous()  # 8 experts, 73 slots
    cfg = dict(top_k=8, n_group=8, topk_group=4, normalize=True, scale=2.5)
    out, tw, ti = M.fused_moe(x, *w, return_routing=True, **cfg)
    assert (ti == 0).any(dim=1).all()
    assert rel(out, M.fused_moe_reference(x, *w, routing=(tw, ti), **cfg)) < 1e-2
