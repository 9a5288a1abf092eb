"""A drafter's reduced vocabulary: the MTP head scores only the tokens code actually uses (`--draft-vocab`).

Why: at batch 1 every drafted token reads the whole lm_head, Ling-3.0-flash's largest matrix (157,184 x 2560
bf16: 0.80 GB, 0.40 GB per rank at TP=2, ~94 us on an H200), eight times per round at K=8, about half of the
drafting time. Drafts only have to be plausible, not exact: the target verifies every one of them, so greedy
output stays token for token the target's whatever the drafter's vocabulary (FR-Spec, Zhao et al. 2025: a
frequency-ranked subset of the vocabulary for the draft head). Restricting the head to the N most frequent
ids of a code corpus divides its bytes by V / N; the cost is the drafts a restricted head cannot propose (a
token outside the list ends the accepted run there).

The list is a JSON file of token ids, most frequent first (`{"ids": [...]}` or a bare list); `lingls
draft-vocab` (`lingls.engine.count_vocab`) counts them over source files with the model's own tokenizer. At
load each rank copies the rows of its own vocab shard that the list names (the lm_head is split by vocab across
ranks) and pads the ranks to one row count with repeats of a row it already has, so every rank's head is one
GEMV of the same shape and the greedy choice crosses ranks as `sampling.argmax_shards` does, carrying each
row's token id.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lingls.runtime.sampling import MAX_EXCHANGED_ID


class DraftVocabError(ValueError):
    pass


def read_ids(path: str | Path, vocab_size: int) -> list[int]:
    """The ids of a draft-vocabulary file, checked: distinct, each in [0, vocab_size)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftVocabError(f"--draft-vocab {path}: not a readable JSON file ({e})") from None
    ids = data.get("ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DraftVocabError(f"--draft-vocab {path}: expected a non-empty list of token ids (or {{\"ids\": [...]}})")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise DraftVocabError(f"--draft-vocab {path}: ids outside the model's vocabulary of {vocab_size}: {bad[:5]}")
    if len(set(ids)) != len(ids):
        raise DraftVocabError(f"--draft-vocab {path}: ids repeat")
    return ids


class DraftVocab:
    """This rank's rows of the lm_head for a list of token ids: `weight` [M, hidden] (a copy) and `ids` [M] (the
    token of each row), M the same on every rank."""

    def __init__(self, ids: list[int], lm_head: torch.Tensor, rank: int, size: int):
        shard = lm_head.shape[0]  # this rank holds tokens rank * shard .. (rank + 1) * shard - 1
        if shard * size > MAX_EXCHANGED_ID:
            raise DraftVocabError(f"a vocabulary of {shard * size} ids is too large for the draft head's exchange")
        per_rank = [[i for i in ids if r * shard <= i < (r + 1) * shard] for r in range(size)]
        rows = max(len(p) for p in per_rank)
        mine = per_rank[rank] or [rank * shard]  # a rank the list never names still answers, with a real token
        mine = mine + [mine[0]] * (rows - len(mine))  # a repeated row scores the same token: it never wins alone
        local = torch.tensor(mine, dtype=torch.long) - rank * shard
        self.weight = lm_head.detach().index_select(0, local.to(lm_head.device)).contiguous()
        self.ids = torch.tensor(mine, dtype=torch.long, device=lm_head.device)
        self.size = len(ids)

    @classmethod
    def load(cls, path: str | Path, model) -> "DraftVocab":
        """From a draft-vocabulary file, for `model`'s lm_head shard and tensor-parallel rank."""
        ids = read_ids(path, model.config.vocab_size)
        return cls(ids, model.lm_head.weight, model.par.rank, model.par.size)
