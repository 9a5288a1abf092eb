"""Forced (simulated) acceptance, `Speculator.force_accept`: what bench/spec_flash_gpu.py times at random weights.

A drafter that drafts the plain greedy continuation right for its first j drafts and wrong after them has a true
acceptance of exactly j every round, so forcing j must change nothing; forcing another count must still give
rounds of exactly that many drafts, with a state that consumed exactly the tokens the rounds emitted."""

from __future__ import annotations

import pytest
import torch

from lingls.runtime.runner import ModelRunner
from lingls.runtime.spec.round import Speculator

from .conftest import ScriptedDrafter, plain

PROMPT = [5, 6, 7, 8, 5, 6, 7, 900, 901, 5, 6, 7]
K, N = 4, 24


class PartlyRight(ScriptedDrafter):
    """The greedy continuation for the first `right` drafts of every round, each later draft shifted by one id."""

    def __init__(self, right: int, script: list[int], start: int, vocab: int):
        super().__init__(K, script, start, False, vocab)
        self.wrong = (torch.arange(K) >= right).long()
        self.vocab = vocab

    def propose(self, cur, pos, kv_len, greedy=True):
        drafts, _ = super().propose(cur, pos, kv_len, greedy)
        return (drafts + self.wrong) % self.vocab, None


def run(model, want, right: int, forced: int | None):
    runner = ModelRunner(model, capacity=256, prefill_chunk=16)
    spec = Speculator(runner, PartlyRight(right, want, len(PROMPT), model.config.vocab_size))
    if forced is not None:
        spec.force_accept = torch.tensor([forced])
    return runner, spec, list(runner.generate(PROMPT, N))


@pytest.fixture(scope="module")
def want(tiny):
    return plain(tiny, PROMPT, N + 2 * (K + 1))


@pytest.mark.parametrize("right", [0, 2, K])
def test_forcing_the_true_acceptance_changes_nothing(tiny, want, right):
    _, free, got_free = run(tiny, want, right, None)
    _, forced, got = run(tiny, want, right, right)
    assert got == got_free == want[:N]
    assert forced.stats.accepted == right * forced.stats.rounds == free.stats.accepted


@pytest.mark.parametrize("forced", [1, 3, K + 5])
def test_forced_rounds_accept_that_many_and_keep_the_state_exact(tiny, want, forced):
    runner, spec, got = run(tiny, want, 0, forced)  # no draft is right: every accepted one is forced
    n = min(forced, K)
    assert len(got) == N and spec.stats.accepted == n * spec.stats.rounds and spec.stats.accept_length == n + 1
    consumed = runner.cache.tokens
    common = min(len(consumed) - len(PROMPT), N)  # rounds still in flight at max_new ran on, unemitted
    assert consumed[:len(PROMPT)] == PROMPT and consumed[len(PROMPT):][:common] == got[:common]
    fresh = tiny.new_state(256)
    with torch.inference_mode():
        tiny.step(torch.tensor(consumed), fresh, torch.arange(len(consumed)))
    torch.testing.assert_close(runner.state.kda, fresh.kda, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(runner.state.conv, fresh.conv, rtol=1e-4, atol=1e-5)
