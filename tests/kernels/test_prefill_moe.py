"""The prefill's grouped expert kernels (`kernels/prefill_moe.py`) in both forms against the plain-torch definition
(`moe_prefill_reference`), on fresh random inputs with ragged expert counts: empty experts, experts of one
partly filled block, an expert whose run spans many blocks. Triton's interpreter on a CPU (fp32 operands), the
real kernels on a GPU (bf16 at a TP=4 rank's expert shapes); the kernels compile for sm_90 without a GPU. Every
buffer the module allocates starts as NaN (floats) or -1 (ints), so a read of anything unwritten shows."""

import os

import pytest
import torch

pytest.importorskip("triton")  # GPU-only dependency: these tests run its interpreter on a CPU

from lingls.kernels import prefill_moe as pm  # noqa: E402
from tests.kernels.conftest import rel  # noqa: E402
from tests.kernels.test_kda import compile_for_sm90  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RUNS = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                          reason="Triton kernels run on a GPU or under TRITON_INTERPRET=1")


def ragged_routing(gen, n: int, k: int, e: int, crowded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k] fp32, idx [n, k]) with k distinct experts a token: slot 0 of every token goes to one of
    `crowded` experts (long runs, many blocks each), the other slots to random experts of the rest except the
    last three (always empty), so the counts run from 0 to about n / crowded."""
    first = torch.randint(0, crowded, (n, 1), generator=gen)
    rest = torch.stack([crowded + torch.randperm(e - crowded - 3, generator=gen)[:k - 1] for _ in range(n)])
    return torch.rand(n, k, generator=gen), torch.cat([first, rest], 1)


def weights(gen, e: int, h: int, inter: int, dtype):
    """Expert weights drawn where `gen` lives (a rank's 1.5 GB of them on the GPU itself)."""
    gate_up = torch.randn(e, 2 * inter, h, generator=gen, device=gen.device) * h ** -0.5
    down = torch.randn(e, h, inter, generator=gen, device=gen.device) * inter ** -0.5
    return gate_up.to(DEV, dtype), down.to(DEV, dtype)


PAIRS = [(g, d) for g in pm.GATE_UP_FORMS for d in pm.DOWN_FORMS]  # (gate/up's form, down's)


@RUNS
@pytest.mark.parametrize("form, down_form", PAIRS)
@pytest.mark.parametrize("n, k, e, h, inter, block_m, limit", [
    (37, 3, 12, 64, 24, 16, 0.0),  # INTER in 2 chunks of 16, the last partly past INTER
    (61, 4, 16, 48, 40, 16, 0.5),  # 3 chunks, the clamp
    (45, 2, 9, 32, 64, 8, 0.0),  # 4 chunks of 16; blocks of 8 rows
    (29, 3, 10, 32, 200, 16, 0.0),  # 4 chunks of 64 (the widest the whole-block down kernel takes)
    (23, 3, 10, 32, 300, 16, 0.0),  # wider: the block form's kernels in every form
])
def test_grouped_expert_kernels_equal_reference(poisoned, form, down_form, n, k, e, h, inter, block_m, limit):
    gen = torch.Generator().manual_seed(n * 1000 + inter)
    gate_up, down = weights(gen, e, h, inter, torch.float32 if DEV == "cpu" else torch.bfloat16)
    w, idx = ragged_routing(gen, n, k, e, crowded=1)
    x = torch.randn(n, h, generator=gen).to(DEV, gate_up.dtype)
    w, idx = w.to(DEV), idx.to(DEV)
    counts = torch.bincount(idx.flatten().cpu(), minlength=e)
    assert counts[-3:].sum() == 0 and counts.max() > block_m  # empty experts and a run of several blocks
    got = pm.moe_prefill_triton(x, w, idx, gate_up, down, inter, limit, block_m=block_m, form=form,
                                down_form=down_form)
    want = pm.moe_prefill_reference(x, w, idx, gate_up, down, inter, limit)
    # fp32 under the interpreter; on a GPU bf16 operands, products rounded where the definition rounds them
    assert rel(got, want) < (1e-5 if DEV == "cpu" else 1e-2)


@RUNS
@pytest.mark.parametrize("n, k, e, h, inter, block_m, limit", [
    (37, 3, 12, 64, 24, 16, 0.0),  # one column tile, partly past INTER
    (61, 4, 16, 48, 100, 16, 0.5),  # two tiles, the second partly past INTER; the clamp
    (45, 2, 9, 96, 192, 8, 0.0),  # three whole tiles (a TP=4 rank's INTER); K past H in its last step
    (29, 3, 10, 32, 256, 16, 0.0),  # four tiles, the widest it takes
    (23, 3, 10, 32, 300, 16, 0.0),  # wider: the block form's kernels
])
def test_whole_block_kernels_are_the_other_forms_bit_for_bit(poisoned, monkeypatch, n, k, e, h, inter, block_m,
                                                             limit):
    """A program per block over all its column tiles sums each tile's K steps in the order of the block form's
    kernels: the same bits (at the same tile widths and K steps: a BLAS may block a wider product otherwise), and
    the definition's result."""
    if inter <= pm.DOWN_WHOLE_MAX_INTER:
        monkeypatch.setattr(pm, "DOWN_CONFIG", (pm.DOWN_WHOLE[0], pm.down_chunks(inter)[0], *pm.DOWN_CONFIG[2:]))
    gen = torch.Generator().manual_seed(n * 1000 + inter)
    gate_up, down = weights(gen, e, h, inter, torch.float32 if DEV == "cpu" else torch.bfloat16)
    w, idx = ragged_routing(gen, n, k, e, crowded=1)
    x = torch.randn(n, h, generator=gen).to(DEV, gate_up.dtype)
    w, idx = w.to(DEV), idx.to(DEV)
    got = pm.moe_prefill_triton(x, w, idx, gate_up, down, inter, limit, block_m=block_m, form="whole_block",
                                down_form="whole_block")
    block = pm.moe_prefill_triton(x, w, idx, gate_up, down, inter, limit, block_m=block_m, form="by_block",
                                  down_form="by_block")
    assert torch.equal(got, block)
    assert rel(got, pm.moe_prefill_reference(x, w, idx, gate_up, down, inter, limit)) < (
        1e-5 if DEV == "cpu" else 1e-2)


@RUNS
def test_the_weighted_sum_adds_plus_as_torch_adds_it(poisoned):
    """`plus` (the shared expert's output) folded into the weighted sum's pass: the bits of `result + plus`; the
    the shipped forms compute what the block forms compute."""
    gen = torch.Generator().manual_seed(11)
    n, k, e, h, inter = 37, 3, 12, 64, 24
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    gate_up, down = weights(gen, e, h, inter, dtype)
    w, idx = ragged_routing(gen, n, k, e, crowded=1)
    x = torch.randn(n, h, generator=gen).to(DEV, dtype)
    plus = torch.randn(n, h, generator=gen).to(DEV, dtype)
    w, idx = w.to(DEV), idx.to(DEV)
    alone = pm.moe_prefill_triton(x, w, idx, gate_up, down, inter, block_m=16, form="by_block", down_form="by_block")
    assert torch.equal(pm.moe_prefill_triton(x, w, idx, gate_up, down, inter, block_m=16, form="by_block",
                                             down_form="by_block", plus=plus), alone + plus)
    shipped = pm.moe_prefill_triton(x, w, idx, gate_up, down, inter, block_m=16)
    assert rel(shipped, alone) < (1e-6 if DEV == "cpu" else 1e-2)
    with pytest.raises(ValueError, match="plus must be"):
        pm.moe_prefill_triton(x, w, idx, gate_up, down, inter, block_m=16, plus=plus[:-1])


def test_unknown_form_is_named():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="whole_block"):
        pm.moe_prefill_triton(x, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), torch.zeros(1, 8, 8),
                              torch.zeros(1, 8, 4), 4, form="by_token")


def test_down_chunks_cover_inter_in_at_most_four():
    for inter in (8, 24, 48, 64, 96, 192, 200, 256):
        block_k, chunks = pm.down_chunks(inter)
        assert block_k >= 16 and block_k & (block_k - 1) == 0 and chunks <= 4
        assert (chunks - 1) * block_k < inter <= chunks * block_k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash-shape check runs on a GPU")
@pytest.mark.parametrize("inter", [192, 384])
def test_expert_forms_agree_at_rank_shapes(inter):
    """A TP=4 rank's expert shapes (H 2,560, INTER 192, 512 experts; 384: a TP=2 rank, whose down takes the block
    form's kernel), 256 tokens x 8, bf16: each form within bf16 rounding of the definition, and the two forms
    within rounding of each other (printed: whether their bits are the same)."""
    gen = torch.Generator(device=DEV).manual_seed(inter)
    n, k, e, h = 256, 8, 512, 2560
    gate_up, down = weights(gen, e, h, inter, torch.bfloat16)
    # two experts of 128 rows (two blocks), ~3 rows elsewhere
    w, idx = ragged_routing(torch.Generator().manual_seed(inter), n, k, e, crowded=2)
    x = torch.randn(n, h, generator=gen, device=DEV).to(torch.bfloat16)
    w, idx = w.to(DEV), idx.to(DEV)
    want = pm.moe_prefill_reference(x, w, idx, gate_up, down, inter)
    got = {pair: pm.moe_prefill_triton(x, w, idx, gate_up, down, inter, form=pair[0], down_form=pair[1])
           for pair in PAIRS}
    for pair, out in got.items():
        assert rel(out, want) < 1e-2, pair
    shipped = got[pm.FORM, pm.DOWN_FORM]
    for pair, out in got.items():  # printed: whose bits are the same (the same K order at other tile widths)
        print(f"INTER {inter}: {pair} bitwise equal to the shipped forms: {torch.equal(out, shipped)}, rel "
              f"{rel(out, shipped):.2e}; vs the definition {rel(out, want):.2e}")
        assert rel(out, shipped) < 1e-2, pair
    assert torch.equal(got["whole_block", "by_block"], got["by_block", "by_block"])  # gate/up: the same tiles


def test_expert_kernels_compile_for_h200():
    """The whole-block kernels through the GPU compiler and ptxas for sm_90, at their launch settings: gate/up
    at a TP=4 rank's INTER (192: 3 column tiles of 64), down at 192 (3 chunks of 64) and at ling-nano's INTER (48:
    3 chunks of 16). No spills; each in at most ~113 KB of shared memory: two programs an SM."""
    lines = compile_for_sm90("""
        from lingls.kernels import prefill_moe as pm
        compile_ = triton.compile  # the launch's pipeline depth, which `build` does not pass
        def with_stages(stages):
            triton.compile = lambda src, target, options: compile_(src, target=target,
                                                                   options={**options, "num_stages": stages})
        bn, bk, warps, stages = pm.GATE_UP_WHOLE
        with_stages(stages)
        build(pm._grouped_gate_up_whole_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", rows_ptr="*i32", bexp_ptr="*i32",
              act_ptr="*bf16"), dict(TOP_K=8, E=512, H=2560, INTER=192, LIMIT=0.0, BLOCK_M=pm.BLOCK_M, BLOCK_N=bn,
              BLOCK_K=bk, TILES=3, F32_DOT=False), warps)
        bn, warps, stages = pm.DOWN_WHOLE
        with_stages(stages)
        for inter in (192, 48):
            bk, chunks = pm.down_chunks(inter)
            build(pm._grouped_down_whole_kernel, dict(act_ptr="*bf16", w_ptr="*bf16", rows_ptr="*i32",
                  bexp_ptr="*i32", y_ptr="*bf16"), dict(E=512, H=2560, INTER=inter, BLOCK_M=pm.BLOCK_M, BLOCK_N=bn,
                  BLOCK_K=bk, K_CHUNKS=chunks, STAGES=stages, F32_DOT=False), warps)
    """)
    assert len(lines) == 3, lines
    for line in lines:
        assert "STACK:0 " in line and "LOCAL:0 " in line, line
        assert int(line.rsplit("SMEM:", 1)[1]) <= 113 * 1024, line
