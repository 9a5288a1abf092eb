"""MLA decode kernel (split over the sequence, length read on device) against its reference."""

import pytest
import torch

pytest.importorskip("triton")  # GPU-only dependency: these tests run its interpreter on CPU

from lingls.kernels import mla as M
from lingls.kernels.mla import heads_per_program, mla_decode_reference, mla_decode_triton
from tests.kernels.conftest import rel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("t, h, n, last", [(1, 2, 64, 0), (1, 4, 100, 77), (9, 2, 96, 95), (16, 3, 64, 40),
                                           (1, 8, 80, 79), (2, 8, 64, 50), (3, 4, 64, 63), (1, 3, 48, 30)])
def test_split_kernel_matches_reference(t, h, n, last):
    g = torch.Generator().manual_seed(t * 100 + n)
    r, p = 32, 16  # tl.dot needs K >= 16 on a GPU
    q_lat, q_rope = torch.randn(t, h, r, generator=g), torch.randn(t, h, p, generator=g)
    cache = torch.randn(n, r + p, generator=g)
    positions = torch.arange(last - t + 1, last + 1).clamp_min(0)
    want = mla_decode_reference(q_lat, q_rope, cache, positions, scale=0.2)
    got = mla_decode_triton(q_lat.to(DEV), q_rope.to(DEV), cache.to(DEV), positions.to(DEV), scale=0.2, num_splits=4,
                            block_n=16).cpu()
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < (1e-2 if DEV == "cuda" else 1e-4)  # fp32 dots run as TF32 on a GPU


def test_rows_past_the_last_position_are_never_read():
    g = torch.Generator().manual_seed(0)
    q_lat, q_rope = torch.randn(2, 2, 32, generator=g).to(DEV), torch.randn(2, 2, 16, generator=g).to(DEV)
    cache = torch.randn(64, 48, generator=g).to(DEV)
    positions = torch.tensor([20, 21], device=DEV)
    want = mla_decode_triton(q_lat, q_rope, cache, positions, 0.3, num_splits=4, block_n=16)
    cache[22:] = float("nan")
    got = mla_decode_triton(q_lat, q_rope, cache, positions, 0.3, num_splits=4, block_n=16)
    assert torch.equal(got, want)


def test_heads_share_a_program_while_their_queries_fit_one_tile():
    assert [heads_per_program(t, 8) for t in (1, 2, 3, 4, 9, 16)] == [8, 8, 4, 4, 1, 1]
    assert heads_per_program(1, 3) == 1 and heads_per_program(1, 32) == 16


@pytest.mark.parametrize("t,h,heads", [(9, 4, 2), (9, 8, 4), (5, 4, 4)])
def test_more_heads_per_program_in_a_larger_tile(t, h, heads, monkeypatch):
    """The tuner's `heads` knob (verify steps: a T x heads tile past 16 rows), and the same from a CONFIGS entry's
    fourth field."""
    g = torch.Generator().manual_seed(t + h)
    q_lat, q_rope = torch.randn(t, h, 32, generator=g).to(DEV), torch.randn(t, h, 16, generator=g).to(DEV)
    cache = torch.randn(90, 48, generator=g).to(DEV)
    positions = torch.arange(80 - t, 80, device=DEV)
    want = mla_decode_reference(q_lat.cpu(), q_rope.cpu(), cache.cpu(), positions.cpu(), 0.3)
    got = mla_decode_triton(q_lat, q_rope, cache, positions, 0.3, num_splits=4, block_n=16, heads=heads).cpu()
    assert (got - want).abs().max().item() < (1e-2 if DEV == "cuda" else 1e-4)
    monkeypatch.setitem(M.CONFIGS, h, {16: (4, 16, 4, heads)})
    assert torch.equal(mla_decode_triton(q_lat, q_rope, cache, positions, 0.3).cpu(), got)


def test_default_configuration_matches_reference():
    g = torch.Generator().manual_seed(5)
    q_lat, q_rope = torch.randn(1, 8, 32, generator=g), torch.randn(1, 8, 16, generator=g)
    cache = torch.randn(300, 48, generator=g)
    positions = torch.tensor([250])
    want = mla_decode_reference(q_lat, q_rope, cache, positions, 0.25)
    got = mla_decode_triton(q_lat.to(DEV), q_rope.to(DEV), cache.to(DEV), positions.to(DEV), 0.25).cpu()
    assert (got - want).abs().max().item() < (1e-2 if DEV == "cuda" else 1e-4)


@pytest.mark.parametrize("t,h,interleave,dtype", [(1, 8, True, torch.bfloat16), (9, 3, False, torch.bfloat16),
                                                  (16, 4, True, torch.float32)])
def test_prologue_writes_the_cache_rows_and_rotates_the_queries(t, h, interleave, dtype):
    """`mla_prologue` (norm + rope + cache write in one launch) against its reference; rows it must not touch
    keep their NaN poison, rows it writes must be finite."""
    from lingls.kernels.mla import mla_prologue, mla_prologue_reference
    from lingls.kernels.reference import rope_inv_freq

    g = torch.Generator().manual_seed(t * 10 + h)
    nope, rope, rank = 16, 8, 24  # rank not a power of two: the masked tail
    proj = torch.randn(t, h * (nope + rope) + rank + rope + 5, generator=g).to(dtype)  # strided views, as split
    q, kv = proj[:, : h * (nope + rope)], proj[:, h * (nope + rope): h * (nope + rope) + rank + rope]
    w = (1 + 0.1 * torch.randn(rank, generator=g)).to(dtype)
    positions = torch.arange(30 - t, 30)
    freq = rope_inv_freq(rope, 10000.0, torch.device("cpu"))
    w_k = (torch.randn(h, nope + 4, rank, generator=g) * nope ** -0.5).to(dtype)[:, 2: 2 + nope]  # a strided view
    caches = [torch.full((40, rank + rope), float("nan"), dtype=dtype) for _ in range(2)]
    want = mla_prologue_reference(q, kv, w, 1e-6, freq, caches[0], positions, h, nope, interleave, w_k)
    on = [a.to(DEV) for a in (proj, w, freq, caches[1], positions)]
    got = mla_prologue(on[0][:, : h * (nope + rope)], on[0][:, h * (nope + rope): h * (nope + rope) + rank + rope],
                       on[1], 1e-6, on[2], on[3], on[4], h, nope, interleave, w_k.to(DEV))
    caches[1] = on[3].cpu()
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)  # bf16: 2 ulps
    assert got[0].shape == (t, h, rank) and got[1].shape == (t, h, rope)
    tf32 = dict(rtol=1e-2, atol=1e-2) if DEV == "cuda" and dtype == torch.float32 else tol  # fp32 MMA runs as TF32
    torch.testing.assert_close(got[0].cpu().float(), want[0].float(), **tf32)
    torch.testing.assert_close(got[1].cpu().float(), want[1].float(), **tol)
    assert torch.isfinite(caches[1][positions]).all() and caches[1][: 30 - t].isnan().all()
    torch.testing.assert_close(caches[1][positions].float(), caches[0][positions].float(), **tol)


@pytest.mark.parametrize("t,h,v,splits", [(1, 8, 16, 4), (9, 2, 24, 2), (16, 3, 16, 8)])
def test_attend_applies_w_v_and_the_gate_in_the_merge(poisoned, t, h, v, splits):
    """`mla_attend` (split kernel, then the merge with W_v and the gate, split over blocks of the latent)
    against its reference (the model's roundings); every scratch buffer poisoned."""
    from lingls.kernels.mla import mla_attend_reference

    g = torch.Generator().manual_seed(t * 7 + h)
    r, p, n = 128, 16, 90  # two merge blocks of 64 latent columns
    q_lat = torch.randn(t, h, r, generator=g).bfloat16()
    q_rope = torch.randn(t, h, p, generator=g).bfloat16()
    cache = torch.randn(n, r + p, generator=g).bfloat16()
    w_v = (torch.randn(h, v + 8, r, generator=g) * r ** -0.5).bfloat16()[:, 8:]  # a strided view, as in the model
    gate = torch.randn(t, h + 3, generator=g).bfloat16()[:, :h]
    positions = torch.arange(80 - t, 80)
    want = mla_attend_reference(q_lat, q_rope, cache, positions, 0.1, w_v, gate)
    got = mla_decode_triton(*(a.to(DEV) for a in (q_lat, q_rope, cache, positions)), 0.1, w_v.to(DEV), gate.to(DEV),
                            num_splits=splits, block_n=16)
    assert got.shape == (t, h * v) and got.dtype == torch.bfloat16
    assert rel(got.cpu(), want) < 2e-2  # bf16 output, after probabilities rounded to bf16 for the value MMA


@pytest.mark.parametrize("pick", [0, 4, 8])
def test_attend_of_one_row_read_on_the_device(poisoned, pick):
    """`row` (a device index) computes that query alone from all the step's rows: the bits of the kernels run on
    the row's inputs picked beforehand (as the MTP drafter's pass over a verify's rows did, one index_select
    per input)."""
    g = torch.Generator().manual_seed(pick)
    t, h, r, p, v, n = 9, 8, 128, 16, 16, 90
    q_lat = torch.randn(t, h, r, generator=g).bfloat16().to(DEV)
    q_rope = torch.randn(t, h, p, generator=g).bfloat16().to(DEV)
    cache = torch.randn(n, r + p, generator=g).bfloat16().to(DEV)
    w_v = (torch.randn(h, v, r, generator=g) * r ** -0.5).bfloat16().to(DEV)
    gate = torch.randn(t, h + 3, generator=g).bfloat16()[:, :h].to(DEV)
    positions = torch.arange(80 - t, 80).to(DEV)
    row = torch.tensor([pick], device=DEV)
    got = mla_decode_triton(q_lat, q_rope, cache, positions, 0.1, w_v, gate, num_splits=4, block_n=16, row=row)
    q1, r1, p1 = (x.index_select(0, row) for x in (q_lat, q_rope, positions))
    want = mla_decode_triton(q1, r1, cache, p1, 0.1, w_v, gate.index_select(0, row), num_splits=4, block_n=16)
    assert got.shape == (1, h * v) and torch.equal(got, want)
    ref = M.mla_attend_reference(q_lat.cpu(), q_rope.cpu(), cache.cpu(), positions.cpu(), 0.1, w_v.cpu(), gate.cpu(),
                                 row.cpu())
    assert rel(got.cpu(), ref) < 2e-2


def test_kernels_compile_for_h200():
    """The prologue (with the W_k programs), split and merge (plain and with W_v and the gate) kernels at flash's
    TP=4 rank shapes, with PDL, through the GPU compiler and ptxas for sm_90 (no GPU needed). The split kernel
    as the GPU runs it (its counted, pipelined loop) must not spill at T=1 or T=9 (the while loop spilled 232
    bytes per thread at T=9)."""
    from tests.kernels.test_kda import compile_for_sm90

    lines = compile_for_sm90("""
        from lingls.kernels import mla
        build(mla._mla_prologue_kernel, dict(q_ptr="*bf16", kv_ptr="*bf16", w_ptr="*bf16", freq_ptr="*fp32",
              pos_ptr="*i64", cache_ptr="*bf16", qr_ptr="*bf16", wk_ptr="*bf16", ql_ptr="*bf16",
              eps="fp32"), dict(H=8, H_PAD=8, NOPE=128, NOPE_PAD=128, R=512, R_PAD=512, RBLK=64, HALF=32,
              HALF_PAD=32, INTERLEAVE=True, USE_PDL=True, F32_DOT=False), 4, True)
        for bt, g, row in ((16, 8, True), (16, 1, False)):  # one token (the MTP drafter's picked row), T=9
            build(mla._mla_split_kernel, dict(q_lat="*bf16", q_rope="*bf16", cache="*bf16", positions="*i64",
                  row_ptr="*i64", part_acc="*fp32", part_ml="*fp32", scale="fp32"), dict(H=8, G=g, R=512, P=64,
                  BT=bt, BN=32, NUM_SPLITS=128, HAS_ROW=row, USE_PDL=True, F32_DOT=False, COUNTED=True),
                  8 if g == 8 else 4, True)
        for absorb in (False, True):
            build(mla._mla_merge_kernel, dict(part_acc="*fp32", part_ml="*fp32", out="*bf16" if absorb else "*fp32",
                  wv_ptr="*bf16", g_ptr="*bf16", row_ptr="*i64", part_o="*fp32", cnt_ptr="*i32"), dict(H=8, R=512,
                  RBLK=64, V=128, V_PAD=128, NUM_SPLITS=64, ABSORB=absorb, HAS_ROW=absorb, USE_PDL=True), 4, True)
    """)
    assert len(lines) == 5, lines
    for line in lines[1:3]:
        assert "_mla_split_kernel" in line and "STACK:0 " in line and "LOCAL:0 " in line, line


def test_reference_takes_long_prefills_a_block_of_queries_at_a_time(monkeypatch):
    """A prefill chunk's queries in blocks (bounded memory) give what all of them at once give."""
    gen = torch.Generator().manual_seed(4)
    t, h, r, p, n = 40, 2, 16, 8, 64
    q_lat, q_rope = torch.randn(t, h, r, generator=gen), torch.randn(t, h, p, generator=gen)
    cache = torch.randn(n, r + p, generator=gen)
    positions = torch.arange(n - t, n)
    whole = M.mla_decode_reference(q_lat, q_rope, cache, positions, 0.3)
    monkeypatch.setattr(M, "QUERY_BLOCK", 16)
    torch.testing.assert_close(M.mla_decode_reference(q_lat, q_rope, cache, positions, 0.3), whole)
