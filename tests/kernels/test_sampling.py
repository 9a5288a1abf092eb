"""lm_head + token choice against its reference (Triton's interpreter on CPU, the real kernel on GPU).

Greedy: the kernel's token must be a maximum of the fp32 logits (1e-5 of the reference's maximum; any index on
an exact tie). Sampling: the same token as the reference race and as `runtime.sampling.sample` at top_p = 1;
the hash equals the runtime's. Tensor parallel: shards with offsets, combined, equal the whole vocab.
"""

import pytest
import torch

pytest.importorskip("triton")  # GPU-only dependency: these tests run its interpreter on CPU

from lingls.kernels import sampling as S
from lingls.runtime import sampling as runtime_sampling

DEV = "cuda" if torch.cuda.is_available() else "cpu"



def inputs(t, v, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen).to(DEV, torch.bfloat16)
    w = (torch.randn(v, k, generator=gen) * k ** -0.5).to(DEV, torch.bfloat16)
    return x, w


def sampling_args(t, seed):
    pos = torch.arange(t, device=DEV) + 4096 * seed
    return pos, torch.tensor([0.8], device=DEV), torch.tensor([seed * 0x1234567890ABC + 11], device=DEV)


@pytest.mark.parametrize("t,v,k", [(1, 1000, 128), (9, 777, 256), (16, 3000, 64)])
def test_greedy_and_logits(poisoned, t, v, k):
    x, w = inputs(t, v, k, t + v)
    logits = torch.full((t, v), float("nan"), device=DEV)
    val, idx = S.lm_head_choose(x, w, vocab_offset=5, logits_out=logits)
    exact = x.double() @ w.double().t()
    assert torch.isfinite(logits).all() and ((logits - exact).norm() / exact.norm()) < 1e-5
    top = exact.max(-1).values
    assert idx.dtype == torch.int64 and ((idx - 5) >= 0).all() and ((idx - 5) < v).all()
    torch.testing.assert_close(exact.gather(1, (idx - 5)[:, None]).squeeze(1), top, rtol=0, atol=1e-5)
    torch.testing.assert_close(val.double(), top, rtol=0, atol=1e-5)


@pytest.mark.parametrize("t,v,k", [(1, 1000, 128), (9, 777, 256), (16, 3000, 64)])
def test_sampling_equals_reference_and_runtime(poisoned, t, v, k):
    x, w = inputs(t, v, k, 3 * t + v)
    pos, temp, seed = sampling_args(t, t)
    val, idx = S.lm_head_choose(x, w, True, pos, temp, seed)
    rval, ridx = S.lm_head_choose_reference(x, w, True, pos, temp, seed)
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(val, rval, rtol=1e-5, atol=1e-5)
    full = runtime_sampling.sample(x.float() @ w.float().t(), pos, False, temp, torch.tensor([1.0], device=DEV), seed)
    assert torch.equal(idx, full)


def test_hash_is_the_runtime_stream():
    seed = torch.tensor([987654321987654321])
    pos, ids = torch.arange(7)[:, None] * 13, torch.arange(5000)[None, :]
    assert torch.equal(S.uniform_hash(seed, pos, ids), runtime_sampling.uniform_hash(seed, pos, ids))


@pytest.mark.parametrize("sample", [False, True])
def test_tensor_parallel_shards_agree_with_whole_vocab(poisoned, sample):
    t, v, k = 9, 1200, 64
    x, w = inputs(t, v, k, 17 + sample)
    pos, temp, seed = sampling_args(t, 3)
    args = (sample, pos, temp, seed)
    cuts = [0, 300, 700, 1200]  # uneven shards, as a vocab that does not divide evenly
    parts = [S.lm_head_choose(x, w[a:b], *args, vocab_offset=a) for a, b in zip(cuts, cuts[1:])]
    combined = S.combine_ranks(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert torch.equal(combined, S.lm_head_choose_reference(x, w, *args)[1])


def test_dispatch_on_cpu_is_the_reference():
    x, w = torch.randn(3, 32).bfloat16(), torch.randn(50, 32).bfloat16()
    got, want = S.choose(x, w), S.lm_head_choose_reference(x, w)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("t,v,block,dtype", [(1, 157184 // 8, 512, torch.bfloat16), (9, 5000, 256, torch.float32),
                                             (3, 100, 64, torch.bfloat16)])
def test_argmax_rows_is_torch_argmax(poisoned, t, v, block, dtype):
    """Every row's first maximum, as torch.argmax: random rows, rows of repeated maxima (bf16 ties are
    common), a row of -inf but one, and a maximum in the last, partial block; several calls (the counters
    reset themselves)."""
    gen = torch.Generator().manual_seed(t * v)
    x = torch.randn(t, v, generator=gen).to(DEV, dtype)
    x[0, v // 3] = x[0, v - 1] = x[0].max() + 1  # a tie: the first one wins
    if t > 1:
        x[1] = float("-inf")
        x[1, v - 1] = 0.0
    if t > 2:
        x[2] = x[2].round()  # many equal values
    for _ in range(2):
        got = S.argmax_rows(x, block=block)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))
    assert torch.equal(runtime_sampling.argmax(x), x.argmax(-1))  # the runtime's dispatch


@pytest.mark.parametrize("ranks", [2, 4])
def test_argmax_exchange_over_shards_is_the_whole_argmax(poisoned, ranks):
    """Each rank's message (its best score and token in its slots, zeros in the others), summed over the ranks
    as the all-reduce does, then picked: the whole vocabulary's first maximum, ties across shards included."""
    t, v = 5, 4096
    gen = torch.Generator().manual_seed(ranks)
    x = torch.randn(t, v, generator=gen).to(DEV, torch.bfloat16)
    x[0, v - 7] = x[0, 5] = x[0].max() + 1  # tied in the first and the last shard: the first wins
    x[1] = -3.0  # every score negative and equal: token 0 (the zeros of the other slots never win)
    x[1, v // 2 + 1] = -2.5
    shard = v // ranks
    msgs = [S.argmax_rows(x[:, r * shard:(r + 1) * shard], block=256, offset=r * shard, exchange=(r, ranks))
            for r in range(ranks)]
    for r, m in enumerate(msgs):
        assert m.shape == (2, ranks, t) and not m[:, [s for s in range(ranks) if s != r]].any()
    assert torch.equal(S.pick_rows(sum(msgs)), x.argmax(-1))


def test_argmax_rows_maps_rows_to_token_ids(poisoned):
    x = torch.randn(3, 700, generator=torch.Generator().manual_seed(1)).to(DEV)
    ids = torch.randperm(10 ** 5, generator=torch.Generator().manual_seed(2))[:700].to(DEV)
    assert torch.equal(S.argmax_rows(x, block=128, ids=ids), ids[x.argmax(-1)])
    assert torch.equal(S.argmax_rows(x, block=128, offset=1000), x.argmax(-1) + 1000)
