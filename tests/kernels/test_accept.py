"""The round's settle launch against its torch reference (Triton's interpreter on CPU, the real kernel on GPU):
greedy n from the drafts, a given n (sampling), forced counts, and every buffer it writes."""

import pytest
import torch

pytest.importorskip("triton")  # GPU-only dependency: these tests run its interpreter on CPU

from lingls.kernels.accept import settle_round, settle_round_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def run(settle, choice, drafts, n=None, force=None, two=True):
    """The settle's outputs and every buffer it writes, from the same starting values."""
    k = drafts.shape[0]
    ids_a, ids_b = torch.full((1,), -7, device=DEV), torch.full((1,), -9, device=DEV)
    pos = torch.tensor([100], device=DEV)
    result = torch.full((k + 2,), -5, device=DEV)
    got_n, tokens = settle(choice, drafts, (ids_a, ids_b) if two else (ids_a,), pos, result, n=n, force=force)
    return [got_n.clone(), tokens.clone(), ids_a, ids_b, pos, result]


@pytest.mark.parametrize("k", [1, 4, 8, 15])
@pytest.mark.parametrize("mode", ["greedy", "given", "forced"])
def test_settle_equals_reference(k, mode):
    gen = torch.Generator().manual_seed(k)
    for trial in range(6):
        choice = torch.randint(0, 5, (k + 1,), generator=gen).to(DEV)
        drafts = choice[:-1].clone()
        drafts[torch.randint(0, k + 1, (1,), generator=gen).item():] += 1  # differ from a random place on
        n = torch.randint(0, k + 1, (1,), generator=gen).to(DEV) if mode == "given" else None
        force = torch.tensor([trial * 4 - 5], device=DEV) if mode == "forced" else None  # below 0, inside, above K
        want = run(settle_round_reference, choice, drafts, n, force)
        got = run(settle_round, choice, drafts, n, force)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        if mode == "greedy":
            first_miss = next((i for i in range(k) if drafts[i] != choice[i]), k)
            assert got[0].item() == first_miss and got[2].item() == choice[first_miss].item()
        assert got[4].item() == 100 + got[0].item() + 1


def test_one_next_buffer_leaves_the_other_alone():
    choice, drafts = torch.tensor([3, 4, 5], device=DEV), torch.tensor([3, 9], device=DEV)
    got = run(settle_round, choice, drafts, two=False)
    assert got[0].item() == 1 and got[2].item() == 4 and got[3].item() == -9
    assert got[5].tolist() == [1, 3, 4, 5]


def test_a_decode_step_is_a_round_without_drafts():
    """K = 0, no result buffer: the token into both buffers, the position one further, as the reference."""
    for settle in (settle_round, settle_round_reference):
        out, ids = torch.full((1,), -1, device=DEV), torch.full((1,), -2, device=DEV)
        pos = torch.tensor([41], device=DEV)
        no_drafts = torch.zeros(0, dtype=torch.long, device=DEV)
        assert settle(torch.tensor([7], device=DEV), no_drafts, (out, ids), pos) is None
        assert (out.item(), ids.item(), pos.item()) == (7, 7, 42)
