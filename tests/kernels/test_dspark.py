"""The DSpark round's kernels (`lingls.kernels.dspark`) against their references on fresh random inputs: Triton's
interpreter on CPU at tiny shapes, the real kernels on a GPU (bf16 there, the round's dtype).

The Markov choices are checked through `DSparkRuntime._choose_on_device`, the wiring the round runs: at TP=1 each
slot's launch writes its token into the drafts buffer; under TP each launch's exchange message is all-reduced and
decided by the next slot's launch, the last by `pick_rows`. The all-reduce here adds the other ranks' messages,
made from the reference, to this rank's (the kernel's)."""

import types

import pytest
import torch

pytest.importorskip("triton")

from lingls.kernels import dspark  # noqa: E402
from lingls.runtime.spec.round import DSparkRuntime  # noqa: E402
from tests.kernels.conftest import rel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _greedy_reference(logits, cur, w1, w2, k):
    """The drafts slot by slot: argmax of logits row i + markov_w2 @ markov_w1[previous draft]."""
    prev, out = cur, []
    for i in range(k):
        prev = dspark.markov_corrected_reference(logits[i:i + 1], prev, w1, w2).argmax(-1)
        out.append(prev)
    return torch.cat(out)


def _message(row, offset, rank, ranks):
    """Rank `rank`'s exchange message [2, ranks, 1] for its corrected row (the reference's `argmax_shards`)."""
    msg = torch.zeros(2, ranks, 1, dtype=torch.float32, device=row.device)
    i = row.argmax(-1)
    msg[0, rank, 0] = row[0, i].float()
    msg[1, rank, 0] = float(i + offset)
    return msg


def _same_cache_but_rows(cache, want, pos, n, tol):
    """Rows pos..pos+n-1 of both caches (keys and values) agree within tol, every other row is untouched."""
    assert rel(cache[:, pos:pos + n], want[:, pos:pos + n]) < tol
    assert torch.equal(cache[:, :pos], want[:, :pos]) and torch.equal(cache[:, pos + n:], want[:, pos + n:])


@pytest.mark.parametrize("ranks,k", [(1, 8), (2, 8), (4, 8), (2, 3)])
def test_markov_choices_write_the_drafts(poisoned, ranks, k):
    b, v, r = 8, 384, 64  # 256 rows per program at rank 64: several programs per shard at ranks <= 1
    gen = torch.Generator().manual_seed(10 * ranks + k)
    # fp32: the kernel's bias sums in another order than the reference's matmul; in bf16 that can move a
    # rounding and flip a near tie, a difference of order, not of wiring (the round's bf16 agreement at flash
    # shapes: bench/spec_flash_gpu.py's kernel check)
    logits = torch.randn(b, v, generator=gen).to(DEV)
    w1 = torch.randn(v, r, generator=gen).to(DEV)
    w2 = (torch.randn(v, r, generator=gen) * 0.3).to(DEV)
    cur = torch.tensor([7], device=DEV)
    want = _greedy_reference(logits, cur, w1, w2, k)
    rank, shard = ranks - 1, v // ranks  # the last rank runs the kernels: its tokens carry an offset
    lo = rank * shard
    sent = []

    def all_reduce(msg):  # the other ranks' messages for the same previous token, added in place
        prev = cur if not sent else want[len(sent) - 1:len(sent)]
        for other in range(ranks - 1):
            row = dspark.markov_corrected_reference(logits[len(sent):len(sent) + 1, other * shard:(other + 1) * shard],
                                                    prev, w1, w2[other * shard:(other + 1) * shard])
            msg += _message(row, other * shard, other, ranks)
        sent.append(msg)
        return msg

    par = types.SimpleNamespace(rank=rank, size=ranks, all_reduce=all_reduce)
    drafts = torch.full((b,), -1, dtype=torch.long, device=DEV)
    me = types.SimpleNamespace(model=types.SimpleNamespace(par=par), markov_w1=w1,
                               markov_w2=w2[lo:lo + shard].contiguous(), drafts=drafts, k=k)
    got = DSparkRuntime._choose_on_device(me, logits[:, lo:lo + shard].contiguous(), cur)
    assert got.data_ptr() == drafts.data_ptr() and got.tolist() == want.tolist()
    assert (drafts[k:] == -1).all()  # nothing past the K drafts written
    assert len(sent) == (k if ranks > 1 else 0)


def test_block_qk_rope_and_attention_match_the_references(poisoned):
    """q/k norm + RoPE + cache write, then the split-sequence attention over the context and the block (rows past
    pos + B hold stale values: masked), GQA 2 query heads per kv head."""
    gen = torch.Generator().manual_seed(3)
    b, h, kvh, d, s, pos = 8, 4, 2, 32, 600, 517  # several splits of 64-key tiles; the block ends mid-tile
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    qkv = torch.randn(b, (h + 2 * kvh) * d, generator=gen).to(DEV, dtype)
    qn, kn = (1 + 0.2 * torch.randn(2, d, generator=gen)).to(DEV, dtype)
    freq = (1.0 / 1e4 ** (torch.arange(0, d, 2) / d)).to(DEV)
    cache = torch.randn(2, s, kvh, d, generator=gen).to(DEV, dtype)
    p = torch.tensor([pos], device=DEV)
    want_cache = cache.clone()
    want_q = dspark.block_qk_rope_reference(qkv, qn, kn, freq, pos, want_cache[0], want_cache[1], h, kvh, 1e-6)
    q = dspark.block_qk_rope(qkv, qn, kn, freq, p, cache[0], cache[1], h, kvh, 1e-6)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel(q, want_q) < tol
    _same_cache_but_rows(cache, want_cache, pos, b, tol)
    kv_len = s - 40  # the grid's rows (static): at least pos + B
    got = dspark.block_attend(q, cache[0], cache[1], p, kv_len)
    want = dspark.block_attend_reference(q, cache[0], cache[1], pos, kv_len)
    assert rel(got, want) < tol


@pytest.mark.parametrize("t,heads,split", [(8, 4, None), (8, 4, 3), (9, 0, 2), (1, 4, 1)])
def test_block_qkv_rope_matches_gemv_then_block_qk_rope(poisoned, t, heads, split):
    """The q|k|v projection with the q/k norm, RoPE and cache write in one launch: split-K partials (ragged K),
    context rows (no query heads), a single row; against the GEMV's reference followed by `block_qk_rope`'s."""
    gen = torch.Generator().manual_seed(t + heads)
    kvh, d, k, s, pos = 2, 32, 200, 40, 21
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    x = torch.randn(t, k, generator=gen).to(DEV, dtype)
    w = (torch.randn((heads + 2 * kvh) * d, k, generator=gen) * k ** -0.5).to(DEV, dtype)
    qn, kn = (1 + 0.2 * torch.randn(2, d, generator=gen)).to(DEV, dtype)
    freq = (1.0 / 1e4 ** (torch.arange(0, d, 2) / d)).to(DEV)
    cache = torch.randn(2, s, kvh, d, generator=gen).to(DEV, dtype)
    want_cache = cache.clone()
    want = dspark.block_qkv_rope_reference(x, w, qn, kn, freq, pos, want_cache[0], want_cache[1], heads, kvh, 1e-6)
    got = dspark.block_qkv_rope(x, w, qn, kn, freq, torch.tensor([pos], device=DEV), cache[0], cache[1], heads, kvh,
                                1e-6, split=split)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert got.shape == want.shape
    _same_cache_but_rows(cache, want_cache, pos, t, tol)
    if heads:
        assert rel(got, want) < tol
