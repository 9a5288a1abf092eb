"""The MTP drafter's reduced vocabulary (--draft-vocab) and the greedy choice across vocab shards."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from lingls.cli import main as cli_main
from lingls.engine.local import EMBEDDED, EngineError, attach_drafter
from lingls.engine.tokenizer import Tokenizer
from lingls.model.ling import Parallel
from lingls.runtime.runner import ModelRunner
from lingls.runtime.sampling import argmax_shards
from lingls.runtime.spec.draft_vocab import DraftVocab, DraftVocabError, read_ids
from lingls.runtime.spec.round import MTPDrafter, attach

from .conftest import plain
from .test_greedy import CODE


def _ranks(size: int) -> list[Parallel]:
    """`size` in-process ranks whose all-reduce sums across threads (each rank calls it from its own thread)."""
    box, barrier = {}, threading.Barrier(size)

    def make(rank):
        def all_reduce(x):
            box[rank] = x.clone()
            barrier.wait()
            total = sum(box[r] for r in range(size))
            barrier.wait()
            return total
        return Parallel(rank, size, all_reduce)
    return [make(r) for r in range(size)]


def _on_ranks(size: int, fn) -> list:
    out = [None] * size
    threads = [threading.Thread(target=lambda r=r, p=p: out.__setitem__(r, fn(r, p)))
               for r, p in enumerate(_ranks(size))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("size", [1, 2, 4])
def test_argmax_shards_is_the_argmax_of_the_gathered_logits(size):
    g = torch.Generator().manual_seed(size)
    logits = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    logits[3, 40] = logits[3, 8] = logits[3].max() + 1  # a tie across shards: the lower id wins
    logits[5] = 0.0  # all equal: token 0
    shard = 64 // size
    got = _on_ranks(size, lambda r, par: argmax_shards(logits[:, r * shard:(r + 1) * shard].contiguous(), par))
    for tokens in got:
        assert tokens.tolist() == logits.float().argmax(-1).tolist()


def test_argmax_shards_with_row_ids_returns_tokens():
    logits = torch.tensor([[0.1, 0.9, 0.3], [0.5, 0.2, 0.1]])
    ids = torch.tensor([70, 3, 12])
    assert argmax_shards(logits, Parallel(), ids).tolist() == [3, 70]


def test_draft_vocab_rows_per_rank():
    lm_head = torch.arange(16 * 3, dtype=torch.float32).view(16, 3)  # row i starts with 3 * i
    ids = [13, 2, 9, 5, 3]  # rank 0 of 2 holds 0..7: {2, 5, 3}; rank 1: {13, 9}, padded to 3 rows
    parts = [DraftVocab(ids, lm_head[r * 8:(r + 1) * 8], r, 2) for r in range(2)]
    assert parts[0].ids.tolist() == [2, 5, 3] and parts[1].ids.tolist() == [13, 9, 13]
    for p in parts:
        assert torch.equal(p.weight, lm_head[p.ids]) and p.size == 5
    lonely = DraftVocab([1, 2], lm_head[8:], 1, 2)  # a rank the list never names answers with its first token
    assert lonely.ids.tolist() == [8, 8] and torch.equal(lonely.weight, lm_head[[8, 8]])


def test_reduced_head_across_ranks_picks_the_best_listed_token():
    torch.manual_seed(0)
    lm_head, x = torch.randn(32, 8), torch.randn(1, 8)
    ids = [30, 1, 17, 6, 22, 9]
    want = ids[int((x @ lm_head[ids].t()).argmax())]

    def rank(r, par):
        vocab = DraftVocab(ids, lm_head[r * 8:(r + 1) * 8], r, 4)
        return argmax_shards(x @ vocab.weight.t(), par, vocab.ids)
    assert [t.item() for t in _on_ranks(4, rank)] == [want] * 4


@pytest.mark.parametrize("content, match", [("{", "not a readable JSON"), ("[]", "non-empty list"),
                                            ('{"ids": [1, "a"]}', "non-empty list"), ("[1, 99999]", "outside"),
                                            ("[4, 5, 4]", "repeat")])
def test_bad_vocab_files_are_clear_errors(tmp_path, content, match):
    path = tmp_path / "v.json"
    path.write_text(content)
    with pytest.raises(DraftVocabError, match=match):
        read_ids(path, 8192)


def test_greedy_speculation_with_a_reduced_head_is_plain_greedy(nano, tmp_path):
    """A head that knows only the prompt's tokens drafts badly, never wrongly: the output stays plain greedy."""
    prompt = Tokenizer(EMBEDDED).encode(CODE)
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps({"ids": sorted(set(prompt))}))
    want = plain(nano, prompt, 40)
    runner = ModelRunner(nano, capacity=512, prefill_chunk=64)
    spec = attach(runner, "mtp", k=4, vocab=str(path))
    assert isinstance(spec.drafter, MTPDrafter) and spec.drafter.vocab.size == len(set(prompt))
    assert list(runner.generate(prompt, 40)) == want
    assert spec.stats.rounds > 0 and spec.stats.accepted > 0  # code repeats: the prompt's tokens draft well


def test_draft_vocab_needs_the_mtp_drafter(nano, tmp_path):
    path = tmp_path / "vocab.json"
    path.write_text("[1, 2, 3]")
    runner = ModelRunner(nano, capacity=128)
    with pytest.raises(EngineError, match="needs a drafter"):
        attach_drafter(runner, "none", None, draft_vocab=str(path))
    with pytest.raises(EngineError, match="applies to the MTP drafter"):
        attach_drafter(runner, "lookup", 2, draft_vocab=str(path))
    with pytest.raises(EngineError, match="outside the model's vocabulary"):
        path.write_text("[1, 10000000]")
        attach_drafter(runner, "mtp", 2, draft_vocab=str(path))


def test_draft_vocab_command_counts_code_tokens(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def f(x):\n    return x + x + x\n")
    (src / "blob.bin").write_bytes(b"\x00\x01binary")
    out = tmp_path / "v.json"
    assert cli_main(["draft-vocab", str(src), "--size", "6", "--out", str(out)]) == 0
    ids = json.loads(out.read_text())["ids"]
    tok = Tokenizer(EMBEDDED)
    special = sorted(set(tok.special_ids) | tok.eos_ids)
    assert ids[: len(special)] == special and len(ids) == max(6, len(special))
    assert read_ids(out, tok.vocab_size) == ids
    assert cli_main(["draft-vocab", str(tmp_path / "nothing"), "--out", str(out)]) == 2
