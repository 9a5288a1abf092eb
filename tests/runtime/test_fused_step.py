"""FusedStep (the kernels' wiring of a decode/verify step) computes the model's step: with the plain-torch
references, and with the real Triton kernels (run by Triton's interpreter when there is no GPU)."""

import pytest
import torch

pytest.importorskip("triton")  # GPU-only dependency: these tests run its interpreter on CPU

from lingls.kernels import kda
from lingls.model.ling import LingForCausalLM
from lingls.runtime.fused_step import FusedStep
from tests.model.conftest import randomize, small_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels take CUDA tensors (or CPU ones, interpreted)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LingForCausalLM(small_config(num_hidden_layers=4, expert_swiglu_limit_list=[0, 0, 3.0, 3.0],
                                     share_expert_swiglu_limit_list=[0, 0, 2.0, 2.0]))
    m.init_weights()
    randomize(m, 0)
    return m.eval().to(DEV)


@pytest.mark.parametrize("kernels", [False, True], ids=["references", "triton"])
def test_fused_step_equals_model_step(model, kernels):
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(1)).to(DEV)
    pos = torch.arange(30, device=DEV)
    with torch.inference_mode():
        prefilled = model.new_state(64)
        model.step(ids[:20], prefilled, pos[:20])
        want_state = prefilled.clone()
        want = [model.step(ids[20:21], want_state, pos[20:21]), model.step(ids[21:30], want_state, pos[21:30])]
        state = prefilled.clone()
        fused = FusedStep(model, kernels=kernels)
        got = [fused.step(ids[20:21], state, pos[20:21]), fused.step(ids[21:30], state, pos[21:30])]
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < 1e-5
    assert (state.kda - want_state.kda).abs().max().item() < 1e-5
    assert (state.conv - want_state.conv).abs().max().item() < 1e-5
    assert (state.latent - want_state.latent).abs().max().item() < 1e-5


@pytest.mark.parametrize("kernels", [False, True], ids=["references", "triton"])
def test_step_returns_the_heads_input(model, kernels):
    """normed=True: the last residual add also writes the final norm in its launch: the same hidden states, and
    the head's input with the bits of the head's own norm; with `keep`, the norm comes last."""
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(5)).to(DEV)
    pos = torch.arange(30, device=DEV)
    with torch.inference_mode():
        state = model.new_state(64)
        model.step(ids[:20], state, pos[:20])
        fused = FusedStep(model, kernels=kernels)
        for rows in (slice(20, 21), slice(20, 29)):
            h = fused.step(ids[rows], state.clone(), pos[rows])
            got, normed = fused.step(ids[rows], state.clone(), pos[rows], normed=True)
            assert torch.equal(got, h)
            assert torch.equal(fused.head(h, normed), fused.head(h))
            want, want_normed = model.step(ids[rows], state.clone(), pos[rows], normed=True)
            assert (normed - want_normed).abs().max().item() < 1e-5
            assert (model.head(want, want_normed) - model.head(want)).abs().max().item() == 0
        got, kept, normed = fused.step(ids[20:25], state.clone(), pos[20:25], keep=(1,), normed=True)
        assert set(kept) == {1}
        assert torch.equal(normed, fused.step(ids[20:25], state.clone(), pos[20:25], normed=True)[1])
    # the heads take the step's (inference-mode) tensors outside inference mode too, as a graph warm-up does
    assert torch.equal(fused.head(got, normed), fused.head(got))


def test_fusing_rows_keeps_one_copy_of_each_weight(model):
    FusedStep(model, kernels=False)
    attn = model.model.layers[0].attention
    q = attn.q_proj.weight
    assert attn.k_proj.weight.data_ptr() == q.data_ptr() + q.numel() * q.element_size()


def test_prefill_sized_inputs_are_refused(model):
    with pytest.raises(ValueError, match="prefill"):
        FusedStep(model, kernels=False).step(torch.zeros(17, dtype=torch.long, device=DEV), model.new_state(32),
                                             torch.arange(17, device=DEV))


@pytest.mark.parametrize("kernels", [False, True], ids=["references", "triton"])
def test_staged_verify_and_kept_layers(model, kernels):
    """With `stage`, the live KDA state is left alone and committing position t gives the state after it;
    `keep` returns the named layers' outputs (what a block drafter reads)."""
    ids = torch.randint(0, 96, (25,), generator=torch.Generator().manual_seed(2)).to(DEV)
    pos = torch.arange(25, device=DEV)
    with torch.inference_mode():
        state = model.new_state(64)
        model.step(ids[:20], state, pos[:20])
        n_kda = state.kda.shape[0]
        heads, d = state.kda.shape[1], state.kda.shape[-1]
        stage = (torch.zeros(n_kda, 5, heads, kda.STAGE_ROWS, d, device=DEV),
                 torch.zeros(n_kda, 5, *state.conv.shape[1:3], device=DEV))
        live = state.clone()
        fused = FusedStep(model, kernels=kernels)
        h, kept = fused.step(ids[20:25], live, pos[20:25], stage=stage, keep=(1, 2))
        assert torch.equal(live.kda, state.kda)  # untouched: only staged
        for t in (0, 2, 4):  # committing position 20 + t gives the state of running t + 1 tokens
            want, got = state.clone(), state.clone()
            model.step(ids[20:21 + t], want, pos[20:21 + t])
            commit = kda.fused_commit if kernels else kda.commit_reference
            commit(torch.tensor([t], device=DEV), got.kda, stage[0], got.conv, stage[1])
            assert (got.kda - want.kda).abs().max().item() < 1e-5
            assert (got.conv - want.conv).abs().max().item() < 1e-5
        assert (h - model.step(ids[20:25], state.clone(), pos[20:25])).abs().max().item() < 1e-5
        assert set(kept) == {1, 2} and kept[1].shape == h.shape


@pytest.mark.parametrize("kernels", [False, True], ids=["references", "triton"])
def test_mtp_step_equals_the_models(kernels):
    """The MTP drafter's layer through the fused kernels: the same output and the same latent cache rows."""
    torch.manual_seed(3)
    m = LingForCausalLM(small_config(num_hidden_layers=2, num_nextn_predict_layers=1))
    m.init_weights()
    randomize(m, 3)
    m.eval().to(DEV)
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(4)).to(DEV)
    with torch.inference_mode():
        state = m.new_state(32)
        h = m.step(ids[:10], state, torch.arange(10, device=DEV))
        want_state, got_state = state.clone(), state.clone()
        fused = FusedStep(m, kernels=kernels)
        for rows in (slice(0, 1), slice(0, 9)):  # a draft step and the rows after a verify
            pos = torch.arange(rows.start, rows.stop, device=DEV)
            want = m.mtp_step(h[rows], ids[1:10][rows], want_state, pos)
            got = fused.mtp_step(h[rows], ids[1:10][rows], got_state, pos)
            assert (got - want).abs().max().item() < 1e-5
        # the heads with their norms in one launch: the target's and the MTP layer's
        assert (fused.head(h) - m.head(h)).abs().max().item() < 1e-5
        assert (fused.mtp_head(got) - m.mtp_head(want)).abs().max().item() < 1e-5
        # the MTP layer's output with its final norm from the same launch: the head's input, bit for bit
        x, normed = fused.mtp_step(h[rows], ids[1:10][rows], state.clone(), pos, normed=True)
        assert torch.equal(x, got) and torch.equal(fused.mtp_head(x, normed=normed), fused.mtp_head(got))
        # after a verify: every row's cache row, the output of one row (any of them) computed alone
        pos = torch.arange(0, 9, device=DEV)
        for n in (0, 4, 8):
            one_state = state.clone()
            one = fused.mtp_step(h[:9], ids[1:10], one_state, pos, only=torch.tensor([n], device=DEV))
            assert one.shape == (1, h.shape[1]) and (one[0] - want[n]).abs().max().item() < 1e-5
            assert (one_state.latent - want_state.latent).abs().max().item() < 1e-5
            x, normed = fused.mtp_step(h[:9], ids[1:10], state.clone(), pos, only=torch.tensor([n], device=DEV),
                                       normed=True)
            assert torch.equal(x, one) and torch.equal(fused.mtp_head(x, normed=normed), fused.mtp_head(one))
    assert (got_state.latent - want_state.latent).abs().max().item() < 1e-5
