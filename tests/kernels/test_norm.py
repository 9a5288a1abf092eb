"""Fused residual add + RMSNorm against the model's torch form (interpreter on CPU, the kernel on GPU)."""

import pytest
import torch

pytest.importorskip("triton")  # GPU-only dependency: these tests run its interpreter on CPU

from lingls.kernels import norm
from tests.kernels.conftest import rel  # noqa: E402

from .test_kda import compile_for_sm90

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def assert_sum_rounded_like_torch(a, b):
    """On GPU the add rounds to nearest like torch's, so bits match. Triton's interpreter truncates fp32 -> bf16
    instead, so off GPU a bf16 sum may be one step lower in magnitude."""
    if DEV == "cuda" or a.dtype == torch.float32:
        assert torch.equal(a, b)
    else:
        step = torch.finfo(torch.bfloat16).eps * b.float().abs()
        assert ((a.float() - b.float()).abs() <= step).all()



@pytest.mark.parametrize("t,n,dtype,with_residual", [
    (1, 64, torch.float32, True),
    (9, 160, torch.bfloat16, True),
    (16, 2560, torch.bfloat16, True),
    (3, 96, torch.bfloat16, False),
])
def test_add_rms_norm_matches_reference(t, n, dtype, with_residual):
    gen = torch.Generator().manual_seed(t * n)
    x = torch.randn(t, n, generator=gen).to(DEV, dtype)
    residual = (torch.randn(t, n, generator=gen) * 3).to(DEV, dtype) if with_residual else None
    weight = (torch.randn(n, generator=gen) * 0.3 + 1).to(DEV, dtype)
    out = torch.full((t, n), float("nan"), device=DEV, dtype=dtype)
    res_k = residual.clone() if with_residual else None
    normed, new_res = norm.fused_add_rms_norm(x, res_k, weight, 1e-6, out=out)
    res_r = residual.clone() if with_residual else None
    ref_normed, ref_res = norm.add_rms_norm_reference(x, res_r, weight, 1e-6)
    assert normed is out and normed.dtype == dtype
    assert_sum_rounded_like_torch(new_res, ref_res)
    if with_residual:
        assert new_res is res_k  # updated in place
    assert rel(normed, ref_normed) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_strided_rows_and_default_output():
    gen = torch.Generator().manual_seed(5)
    buf = torch.randn(4, 200, generator=gen).to(DEV)
    x = buf[:, :100]  # a view with row stride 200
    residual = torch.randn(4, 100, generator=gen).to(DEV)
    weight = torch.randn(100, generator=gen).to(DEV)
    normed, new_res = norm.fused_add_rms_norm(x, residual.clone(), weight, 1e-5)
    ref_normed, ref_res = norm.add_rms_norm_reference(x, residual.clone(), weight, 1e-5)
    assert rel(normed, ref_normed) < 1e-5 and torch.equal(new_res, ref_res)


@pytest.mark.parametrize("t,n,dtype", [(1, 64, torch.float32), (9, 160, torch.bfloat16), (2, 2560, torch.bfloat16)])
def test_mtp_input_is_the_three_norm_launches(t, n, dtype, poisoned):
    """One launch gives the bits of the embedding lookup and three norm launches (enorm; norm, then hnorm)."""
    gen = torch.Generator().manual_seed(t + n)
    table = torch.randn(50, n, generator=gen).to(DEV, dtype)
    ids = torch.randint(0, 50, (t,), generator=gen).to(DEV)
    h = (torch.randn(t, 2 * n, generator=gen) * 4).to(DEV, dtype)[:, :n]  # rows strided like a slice of a wider row
    enorm, final, hnorm = ((torch.randn(n, generator=gen) * 0.3 + 1).to(DEV, dtype) for _ in range(3))
    got = norm.fused_mtp_input(ids, table, h, enorm, final, hnorm, 1e-6)
    want = torch.empty(t, 2 * n, device=DEV, dtype=dtype)
    norm.fused_add_rms_norm(table[ids], None, enorm, 1e-6, out=want[:, :n])
    norm.fused_add_rms_norm(norm.fused_add_rms_norm(h, None, final, 1e-6)[0], None, hnorm, 1e-6, out=want[:, n:])
    assert torch.equal(got, want)
    assert rel(got, norm.mtp_input_reference(ids, table, h, enorm, final, hnorm, 1e-6)) < (
        1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("t,n,dtype", [(1, 64, torch.float32), (9, 2560, torch.bfloat16)])
def test_embed_rms_norm_is_the_lookup_and_the_norm_launch(t, n, dtype, poisoned):
    gen = torch.Generator().manual_seed(t * n)
    table = (torch.randn(40, n, generator=gen) * 2).to(DEV, dtype)
    ids = torch.randint(0, 40, (t,), generator=gen).to(DEV)
    weight = (torch.randn(n, generator=gen) * 0.3 + 1).to(DEV, dtype)
    normed, residual = norm.fused_embed_rms_norm(ids, table, weight, 1e-6)
    want_normed, want_residual = norm.fused_add_rms_norm(table[ids], None, weight, 1e-6)
    assert torch.equal(residual, want_residual) and torch.equal(normed, want_normed)
    ref_normed, ref_residual = norm.embed_rms_norm_reference(ids, table, weight, 1e-6)
    assert torch.equal(residual, ref_residual)
    assert rel(normed, ref_normed) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_mtp_input_refuses_mixed_dtypes():
    w = torch.ones(8)
    with pytest.raises(ValueError, match="one dtype"):
        norm.fused_mtp_input(torch.zeros(1, dtype=torch.long), torch.zeros(4, 8),
                             torch.zeros(1, 8, dtype=torch.bfloat16), w, w, w, 1e-6)


def test_dispatch_off_gpu_is_the_reference():
    x, r, w = torch.randn(2, 32), torch.randn(2, 32), torch.randn(32)
    normed, new_res = norm.add_rms_norm(x, r.clone(), w, 1e-6)
    ref_normed, ref_res = norm.add_rms_norm_reference(x, r.clone(), w, 1e-6)
    assert torch.equal(normed, ref_normed) and torch.equal(new_res, ref_res)


def test_kernel_compiles_for_h200_without_spills():
    lines = compile_for_sm90("""
        from lingls.kernels import norm
        for residual in (True, False):
            build(norm._add_rms_norm_kernel, dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16",
                  eps="fp32"), dict(BLOCK=4096, HAS_RESIDUAL=residual, USE_PDL=True), 8, True)
        build(norm._embed_rms_norm_kernel, dict(ids_ptr="*i64", table_ptr="*bf16", w_ptr="*bf16", res_ptr="*bf16",
              out_ptr="*bf16", eps="fp32"), dict(BLOCK=4096, USE_PDL=True), 8, True)
        build(norm._mtp_input_kernel, dict(ids_ptr="*i64", table_ptr="*bf16", h_ptr="*bf16", we_ptr="*bf16",
              wf_ptr="*bf16", wh_ptr="*bf16", out_ptr="*bf16", eps="fp32"), dict(BLOCK=4096, USE_PDL=True), 8, True)
    """)
    assert len(lines) == 4 and all("STACK:0 " in line for line in lines), lines
