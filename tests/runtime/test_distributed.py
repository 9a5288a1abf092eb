"""Tensor parallelism with two CPU ranks (gloo): the ranks agree on every token and equal the whole model."""

import json
import os

import pytest
import torch

from lingls.engine.local import EMBEDDED, write_tiny_checkpoint
from lingls.engine.protocol import EngineError, GenerateRequest
from lingls.engine.tokenizer import Tokenizer
from lingls.model import load_model
from lingls.serve.tensor_parallel import SAFE_ENV, TensorParallelEngine

from .conftest import reference_greedy


async def test_two_ranks_generate_what_the_whole_model_generates(tiny_dir, tiny_model):
    engine = TensorParallelEngine(str(tiny_dir), tp=2, device="cpu")
    try:
        for prompt in ("def square(x):\n", "def square(x):\n    return"):  # the second reuses the first's prefix
            ids = engine.tokenizer.encode(prompt)
            chunks = [c async for c in engine.stream(GenerateRequest(prompt, max_tokens=10, heal=False))]
            want = reference_greedy(tiny_model, ids, 10)
            cut = next((i for i, t in enumerate(want) if t in engine.tokenizer.eos_ids), len(want))
            assert "".join(c.text for c in chunks) == engine.tokenizer.decode(want[:cut])
        sampled = [c async for c in engine.stream(GenerateRequest("x = ", max_tokens=8, temperature=0.9, seed=1))]
        assert sampled[-1].finish in ("length", "stop")
        assert all(os.environ[k] == v for k, v in SAFE_ENV.items())
    finally:
        await engine.close()


async def test_two_ranks_draft_and_verify_in_step(tiny_dir, tiny_model):
    """Speculative decoding under --tp: every rank drafts (prompt lookup) and verifies the same tokens, and greedy
    output is still exactly the whole model's."""
    engine = TensorParallelEngine(str(tiny_dir), tp=2, device="cpu", draft="lookup", draft_k=3)
    try:
        prompt = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\n"  # repeats, so lookup finds drafts
        ids = engine.tokenizer.encode(prompt)
        chunks = [c async for c in engine.stream(GenerateRequest(prompt, max_tokens=12, heal=False))]
        want = reference_greedy(tiny_model, ids, 12)
        cut = next((i for i, t in enumerate(want) if t in engine.tokenizer.eos_ids), len(want))
        assert "".join(c.text for c in chunks) == engine.tokenizer.decode(want[:cut])
        assert engine.runner.spec is not None and engine.runner.spec.stats.rounds > 0
    finally:
        await engine.close()


async def test_two_ranks_draft_with_a_reduced_head(tmp_path):
    """--draft mtp --draft-vocab under --tp 2 (a tiny model with an MTP layer; ling-nano's 5 heads do not split in
    two): each rank copies its shard's rows of the list (rank 1's shard holds none of these ids: it answers with a
    padding row), the choice crosses the ranks through the all-reduce, and greedy output is still the whole
    model's."""
    prompt = "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    model_dir = write_tiny_checkpoint(tmp_path / "tiny-mtp", mtp=True)
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps(sorted({i for i in Tokenizer(EMBEDDED).encode(prompt * 2) if i < 4096})))
    engine = TensorParallelEngine(str(model_dir), tp=2, device="cpu", draft="mtp", draft_k=3, draft_vocab=str(vocab))
    try:
        ids = engine.tokenizer.encode(prompt)
        chunks = [c async for c in engine.stream(GenerateRequest(prompt, max_tokens=12, heal=False))]
        want = reference_greedy(load_model(model_dir, dtype=torch.float32), ids, 12)
        cut = next((i for i, t in enumerate(want) if t in engine.tokenizer.eos_ids), len(want))
        assert "".join(c.text for c in chunks) == engine.tokenizer.decode(want[:cut])
        assert engine.runner.spec.stats.rounds > 0 and engine.runner.spec.drafter.vocab is not None
    finally:
        await engine.close()


def test_more_ranks_than_gpus_is_a_clear_error(tiny_dir):
    if torch.cuda.is_available() and torch.cuda.device_count() >= 64:
        pytest.skip("this machine has 64 GPUs")
    with pytest.raises(EngineError, match="--tp 64 needs 64 CUDA GPUs"):
        TensorParallelEngine(str(tiny_dir), tp=64)
