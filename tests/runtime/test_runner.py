"""ModelRunner on CPU: equals the model core's generation, samples reproducibly, never reads the device in its loop."""

import contextlib

import pytest
import torch

from lingls.runtime import runner as runner_mod
from lingls.runtime.runner import ModelRunner, Sampling

from .conftest import reference_greedy

PROMPT = [11, 523, 97, 4000, 12, 7, 300, 301, 302, 9, 1000, 45]


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads():
    """CPU stand-in for torch.cuda.set_sync_debug_mode("error"): any read of a tensor's value on the host raises."""
    names = ["item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def trap(name):
        def f(*a, **k):
            raise HostRead(f"Tensor.{name} inside the decode loop")
        return f

    for n in names:
        setattr(torch.Tensor, n, trap(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.fixture
def runner(tiny_model):
    return ModelRunner(tiny_model, capacity=256, prefill_chunk=8)


def test_greedy_equals_the_model_core_reference(tiny_model, runner):
    want = reference_greedy(tiny_model, PROMPT, 16)
    assert list(runner.generate(PROMPT, 16)) == want


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, top_p=0.9, seed=5)])
def test_decode_loop_reads_nothing_from_the_device(runner, sampling):
    runner.prefill(PROMPT, sampling)
    with no_host_reads():
        got = list(runner.decode(12, sampling.greedy))
    assert len(got) == 12


def test_the_guard_catches_a_host_read(runner, monkeypatch):
    real = runner_mod.argmax_shards  # the greedy choice of every decode step
    monkeypatch.setattr(runner_mod, "argmax_shards", lambda logits, *a: real(logits, *a) + int(logits[0, 0] > 0) * 0)
    runner.prefill(PROMPT, Sampling())
    with no_host_reads(), pytest.raises(HostRead):
        list(runner.decode(4, True))


def test_sampling_is_seeded_and_top_p_zero_is_greedy(runner):
    a = list(runner.generate(PROMPT, 12, Sampling(temperature=1.5, seed=1)))
    b = list(runner.generate(PROMPT, 12, Sampling(temperature=1.5, seed=1)))
    c = list(runner.generate(PROMPT, 12, Sampling(temperature=1.5, seed=2)))
    assert a == b and a != c
    assert list(runner.generate(PROMPT, 12, Sampling(temperature=1.0, top_p=0.0, seed=3))) == \
        list(runner.generate(PROMPT, 12))


def test_closing_early_leaves_the_state_matching_its_tokens(tiny_model, runner):
    steps = runner.generate(PROMPT, 20)
    first = [next(steps) for _ in range(5)]
    steps.close()
    # on a CPU a step runs when its token is asked for: the 5th token was read, not yet fed back
    assert runner.cache.tokens == PROMPT + first[:4]
    # a follow-up prompt that extends what was generated reuses all of it and matches a cold run
    follow = PROMPT + first + [77]
    got = list(runner.generate(follow, 8))
    assert runner.cache.stats.tokens_saved >= len(PROMPT) + 4
    assert got == reference_greedy(tiny_model, follow, 8)


def test_prompt_longer_than_the_context_is_refused(runner):
    with pytest.raises(ValueError, match="does not fit"):
        runner.prefill(list(range(300)), Sampling())


def reference_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Each token's log-probability after the prompt and the tokens before it: one full forward, no state."""
    logits = model.logits(torch.tensor(prompt + tokens))[len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


@pytest.mark.parametrize("lean_cpu", [False, True])
def test_scores_are_each_tokens_log_probability(tiny_model, lean_cpu):
    """With `scores` every decoded token comes with its log-probability under the model (the confidence gate's
    input), read with the token and never inside a step; a keystroke after a snapshot (one new prompt token,
    one step) scores its token the same way."""
    runner = ModelRunner(tiny_model, capacity=256, prefill_chunk=8, lean_cpu=lean_cpu, scores=True)
    got, scores = [], []
    runner.prefill(PROMPT, Sampling())
    with no_host_reads():
        for token in runner.decode(10, True):
            got.append(token)
            scores.append(runner.token_logprob)
    assert got == reference_greedy(tiny_model, PROMPT, 10)
    assert scores == pytest.approx(reference_logprobs(tiny_model, PROMPT, got), abs=1e-4)
    prompt = PROMPT + got[:3] + [5]  # reuses the snapshot at the end of PROMPT + got[:3]
    runner.prefill(PROMPT + got[:3], Sampling())
    runner.prefill(prompt, Sampling())
    steps = runner.decode(4, True)
    first = [(t, runner.token_logprob) for t in steps]
    tokens = [t for t, _ in first]
    assert tokens == reference_greedy(tiny_model, prompt, 4)
    assert [s for _, s in first] == pytest.approx(reference_logprobs(tiny_model, prompt, tokens), abs=1e-4)


def test_a_constrained_first_token_is_scored_among_the_allowed_ones(tiny_model):
    """Token healing restricts the first choice: its score is its probability among the tokens allowed."""
    runner = ModelRunner(tiny_model, capacity=256, prefill_chunk=8, scores=True)
    allowed = torch.zeros(tiny_model.config.vocab_size, dtype=torch.bool)
    allowed[[3, 40, 41, 500]] = True
    runner.prefill(PROMPT, Sampling(), allowed)
    steps = runner.decode(1, True)
    token = next(steps)
    logits = tiny_model.logits(torch.tensor(PROMPT))[-1].float().masked_fill(~allowed, float("-inf"))
    assert token == int(logits.argmax())
    assert runner.token_logprob == pytest.approx(float(logits.log_softmax(-1)[token]), abs=1e-5)


def test_without_scores_the_runner_reports_none(runner):
    steps = runner.generate(PROMPT, 3)
    next(steps)
    assert runner.token_logprob is None
