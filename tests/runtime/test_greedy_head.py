"""`sampling.greedy_tokens`: the greedy token without forming the logits, on one rank and across vocab shards."""

from types import SimpleNamespace

import torch

from lingls.model.ling import Parallel
from lingls.runtime.sampling import greedy_tokens


def head(w: torch.Tensor, rank: int = 0, size: int = 1, gather=lambda x: x):
    return SimpleNamespace(lm_head=SimpleNamespace(weight=w), par=Parallel(rank, size, all_gather_last=gather))


def test_one_rank_takes_the_first_maximum_of_the_fp32_logits():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 16, generator=g).bfloat16()
    w[31] = w[7]  # an exact tie: the lower id wins
    x = torch.randn(5, 16, generator=g).bfloat16()
    x[2] = w[7]  # row 2 scores ids 7 and 31 highest, equally
    want = (x.float() @ w.float().t()).argmax(-1)
    assert torch.equal(greedy_tokens(head(w), x), want) and want[2] == 7


def test_vocab_shards_agree_with_the_whole_vocab():
    """Two ranks, each with half the vocab: the gathered (best, id) pairs give the whole vocab's argmax, ties to
    the lower id (rank 0) included."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 16, generator=g).bfloat16()
    w[40] = w[3]  # tie across the shards
    x = torch.randn(9, 16, generator=g).bfloat16()
    x[4] = w[3]
    shards = w.chunk(2)
    sent = []
    for r in range(2):  # what each rank contributes to the all-gather
        greedy_tokens(head(shards[r], r, 2, lambda t: sent.append(t) or torch.cat([t, t], -1)), x)
    gathered = torch.cat(sent, -1)
    got = [greedy_tokens(head(shards[r], r, 2, lambda t: gathered), x) for r in range(2)]
    want = (x.float() @ w.float().t()).argmax(-1)
    assert torch.equal(got[0], want) and torch.equal(got[1], want) and want[4] == 3
