"""A random tiny checkpoint with the embedded tokenizer, written once per test session."""

from __future__ import annotations

import pytest
import torch

from lingls.engine.local import write_tiny_checkpoint
from lingls.model import load_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    return load_model(tiny_dir, dtype=torch.float32)


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The model core's own generation: a full-sequence forward per token, argmax, no state."""
    ids = list(prompt)
    device = model.lm_head.weight.device
    for _ in range(n):
        ids.append(int(model.logits(torch.tensor(ids, device=device))[-1].argmax()))
    return ids[len(prompt):]
