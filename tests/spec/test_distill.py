"""training/draft at a tiny size on CPU: the losses are sound, a few steps lower the held-out KL, and the result
(a DSpark-layout checkpoint) loads as a drafter that the runtime can use (exactly, as every drafter)."""

from __future__ import annotations

import torch

from lingls.model.dspark import DSparkConfig, DSparkDrafter, load_dspark, save_dspark
from lingls.runtime.runner import ModelRunner
from lingls.runtime.spec.round import attach
from training.draft.distill import DistillSettings, losses, train

from .conftest import plain, random_model


def test_losses_at_a_perfect_drafter():
    t = torch.randn(2, 3, 4, 10)
    loss, m = losses(t, t.clone(), accept_weight=1.0)
    assert (abs(float(m["kl"])) < 1e-5 and abs(float(m["expected_accepted"]) - 4) < 1e-4
            and float(m["greedy_accepted"]) == 4)
    assert abs(float(loss) + 1.0) < 1e-4


def test_a_few_steps_of_distillation_help_and_the_result_runs(tmp_path):
    torch.manual_seed(0)
    target = random_model(64, seed=5, std=0.3)
    g = torch.Generator().manual_seed(0)
    # a stream with structure the target can be distilled on: repeated short phrases
    phrases = torch.randint(0, 64, (12, 6), generator=g)
    stream = phrases[torch.randint(0, 12, (600,), generator=g)].flatten()
    windows = stream[: 3200].view(-1, 64)
    held = stream[3200: 3584].view(-1, 64)
    cfg = DSparkConfig.for_target(target.config, block_size=3, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, intermediate_size=64, markov_rank=8,
                                  confidence_head=False)
    drafter = DSparkDrafter(cfg)
    drafter.init_weights(generator=torch.Generator().manual_seed(1))
    settings = DistillSettings(seq_len=64, batch_size=2, anchors=4, lr=5e-3, warmup_steps=2, seconds=120,
                               max_steps=15, eval_every=15)
    log = train(target, drafter, windows, held, settings, log=lambda _: None)
    assert log[-1]["heldout_kl"] < log[0]["heldout_kl"]
    out = save_dspark(drafter, tmp_path / "draft", dtype=torch.float32)
    loaded = load_dspark(out, target.config)
    assert loaded.config == cfg
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    runner = ModelRunner(target, capacity=128)
    spec = attach(runner, f"lookup+{out}", k=3)
    prompt = windows[0, :20].tolist()
    assert list(runner.generate(prompt, 16)) == plain(target, prompt, 16)
    assert spec.stats.rounds > 0
