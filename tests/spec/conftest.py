"""Models and drafters for the speculative-decoding tests: the embedded ling-nano, a random tiny model with an
MTP layer (vocab of the real tokenizer) and a random small-vocabulary model for the statistical test."""

from __future__ import annotations

import pytest
import torch

from lingls.engine.local import EMBEDDED, tiny_config_dict
from lingls.model import LingConfig, LingForCausalLM, load_model
from lingls.model.dspark import DSparkConfig
from lingls.model.random_checkpoint import SMALL_DSPARK, write_random_dspark
from lingls.runtime.runner import ModelRunner, Sampling
from lingls.runtime.spec.round import Drafter


def random_model(vocab: int, seed: int = 0, std: float = 0.5) -> LingForCausalLM:
    cfg = LingConfig.from_dict({**tiny_config_dict(vocab), "num_nextn_predict_layers": 1})
    model = LingForCausalLM(cfg)
    model.init_weights(std=std, generator=torch.Generator().manual_seed(seed))
    return model.eval()


@pytest.fixture(scope="session")
def nano():
    return load_model(EMBEDDED, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny():
    return random_model(8192, seed=1)


def dspark_dir(target, out, block_size: int = 8, std: float = 0.2, **kw):
    """A random DSpark checkpoint (published layout, small widths) for `target`: its drafts are noise, which is
    what the exactness tests need."""
    cfg = DSparkConfig.for_target(target.config, block_size=block_size, **{**SMALL_DSPARK, **kw})
    return write_random_dspark(cfg, out, dtype=torch.float32, std=std)


@pytest.fixture(scope="session")
def block_dirs(tmp_path_factory, nano, tiny):
    root = tmp_path_factory.mktemp("drafters")
    return {"nano": dspark_dir(nano, root / "nano"), "tiny": dspark_dir(tiny, root / "tiny")}


def plain(model, prompt, n, sampling=Sampling(), capacity=512) -> list[int]:
    return list(ModelRunner(model, capacity=capacity, prefill_chunk=64).generate(prompt, n, sampling))


class ScriptedDrafter(Drafter):
    """Drafts from a script indexed by position (on the device): the plain greedy continuation itself (every
    draft accepted) or that continuation shifted by one token id (none accepted)."""

    name = "scripted"

    def __init__(self, k: int, script: list[int], start: int, miss: bool, vocab: int, device="cpu"):
        super().__init__(k)
        table = torch.zeros(start + len(script) + k + 2, dtype=torch.long)
        table[start:start + len(script)] = torch.tensor(script)
        self.table = ((table + 1) % vocab if miss else table).to(device)
        self.steps = torch.arange(1, k + 1, device=device)

    def propose(self, cur, pos, kv_len, greedy=True):
        return self.table.gather(0, (pos + self.steps).clamp(max=self.table.shape[0] - 1)), None
