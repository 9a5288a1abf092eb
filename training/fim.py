"""Training examples: fill-in-the-middle (PSM and SPM) mixed with plain left-to-right text.

An example is a list of pieces, each a special-token id or a text string; the text pieces are encoded
separately (`encode_examples`), exactly as a prompt builder encodes a prefix and a suffix separately, so the
model learns to continue from any split point, even one inside a word.

Formats (ids of the special tokens in training.tokenizer):
  PSM:   <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{middle}<|endoftext|>
  SPM:   <|fim_suffix|>{suffix}<|fim_prefix|>{prefix}<|fim_middle|>{middle}<|endoftext|>
  plain: {text}<|endoftext|>
Any prefix (and plain text) may start with file headers `<|file_sep|>{path}\\n`: the current file's, sometimes
preceded by a chunk of another file under its own header, the way a prompt builder adds context from other
open documents.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from training.tokenizer import EOS, FILE_SEP, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, SPECIAL_TOKENS

Piece = int | str
SPECIAL_ID = {t: i for i, t in enumerate(SPECIAL_TOKENS)}


@dataclass(frozen=True)
class FimMix:
    """The example mix. FIM examples train the plain continuation too (the loss covers every token, prefix and
    suffix included), so most examples are FIM; SPM order dominates because it keeps the prefix next to the
    middle, which a small model with two softmax-attention layers finds far easier than PSM's jump back over the
    suffix (the first ling-nano: PSM exact match 0.003, SPM 0.069 on the same cases)."""

    fim_rate: float = 0.6  # share of examples that are FIM; the rest are plain
    spm_rate: float = 0.7  # share of FIM examples in SPM order
    line_rate: float = 0.6  # share of FIM middles that run from a cursor to a line end (what completion asks for)
    inline_rate: float = 0.3  # share that end inside the cursor's line (an argument list, a line whose end is typed)
    # the rest are random spans, several lines or none whole: unlike what lingls asks for, so few
    context_rate: float = 0.2  # share of examples preceded by a chunk of another file and the file's header
    header_rate: float = 0.1  # share preceded by the file's header alone
    chunk_chars: int = 4000  # files are cut at line boundaries into chunks of at most this many characters
    suffix_lines: tuple[int, int] = (4, 64)  # a FIM suffix keeps whole lines, a random count in this range, as
    suffix_chars: int = 1200  # lingls' prompt does (`lsp.prompt._suffix_window`: <= 64 lines, a fifth of the budget)


def chunk_text(text: str, limit: int) -> list[str]:
    """Cut text at line boundaries into chunks of at most `limit` characters (a longer line is its own chunk)."""
    chunks, cur, size = [], [], 0
    for line in text.splitlines(keepends=True):
        if cur and size + len(line) > limit:
            chunks.append("".join(cur))
            cur, size = [], 0
        cur.append(line)
        size += len(line)
    if cur:
        chunks.append("".join(cur))
    return chunks


def display_path(name: str) -> str:
    """'site/numpy/linalg.py' -> 'numpy/linalg.py': what an editor would show as the file's path."""
    return name.split("/", 1)[1] if "/" in name else name


def line_middle(text: str, rng: random.Random) -> tuple[int, int]:
    """A span from a cursor inside a random line to the end of that line or of one of the next lines."""

    def line_end(i: int) -> int:
        j = text.find("\n", i)
        return len(text) if j < 0 else j

    pos = rng.randint(0, max(0, len(text.rstrip("\n")) - 1))  # a line with text, or a blank one before one
    start = text.rfind("\n", 0, pos) + 1
    end = line_end(start)
    begin = rng.randint(start, max(start, end - 1))  # a cursor before the line's last character: never empty
    if begin == end < len(text) - 1:  # a blank line: its middle is the line after it
        end = line_end(end + 1)
    while end < len(text) - 1 and rng.random() < 0.4:
        end = line_end(end + 1)
    return begin, end


def inline_middle(text: str, rng: random.Random) -> tuple[int, int]:
    """A span inside one line that stops before the line's end: before its closing punctuation (`):`, `)`),
    or at a later random column."""
    pos = rng.randint(0, len(text))
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", start)
    end = len(text) if end < 0 else end
    stop = end
    while stop > start and text[stop - 1] in ")]}:,;'\" ":
        stop -= 1
    if stop == end or rng.random() < 0.5:
        stop = rng.randint(start, end)
    begin = rng.randint(start, max(start, stop - 1))  # at least one character, where the line has one
    return begin, stop


def random_middle(text: str, rng: random.Random) -> tuple[int, int]:
    a, b = sorted((rng.randint(0, len(text)), rng.randint(0, len(text))))
    return a, b


def cut_suffix(suffix: str, rng: random.Random, mix: FimMix) -> str:
    """The suffix a prompt would carry: the rest of the cursor's line and a random number of whole lines after
    it, at most `mix.suffix_chars` (whole lines only, beyond the cursor's own)."""
    lines = suffix.splitlines(keepends=True)
    keep = rng.randint(*mix.suffix_lines)
    out, size = lines[:1], len(lines[0]) if lines else 0
    for line in lines[1:keep]:
        if size + len(line) > mix.suffix_chars:
            break
        out.append(line)
        size += len(line)
    return "".join(out)


def make_example(chunk: str, name: str, rng: random.Random, mix: FimMix, other: tuple[str, str] | None) -> list[Piece]:
    """One training example from one chunk of a file; `other` is (name, chunk) of another file for context."""
    header: list[Piece] = []
    roll = rng.random()
    if other is not None and roll < mix.context_rate:
        header += [SPECIAL_ID[FILE_SEP], f"{display_path(other[0])}\n{other[1]}\n"]
    if roll < mix.context_rate + mix.header_rate:
        header += [SPECIAL_ID[FILE_SEP], f"{display_path(name)}\n"]
    if rng.random() >= mix.fim_rate:
        return header + [chunk, SPECIAL_ID[EOS]]
    roll = rng.random()
    if roll < mix.line_rate:
        a, b = line_middle(chunk, rng)
    elif roll < mix.line_rate + mix.inline_rate:
        a, b = inline_middle(chunk, rng)
    else:
        a, b = random_middle(chunk, rng)
    prefix, middle, suffix = chunk[:a], chunk[a:b], cut_suffix(chunk[b:], rng, mix)
    pre = [SPECIAL_ID[FIM_PREFIX], prefix]
    suf = [SPECIAL_ID[FIM_SUFFIX], suffix]
    body = suf + pre if rng.random() < mix.spm_rate else pre + suf
    return header + body + [SPECIAL_ID[FIM_MIDDLE], middle, SPECIAL_ID[EOS]]


def build_examples(files, seed: int, mix: FimMix = FimMix()) -> list[list[Piece]]:
    """Examples for every chunk of every file, in a shuffled order fixed by `seed`."""
    rng = random.Random(seed)
    chunks = [(f.name, c) for f in files for c in chunk_text(f.text, mix.chunk_chars)]
    examples = []
    for name, chunk in chunks:
        other = chunks[rng.randrange(len(chunks))]
        examples.append(make_example(chunk, name, rng, mix, other if other[0] != name else None))
    rng.shuffle(examples)
    return examples


def encode_examples(tok, examples: list[list[Piece]]) -> list[list[int]]:
    """Token ids of each example; text pieces are encoded in one batch, each on its own."""
    texts = [p for ex in examples for p in ex if isinstance(p, str) and p]
    encoded = iter(tok.encode_batch(texts, add_special_tokens=False))
    out = []
    for ex in examples:
        ids: list[int] = []
        for p in ex:
            if isinstance(p, int):
                ids.append(p)
            elif p:
                ids.extend(next(encoded).ids)
        out.append(ids)
    return out
