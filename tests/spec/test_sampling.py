"""Speculative sampling draws from the target's distribution (the standard rejection rule), checked with a
chi-square test on a small vocabulary, fixed seeds and enough samples that a wrong rule would fail by far."""

from __future__ import annotations

import pytest
import torch

from lingls.runtime.runner import ModelRunner, Sampling
from lingls.runtime.spec.round import Drafter, Speculator, rejection_sample, target_probs

V, K = 8, 3


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts against expected probabilities (cells with tiny expectation pooled)."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("drafts_from_q", [True, False])
def test_rejection_rule_reproduces_the_target_distribution(drafts_from_q):
    """Many independent rounds (distinct positions key the random stream) over fixed target rows p_0..p_K:
    the first output token must follow p_0 and, when draft 0 was accepted, the second must follow p_1."""
    g = torch.Generator().manual_seed(0)
    trials = 40000
    logits = torch.randn(K + 1, V, generator=g) * 1.5
    temperature, top_p, seed = torch.tensor([0.9]), torch.tensor([0.9]), torch.tensor([1234])
    if drafts_from_q:  # a drafter with its own (wrong) distribution, drafts sampled from it
        q = torch.softmax(torch.randn(K, V, generator=g), -1)
        drafts = torch.multinomial(q.repeat(trials, 1), 1, generator=g).view(trials, K)
        q_arg = q.expand(trials, K, V)
    else:  # a deterministic drafter (lookup, greedy MTP): q is one-hot
        drafts = torch.randint(0, V, (trials, K), generator=g)
        q_arg = None
    positions = torch.arange(trials)[:, None] * (K + 2) + torch.arange(K + 1)
    n, tokens = rejection_sample(logits.expand(trials, K + 1, V), drafts, q_arg, positions, temperature, top_p, seed)
    p = target_probs(logits, temperature, top_p)
    first = torch.bincount(tokens[:, 0], minlength=V)
    assert chi_square_p(first, p[0]) > 1e-3
    second = torch.bincount(tokens[n >= 1, 1], minlength=V)
    assert chi_square_p(second, p[1]) > 1e-3
    assert 0 < (n > 0).float().mean() < 1  # both outcomes exercised
    # and a wrong rule (always accepting) is caught by the same test
    assert chi_square_p(torch.bincount(drafts[:, 0], minlength=V), p[0]) < 1e-6


class RandomQDrafter(Drafter):
    """Drafts sampled from a fixed random distribution per draft index, independently of everything else."""

    def __init__(self, k: int, vocab: int, seed: int):
        super().__init__(k)
        self.g = torch.Generator().manual_seed(seed)
        self.qs = torch.softmax(torch.randn(k, vocab, generator=self.g), -1)

    def propose(self, cur, pos, kv_len, greedy=True):
        return torch.multinomial(self.qs, 1, generator=self.g).view(-1), self.qs


def test_speculative_generation_samples_the_target_distribution():
    """End to end on a random small-vocabulary model: the distribution of the first two generated tokens over
    many seeds equals the target's (computed exactly from its logits)."""
    from .conftest import random_model

    v = 4
    model = random_model(v, seed=3, std=0.25)
    prompt = [1, 2, 3]
    sampling = dict(temperature=1.0, top_p=1.0)
    with torch.no_grad():
        p1 = torch.softmax(model.logits(torch.tensor(prompt))[-1], -1)
        p2 = torch.stack([torch.softmax(model.logits(torch.tensor(prompt + [t]))[-1], -1) for t in range(v)])
    joint = (p1[:, None] * p2).flatten()
    runner = ModelRunner(model, capacity=64)
    Speculator(runner, RandomQDrafter(2, v, seed=0))
    samples = 500
    counts = torch.zeros(v * v, dtype=torch.long)
    for s in range(samples):
        a, b = runner.generate(prompt, 2, Sampling(seed=s, **sampling))
        counts[a * v + b] += 1
    assert chi_square_p(counts, joint) > 1e-3
