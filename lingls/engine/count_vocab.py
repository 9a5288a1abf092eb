"""`lingls draft-vocab`: a --draft-vocab file (`lingls.runtime.spec.draft_vocab`), the most frequent token ids of
source files by the model's own tokenizer."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from lingls.engine.local import default_model_dir
from lingls.engine.protocol import EngineError
from lingls.engine.tokenizer import Tokenizer


def count_ids(tokenizer, paths: list[Path], size: int) -> list[int]:
    """The `size` most frequent token ids over the files (ties: the lower id), the tokenizer's special tokens
    always in (a drafter should be able to propose the end of a completion)."""
    counts: Counter[int] = Counter()
    for path in paths:
        counts.update(tokenizer.encode(path.read_text(errors="replace")))
    ranked = sorted(counts, key=lambda i: (-counts[i], i))
    special = set(tokenizer.special_ids) | set(tokenizer.eos_ids)
    ids = sorted(special) + [i for i in ranked if i not in special]
    return ids[:max(size, len(special))]


def _is_text(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" not in f.read(8192)


def _source_files(roots: list[str]) -> list[Path]:
    """The text files under the roots: hidden and cache folders and binary files (a NUL byte early) left out."""
    files = []
    for root in map(Path, roots):
        if root.is_file():
            found = [root]
        else:
            found = sorted(p for p in root.rglob("*") if p.is_file() and not any(
                part.startswith(".") or part == "__pycache__" for part in p.relative_to(root).parts))
        files += [p for p in found if _is_text(p)]
    return files


def main(args: argparse.Namespace) -> int:
    """`lingls draft-vocab SOURCES --out FILE [--size N] [--model DIR]`."""
    try:
        tokenizer = Tokenizer(args.model or default_model_dir())
    except EngineError as e:
        print(f"lingls draft-vocab: {e}", file=sys.stderr)
        return 2
    files = _source_files(args.sources)
    if not files or args.size < 1:
        print("lingls draft-vocab: no files under the sources given" if not files else "--size must be >= 1",
              file=sys.stderr)
        return 2
    ids = count_ids(tokenizer, files, args.size)
    Path(args.out).write_text(json.dumps({"ids": ids, "files": len(files), "vocab_size": tokenizer.vocab_size}))
    print(f"{args.out}: {len(ids)} of {tokenizer.vocab_size} ids from {len(files)} files")
    return 0
