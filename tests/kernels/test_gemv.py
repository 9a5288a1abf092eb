"""The skinny GEMV against its reference (Triton's interpreter on CPU, the real kernel on GPU).

Fresh random inputs per check; the output and the split-K partials are poisoned with NaN first. With an fp32
output only the summation order differs from the fp32 reference of the same bf16 values (1e-5); a bf16
output adds its own rounding (1e-2, the bf16 band of the method).
"""

import pytest
import torch

pytest.importorskip("triton")  # GPU-only dependency: these tests run its interpreter on CPU

from lingls.kernels import gemv as G
from tests.kernels.conftest import rel  # noqa: E402
from tests.kernels.test_kda import compile_for_sm90  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"




# (T, N, K, swiglu, residual, split_k): ragged N and K, forced and planned splits
CASES = [(1, 96, 256, False, False, None), (9, 40, 320, True, False, 3), (16, 100, 512, False, True, 2),
         (3, 48, 1000, True, True, None), (16, 33, 96, False, False, 1), (1, 24, 768, True, False, 4)]


@pytest.mark.parametrize("t,n,k,swiglu,residual,split_k", CASES)
def test_gemv_matches_reference(poisoned, t, n, k, swiglu, residual, split_k):
    gen = torch.Generator().manual_seed(t * 1000 + n)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEV, torch.bfloat16)  # noqa: E731
    x, w = r(t, k), r(2 * n if swiglu else n, k, scale=k ** -0.5)
    res = r(t, n) if residual else None
    limit = 0.7 if swiglu else 0.0
    want = G.gemv_reference(x, w, res, swiglu, limit)
    out = torch.full((t, n), float("nan"), dtype=torch.float32, device=DEV)
    G.gemv(x, w, res, swiglu, limit, out=out, split_k=split_k, block_n=16 if n < 64 else None, block_k=64)
    exact = x.float() @ w.float().t()
    if swiglu:
        exact = torch.nn.functional.silu(exact[:, :n]).clamp(max=limit) * exact[:, n:].clamp(-limit, limit)
    if residual:
        exact = exact + res.float()
    assert rel(out, exact) < 1e-5
    y = G.gemv(x, w, res, swiglu, limit, split_k=split_k)
    assert y.dtype == torch.bfloat16 and rel(y, want) < 1e-2


@pytest.mark.parametrize("n,k,swiglu,residual,split_k", [(96, 256, False, True, None), (40, 320, True, False, 3),
                                                         (33, 1000, True, True, 2)])
def test_one_token_fma_path_matches_reference(poisoned, n, k, swiglu, residual, split_k):
    """The T=1 path on the FMA units computes the same product (ragged N and K, split-K, both epilogues)."""
    gen = torch.Generator().manual_seed(n + k)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEV, torch.bfloat16)  # noqa: E731
    x, w = r(1, k), r(2 * n if swiglu else n, k, scale=k ** -0.5)
    res = r(1, n) if residual else None
    out = torch.full((1, n), float("nan"), dtype=torch.float32, device=DEV)
    G.gemv(x, w, res, swiglu, 0.7 if swiglu else 0.0, out=out, split_k=split_k, block_n=16, block_k=64, fma=True)
    want = G.gemv_reference(x.float(), w.float(), None if res is None else res.float(), swiglu, 0.7 if swiglu else 0.0)
    assert rel(out, want) < 1e-5


DESCRIPTOR_CASES = [(9, 100, 512, False, True, 2), (2, 40, 320, True, False, 3), (16, 33, 1000, True, True, 1),
                    (9, 64, 128, False, False, 1)]


@pytest.mark.parametrize("t,n,k,swiglu,residual,split_k", DESCRIPTOR_CASES)
def test_verify_descriptor_path_matches_reference(poisoned, t, n, k, swiglu, residual, split_k):
    """T > 1 through the descriptor loads and the swapped (warpgroup) MMA: ragged N and K (the descriptors
    zero-fill what lies past them, x's rows past T too), split-K, both epilogues."""
    gen = torch.Generator().manual_seed(t + n + k)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEV, torch.bfloat16)  # noqa: E731
    x, w = r(t, k), r(2 * n if swiglu else n, k, scale=k ** -0.5)
    res = r(t, n) if residual else None
    limit = 0.7 if swiglu else 0.0
    out = torch.full((t, n), float("nan"), dtype=torch.float32, device=DEV)
    G.gemv(x, w, res, swiglu, limit, out=out, split_k=split_k, block_n=32, block_k=64, tma=True)
    want = G.gemv_reference(x.float(), w.float(), None if res is None else res.float(), swiglu, limit)
    assert rel(out, want) < 1e-5


def test_gemv_twice_same_bits(poisoned):
    """Split-K sums its partials in a fixed order and the counters reset: two calls give identical bits."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 512, generator=gen).to(DEV, torch.bfloat16)
    w = torch.randn(64, 512, generator=gen).to(DEV, torch.bfloat16)
    a = G.gemv(x, w, split_k=4, block_n=16, block_k=64)
    b = G.gemv(x, w, split_k=4, block_n=16, block_k=64)
    assert torch.equal(a, b)
    assert (G.counters(x.device, 1)[:4] == 0).all()


def test_linear_dispatch_on_cpu_is_the_reference():
    x = torch.randn(20, 64).bfloat16()
    w = torch.randn(32, 64).bfloat16()
    assert torch.equal(G.linear(x, w), G.gemv_reference(x, w))


@pytest.mark.parametrize("t", [1, 9])
def test_tuned_launch_settings_compute_the_same_product(t, monkeypatch):
    """A shape pinned in CONFIGS (bench/tune_gpu.py's winners) launches with those settings, same result."""
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, 384, generator=gen).to(DEV, torch.bfloat16)
    w = (torch.randn(80, 384, generator=gen) * 0.05).to(DEV, torch.bfloat16)
    monkeypatch.setitem(G.CONFIGS, (80, 384, False, 1 if t == 1 else 16),
                        dict(block_n=16, block_k=128, num_warps=4, num_stages=2))
    assert rel(G.gemv(x, w), G.gemv_reference(x, w)) < 1e-2


def test_one_row_through_an_untuned_shape_takes_the_fma_form(monkeypatch):
    """A head over a vocabulary shard (its rows set by the draft vocabulary, so never in CONFIGS) at one token
    launches as ONE_ROW says, the FMA form with 8 rows per program, and a ragged row count is masked."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 384, generator=gen).to(DEV, torch.bfloat16)
    w = (torch.randn(1003, 384, generator=gen) * 0.05).to(DEV, torch.bfloat16)
    seen, real = {}, G._gemv_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.update(kwargs, grid=grid)
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(G, "_gemv_kernel", Spy())
    assert rel(G.gemv(x, w), G.gemv_reference(x, w)) < 1e-2
    assert seen["FMA"] and seen["BLOCK_N"] == 8 and seen["grid"] == (126, 1)


def test_kernel_compiles_for_h200():
    """Both paths (MMA, FMA), split-K, the SwiGLU epilogue and PDL through the GPU compiler and ptxas for sm_90
    (no GPU needed)."""
    lines = compile_for_sm90("""
        from lingls.kernels import gemv
        types = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_ptr="*bf16", part_ptr="*fp32",
                     cnt_ptr="*i32", limit="fp32")
        for fma, split, swiglu in ((True, 1, False), (False, 2, True), (True, 4, True)):
            build(gemv._gemv_kernel, types, dict(BLOCK_N=32, BLOCK_K=128, K_ITERS=10, SPLIT_K=split, SWIGLU=swiglu,
                  HAS_RES=False, FMA=fma, USE_PDL=True, F32_DOT=False), 4, True,
                  divisible=("K", "K_PER", "stride_x", "stride_w"))
        descriptors = dict(types, x_desc="tensordesc<bf16[16, 128]>", w_desc="tensordesc<bf16[64, 128]>")
        for split, swiglu in ((1, False), (4, True)):
            build(gemv._gemv_tma_kernel, descriptors, dict(BLOCK_N=64, BLOCK_K=128, K_ITERS=5, SPLIT_K=split,
                  SWIGLU=swiglu, HAS_RES=True, USE_PDL=True, F32_DOT=False), 4, True)
    """)
    assert len(lines) == 5, lines
    for line in lines[3:]:  # the descriptor path: operands in shared memory, the accumulator alone in registers
        assert "STACK:0 " in line and "LOCAL:0 " in line, line
