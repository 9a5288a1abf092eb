"""Greedy speculative decoding is plain greedy decoding, token for token, with every drafter."""

from __future__ import annotations

import pytest

from lingls.engine.local import EMBEDDED
from lingls.engine.tokenizer import Tokenizer
from lingls.runtime.runner import ModelRunner, Sampling
from lingls.runtime.spec.round import Speculator, attach

from ..runtime.test_runner import no_host_reads
from .conftest import ScriptedDrafter, plain

CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
'''
N = 40


@pytest.fixture(scope="module")
def code_prompt():
    return Tokenizer(EMBEDDED).encode(CODE)


def _models(request, nano, tiny, code_prompt):
    return {"nano": (nano, code_prompt), "tiny": (tiny, [5, 6, 7, 8, 5, 6, 7, 900, 901, 5, 6, 7])}


@pytest.mark.parametrize("which", ["nano", "tiny"])
@pytest.mark.parametrize("draft", ["lookup", "mtp", "lookup+mtp", "block", "lookup+block"])
def test_greedy_speculation_equals_plain_greedy(which, draft, nano, tiny, code_prompt, block_dirs):
    model, prompt = _models(None, nano, tiny, code_prompt)[which]
    longer = plain(model, prompt, N + 12)  # rounds in flight when max_new is reached run on: up to 2(K+1)
    runner = ModelRunner(model, capacity=512, prefill_chunk=64)
    spec = attach(runner, draft.replace("block", str(block_dirs[which])), k=4)
    assert list(runner.generate(prompt, N)) == longer[:N]
    consumed = runner.cache.tokens  # exactly what the state consumed: the prompt and a greedy continuation
    assert len(prompt) + N - 1 <= len(consumed) and consumed == (prompt + longer)[: len(consumed)]
    assert spec.stats.rounds > 0


@pytest.mark.parametrize("which", ["nano", "tiny"])
@pytest.mark.parametrize("miss", [False, True])
def test_rounds_that_accept_everything_or_nothing(which, miss, nano, tiny, code_prompt):
    model, prompt = _models(None, nano, tiny, code_prompt)[which]
    want = plain(model, prompt, N + 8)
    runner = ModelRunner(model, capacity=512, prefill_chunk=64)
    k = 5
    # position len(prompt) holds want[0]; the script is the continuation from there
    spec = Speculator(runner, ScriptedDrafter(k, want, len(prompt), miss, model.config.vocab_size))
    assert list(runner.generate(prompt, N)) == want[:N]
    s = spec.stats
    assert s.accepted == (0 if miss else s.rounds * k)
    assert s.accept_length == (1.0 if miss else k + 1)


def test_the_loop_reads_nothing_from_the_device(tiny):
    runner = ModelRunner(tiny, capacity=256, prefill_chunk=16)
    attach(runner, "lookup+mtp", k=3)
    for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=3)):
        runner.prefill([3, 4, 5, 3, 4, 5, 3, 4], sampling)
        with no_host_reads():
            got = list(runner.decode(20, sampling.greedy))
        assert len(got) == 20


def test_prefix_reuse_and_early_close_keep_the_state_exact(tiny):
    """Close a speculative stream early, then continue from a prompt sharing its prefix: the state the next
    request reuses must hold exactly the tokens the cache believes it holds."""
    prompt = [11, 12, 13, 14, 11, 12, 13, 15, 11, 12]
    runner = ModelRunner(tiny, capacity=256, prefill_chunk=4)
    attach(runner, "lookup+mtp", k=4)
    stream = runner.generate(prompt, 30)
    first = [next(stream) for _ in range(7)]
    stream.close()
    assert runner.cache.tokens[: len(prompt) + 6] == prompt + first[:6]
    follow = prompt + first[:5] + [77, 78]
    assert list(runner.generate(follow, 25)) == plain(tiny, follow, 25)
    assert runner.cache.stats.hits >= 1


def test_sampled_speculation_is_reproducible(tiny):
    s = Sampling(temperature=0.7, top_p=0.95, seed=11)
    prompt = [40, 41, 42, 40, 41, 42, 40]
    outs = []
    for _ in range(2):
        runner = ModelRunner(tiny, capacity=256)
        attach(runner, "lookup+mtp", k=3)
        outs.append(list(runner.generate(prompt, 24, s)))
    assert outs[0] == outs[1] and len(outs[0]) == 24
