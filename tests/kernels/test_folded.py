"""The chain's hops folded into its kernels (bench/persistent_layer_gpu.py's "chain6"): a one-token GEMV with the
RMSNorm before it recomputed by every program, against the norm kernel then the GEMV's reference."""

import pytest
import torch

pytest.importorskip("triton")  # GPU-only dependency: these tests run its interpreter on CPU

from lingls.kernels import gemv as G  # noqa: E402
from lingls.kernels import norm as Nm  # noqa: E402
from tests.kernels.conftest import rel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k,swiglu,add,split_k", [(24, 320, False, True, None), (16, 200, True, False, 2),
                                                    (40, 256, False, False, 1)])
def test_folded_norm_gemv_matches_norm_then_gemv(poisoned, n, k, swiglu, add, split_k):
    """nw * RMSNorm(x (+ add)) @ W^T in one launch == the norm's reference then the GEMV's; the first program's
    copies of h (the new residual) and of the normed row equal the norm's."""
    gen = torch.Generator().manual_seed(n + k)
    r = lambda *s, scale=1.0, mean=0.0: (mean + torch.randn(*s, generator=gen) * scale).to(DEV, torch.bfloat16)  # noqa: E731
    x, w, nw = r(1, k, scale=3.0), r(2 * n if swiglu else n, k, scale=k ** -0.5), r(k, scale=0.1, mean=1.0)
    a = r(1, k) if add else None
    h_out, x_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    # the norm kernel itself (under the interpreter its fp32 -> bf16 casts differ from torch's in the last bit)
    want_x, want_h = Nm.fused_add_rms_norm(x, None if a is None else a.clone(), nw, 1e-6)
    want = G.gemv_reference(want_x, w, None, swiglu, 0.7 if swiglu else 0.0)
    out = torch.full((1, n), float("nan"), dtype=torch.float32, device=DEV)
    G.gemv(x, w, None, swiglu, 0.7 if swiglu else 0.0, out=out, split_k=split_k, block_n=8, block_k=64, fma=True,
           norm=G.NormIn(nw, 1e-6, add=a, h_out=h_out if add else None, x_out=x_out))
    exact = G.gemv_reference(want_x.float(), w.float(), None, swiglu, 0.7 if swiglu else 0.0)
    assert rel(out, exact) < 1e-5
    assert torch.equal(x_out, want_x)
    if add:
        assert torch.equal(h_out, want_h)
    y = G.gemv(x, w, None, swiglu, 0.7 if swiglu else 0.0, block_n=8, block_k=64, fma=True, norm=G.NormIn(nw, 1e-6, a))
    assert rel(y, want) < 1e-2


def test_folded_norm_refuses_what_it_cannot_do():
    x = torch.randn(2, 64).to(torch.bfloat16)
    w = torch.randn(8, 64).to(torch.bfloat16)
    with pytest.raises(ValueError):
        G.NormIn(torch.ones(64, dtype=torch.bfloat16), 1e-6).check(x, True)
    with pytest.raises(ValueError):
        G.NormIn(torch.ones(64, dtype=torch.bfloat16), 1e-6, x_out=x[:1]).check(x[:1], True)
    with pytest.raises(ValueError):
        G.NormIn(torch.ones(64), 1e-6).check(x[:1], True)
    del w


@pytest.mark.parametrize("conf", [(128, 512, 16, 16, 8, 8, 4, True), (64, 64, 16, 24, 4, 8, 4, False)],
                         ids=["flash-router", "wide-shared"])
def test_moe_with_folded_norm_and_routing_in_the_expert_kernels(poisoned, conf):
    """fused_moe(norm=..., route_in=True) (three launches: the router with the post-attention norm folded in,
    then gate-up and down each routing for themselves) == the norm kernel then the four-launch MoE, bit for bit,
    whose routing is the reference router's (checked here too); the residual and normed row it writes equal
    the norm kernel's."""
    from lingls.kernels import moe as M
    from tests.kernels.test_moe import check_routing, make
    h, e, i, i_s, k, g, tg, normalize = conf
    gen = torch.Generator().manual_seed(h + e)
    w = make(gen, h, e, i, i_s)
    a = torch.randn(1, h, generator=gen).to(DEV, torch.bfloat16)
    res = (torch.randn(1, h, generator=gen) * 4).to(DEV, torch.bfloat16)
    nw = (1.0 + 0.1 * torch.randn(h, generator=gen)).to(DEV, torch.bfloat16)
    cfg = dict(top_k=k, n_group=g, topk_group=tg, normalize=normalize, scale=2.5, limit=0.0, shared_limit=0.0)
    x2, h1 = Nm.fused_add_rms_norm(a, res.clone(), nw, 1e-6)
    want, tw, ti = M.fused_moe(x2, *w, return_routing=True, **cfg)
    check_routing(x2, w, cfg, tw, ti)
    assert rel(want, M.fused_moe_reference(x2, *w, routing=(tw, ti), **cfg)) < 1e-2
    h_out, x_out = torch.full_like(a, float("nan")), torch.full_like(a, float("nan"))
    got = M.fused_moe(a, *w, norm=G.NormIn(nw, 1e-6, add=res, h_out=h_out, x_out=x_out), route_in=True, **cfg)
    assert torch.equal(h_out, h1) and torch.equal(x_out, x2)
    assert torch.equal(got, want)
    assert torch.equal(M.fused_moe(x2, *w, route_in=True, **cfg), want)
    with pytest.raises(ValueError):
        M.fused_moe(x2, *w, route_in=True, return_routing=True, **cfg)


def test_folded_kernels_compile_for_h200():
    """The folded variants at flash's TP=4 rank shapes (the KDA projection's GEMV with the input norm and the
    residual add, the router with the post-attention norm, gate-up and down routing for themselves) through
    the GPU compiler and ptxas for sm_90. Not spill-free: the projection GEMV spills 56 bytes a thread (its
    10 weight tiles in registers beside the row's norm inputs), gate-up 32 (the routing's [512] vectors on two
    warps); `pytest -k compile -s` prints the usage lines."""
    from tests.kernels.test_kda import compile_for_sm90
    lines = compile_for_sm90("""
        from lingls.kernels import gemv, moe
        norm = dict(add_ptr="*bf16", nw_ptr="*bf16", h_out_ptr="*bf16", x_out_ptr="*bf16", eps="fp32")
        build(gemv._gemv_kernel, dict(norm, x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_ptr="*bf16",
              part_ptr="*fp32", cnt_ptr="*i32", limit="fp32"),
              dict(BLOCK_N=8, BLOCK_K=256, K_ITERS=10, SPLIT_K=1, SWIGLU=False, HAS_RES=False, FMA=True, USE_PDL=2,
                   F32_DOT=False, NORM=2, K_PAD=4096, WRITE_H=True), 4, True, divisible=("N", "K", "K_PER"))
        build(moe._router_kernel, dict(norm, x_ptr="*bf16", w_ptr="*bf16", part_ptr="*fp32"),
              dict(BLOCK_E=8, BLOCK_K=128, K_ITERS=5, FMA=True, USE_PDL=2, F32_DOT=False, NORM=2, K_PAD=4096,
                   WRITE_H=True, WRITE_X=True), 4, True, divisible=("E", "H", "K_PER"))
        route = dict(ROUTE_IN=True, R_SPLIT=4, K_PAD=8, G=8, G_PAD=8, EPG=64, EPG_PAD=64, E_PAD=512, TOPK_GROUP=4,
                     NORMALIZE=True)
        tables = dict(rpart_ptr="*fp32", bias_ptr="*fp32", scale="fp32")
        build(moe._gate_up_kernel, dict(tables, x_ptr="*bf16", gu_ptr="*bf16", sgu_ptr="*bf16", experts_ptr="*i32",
              owned_ptr="*i32", wt_ptr="*fp32", act_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32", limit="fp32",
              shared_limit="fp32"),
              dict(route, BLOCK_I=4, BLOCK_K=256, K_ITERS=10, I_PAD=256, SPLIT_K=1, FMA=True, USE_PDL=1,
                   F32_DOT=False, EARLY_SHARED=True, DEDUP=False, TOP_K=8, D_PAD=16),
              2, True, divisible=("H", "E", "INTER", "I_S", "K_PER"))
        build(moe._down_kernel, dict(tables, act_ptr="*bf16", dn_ptr="*bf16", sdn_ptr="*bf16", experts_ptr="*i32",
              owned_ptr="*i32", wt_ptr="*fp32", out_ptr="*bf16", res_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32"),
              dict(route, D_PER=9, D_PER_PAD=16, SPLIT_D=1, BLOCK_H=16, BLOCK_I=64, I_CHUNKS=3, I_PAD=256,
                   HAS_RES=False, FMA=True, AHEAD=True, DEDUP=False, USE_PDL=2, F32_DOT=False, TOP_K=8), 4, True,
              divisible=("H", "E", "INTER", "I_S"))
    """)
    assert len(lines) == 4, lines
    for line in lines:
        assert "LOCAL:0 " in line, line
