"""Prefix reuse: a warm runner gives the tokens a cold one gives, and prefills only what is new."""

import random

import pytest

from lingls.runtime.runner import ModelRunner, Sampling

rng = random.Random(0)
BASE = [rng.randrange(5, 8000) for _ in range(150)]


@pytest.fixture
def warm(tiny_model):
    r = ModelRunner(tiny_model, capacity=512, prefill_chunk=32)
    list(r.generate(BASE, 6))
    return r


def cold(model, prompt, sampling=Sampling()):
    return list(ModelRunner(model, capacity=512, prefill_chunk=32).generate(prompt, 10, sampling))


@pytest.mark.parametrize("edit", ["same", "append", "replace_last", "edit_middle", "truncate", "unrelated"])
def test_reuse_gives_the_tokens_of_a_cold_run(tiny_model, warm, edit):
    prompt = {
        "same": BASE,
        "append": BASE + [42, 43],
        "replace_last": BASE[:-1] + [4242],
        "edit_middle": BASE[:70] + [9] + BASE[71:],
        "truncate": BASE[:100],
        "unrelated": [7, 8, 9] + BASE,
    }[edit]
    assert list(warm.generate(prompt, 10)) == cold(tiny_model, prompt)


def test_sampled_tokens_also_match(tiny_model, warm):
    s = Sampling(temperature=0.8, top_p=0.95, seed=11)
    prompt = BASE[:-1] + [4242]
    assert list(warm.generate(prompt, 10, s)) == cold(tiny_model, prompt, s)


def test_a_one_token_edit_at_the_end_prefills_only_the_tail(warm, monkeypatch):
    ran = []
    step = warm.model.step
    monkeypatch.setattr(warm.model, "step", lambda ids, *a, **k: ran.append(len(ids)) or step(ids, *a, **k))
    reused = warm.prefill(BASE[:-1] + [4242], Sampling())
    assert reused == len(BASE) - 1  # the snapshot taken one token before the old prompt's end
    assert ran == [1]


def test_snapshots_past_a_divergence_are_dropped(warm):
    assert any(p > 70 for p in warm.cache.snapshots)
    warm.prefill(BASE[:70] + [9], Sampling())
    assert all(p <= 71 for p in warm.cache.snapshots)
    assert warm.cache.tokens == BASE[:70] + [9]


def test_typing_one_more_token_prefills_one_token(warm, monkeypatch):
    ran = []
    step = warm.model.step
    monkeypatch.setattr(warm.model, "step", lambda ids, *a, **k: ran.append(len(ids)) or step(ids, *a, **k))
    assert warm.prefill(BASE + [42], Sampling()) == len(BASE)  # the snapshot at the old prompt's end
    assert ran == [1]


def test_after_a_reset_the_next_request_starts_cold(tiny_model, warm):
    """A reset (after a failed step, or the warm-up's prefill) leaves no state behind: the next prompt, sharing
    nothing with the last, gives a cold runner's tokens."""
    warm.cache.reset()
    other = [7] * 40 + BASE[:30]
    assert list(warm.generate(other, 10)) == cold(tiny_model, other)
