"""The model's tokenizer (HF `tokenizer.json` through `tokenizers`) and incremental detokenisation.

A byte-level BPE token can hold part of a UTF-8 character, so decoding tokens one by one would emit
U+FFFD halves. `Detokenizer` decodes a short window of recent tokens and holds text back until the
window decodes to whole characters.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from lingls.engine.healing import Candidates, heal
from lingls.engine.protocol import EngineError, FimTemplate

_REPLACEMENT = "\ufffd"
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # in a Python str every surrogate is a lone one
# Where a byte-level BPE with a GPT-2, cl100k or o200k style split (ling-nano's, Ling-3.0's) starts a pre-token
# whatever comes later, and the text before it splits alike with or without what follows: between a non-blank and a
# non-blank with one newline between them, after the newline; before the last space of a blank run that a non-blank
# follows, unless an added token begins there (added tokens are split off first, so the blanks before one are a
# piece of their own). BPE never merges across a pre-token's edge, so a text's ids are those of its pieces.
_PIECE_START = r"(?<=\S\n)(?=\S)|(?<=[ \t\n\r\f\v])(?= [^\s{added_firsts}])"
PIECE_CHARS = 256  # a prompt is encoded in pieces of at least this many characters (cut at the next start)
# text on which a tokenizer must give equal ids whole and cut at every such place, or prompts are encoded whole
_CUT_CHECK = ('import os\n\n\nclass A(B):\n    """Doc  string."""\n\n    def f(self, x=1):\n\t\treturn x  # é 你好 🎉\n'
              '  \n    y = [1, 2,\n         3]\r\n   123 + .5\n{prefix}def g():\n    pass{suffix}\n  z = "a  b"\n'
              '\nx = 1\n\n\n\nif x:\r\n    y\n \nz\t\n  w\n{middle}\n  {file_sep}x.py\n')

# tokenizer_config.json key -> FimTemplate field; the defaults are looked up in the vocab when the key is absent
_FIM_KEYS = {
    "prefix": ("fim_prefix_token", "<|fim_prefix|>"),
    "suffix": ("fim_suffix_token", "<|fim_suffix|>"),
    "middle": ("fim_middle_token", "<|fim_middle|>"),
    "file_sep": ("file_sep_token", "<|file_sep|>"),
}


class Tokenizer:
    """Text <-> token ids for one model directory, plus what the model's special tokens are."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise EngineError(f"{model_dir}: no tokenizer.json (a model directory needs config.json, "
                              "*.safetensors and tokenizer.json)")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise EngineError(f"{path}: not a readable tokenizer.json ({e})") from None
        config = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise EngineError(f"{cfg_path}: not valid JSON ({e})") from None
        self.vocab_size = self._tok.get_vocab_size()
        self.fim = self._fim_template(config)
        eos = _token_text(config.get("eos_token")) or "<|endoftext|>"
        self.eos_ids = {i for i in (self._tok.token_to_id(eos),) if i is not None}
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            try:
                ids = json.loads(gen_path.read_text()).get("eos_token_id")
            except json.JSONDecodeError:
                ids = None
            self.eos_ids |= set(ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else [])
        self.special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.completion_prompt = config.get("completion_prompt", "psm")  # how the model's card says to prompt it
        self._candidates: Candidates | None = None
        added_firsts = {t.content[0] for t in self._tok.get_added_tokens_decoder().values() if t.content}
        self._piece_start = re.compile(_PIECE_START.format(added_firsts=re.escape("".join(sorted(added_firsts)))))
        self._cuts_exact: bool | None = None  # whether pieces cut there encode as the whole (checked once)
        self._last = _Pieces("", [0], [0], [])  # the last prompt encode_prompt saw, in pieces

    def heal(self, ids: list[int]) -> tuple[list[int], str]:
        """Token healing (lingls.engine.healing): (prompt without the cursor's token, its text)."""
        fim_prefix = self._tok.token_to_id(self.fim.prefix) if self.fim else None
        return heal(ids, self.candidates().texts, self.special_ids | self.eos_ids, fim_prefix)

    def candidates(self) -> Candidates:
        """The healing masks over this vocabulary (token texts decoded once, on first use)."""
        if self._candidates is None:
            texts = [self._tok.decode([i], skip_special_tokens=False) for i in range(self.vocab_size)]
            self._candidates = Candidates(texts, self.special_ids | self.eos_ids)
        return self._candidates

    def _fim_template(self, config: dict) -> FimTemplate | None:
        texts = {}
        for field, (key, default) in _FIM_KEYS.items():
            text = _token_text(config.get(key)) or default
            texts[field] = text if self._tok.token_to_id(text) is not None else None
        if not all(texts[f] for f in ("prefix", "suffix", "middle")):
            return None
        eos = _token_text(config.get("eos_token")) or "<|endoftext|>"
        return FimTemplate(texts["prefix"], texts["suffix"], texts["middle"], texts["file_sep"], (eos,))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in it (FIM markers) become their single ids.

        A lone surrogate (a JSON string may carry one: `"\\ud800"` is a valid escape) is read as U+FFFD, the
        character a UTF-8 decoder would show for it: `tokenizers` refuses the whole text otherwise."""
        if not text.isascii():
            text = _LONE_SURROGATE.sub(_REPLACEMENT, text)
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """`encode(text)`, encoding again only the pieces from the first one that differs from the last prompt's.

        Each keystroke's prompt repeats most of the previous one, and encoding 1,536 tokens takes milliseconds
        on a CPU: more than the prefill of a one-character edit on a GPU. The prompt is kept cut into pieces of
        about PIECE_CHARS characters at places where the tokenizer starts a pre-token whatever follows; a piece
        whose text (and the character after it) is unchanged keeps its ids. Tokenizers that do not split so
        (checked once on a sample) encode every prompt whole. Not thread-safe: one caller (the runner's thread)."""
        if not text.isascii():
            text = _LONE_SURROGATE.sub(_REPLACEMENT, text)
        if self._cuts_exact is None:
            self._cuts_exact = self._check_cuts()
        if not self._cuts_exact:
            return self.encode(text)
        last = self._last
        kept = 0  # pieces of the last prompt that stay: their text and the two characters after their end unchanged
        while kept + 1 < len(last.starts) and text.startswith(
                last.text[last.starts[kept]:last.starts[kept + 1] + 2], last.starts[kept]):
            kept += 1
        starts, ends, ids = last.starts[:kept + 1], last.ends[:kept + 1], last.ids[:last.ends[kept]]
        at, cuts = starts[-1], []
        while at < len(text):
            cut = self._piece_start.search(text, at + PIECE_CHARS)
            at = cut.start() if cut else len(text)
            cuts.append(at)
        # the new pieces at once: the tokenizer encodes a batch on all cores (a cold 8k-token prompt on the 2-core
        # VM: 10.3 ms against 12.4 one piece after another; more on a GPU host's cores), the same ids either way
        bounds = [starts[-1], *cuts]
        for end, piece in zip(cuts, self._tok.encode_batch([text[a:b] for a, b in zip(bounds, cuts)],
                                                            add_special_tokens=False)):
            ids += piece.ids
            starts.append(end)
            ends.append(len(ids))
        starts.pop()  # the text's end is no cut: a longer next prompt may merge across it
        ends.pop()
        self._last = _Pieces(text, starts, ends, ids)
        return list(ids)

    def _check_cuts(self) -> bool:
        specials = self.fim or FimTemplate("", "", "", "", ())
        sample = _CUT_CHECK.format(prefix=specials.prefix, suffix=specials.suffix, middle=specials.middle,
                                   file_sep=specials.file_sep or "")
        whole = self.encode(sample)
        return all(self.encode(sample[:m.start()]) + self.encode(sample[m.start():]) == whole
                   for m in self._piece_start.finditer(sample))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def fim_prompt(self, prefix: str, suffix: str) -> str:
        """The prefix-suffix-middle prompt for filling in between `prefix` and `suffix`."""
        if self.fim is None:
            raise EngineError("this model has no fill-in-the-middle tokens; send a prompt without a suffix")
        return f"{self.fim.prefix}{prefix}{self.fim.suffix}{suffix}{self.fim.middle}"

    def detokenizer(self) -> "Detokenizer":
        return Detokenizer(self)


@dataclass
class _Pieces:
    """A prompt cut where its tokenizer starts pre-tokens: piece k is text[starts[k]:starts[k + 1]] (the last one
    runs to the text's end) and its ids are ids[ends[k]:ends[k + 1]]."""

    text: str
    starts: list[int]
    ends: list[int]
    ids: list[int]


def _token_text(value) -> str | None:
    """tokenizer_config.json spells a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class Detokenizer:
    """Turns a stream of token ids into a stream of text that never splits a character.

    `push(id)` returns the text that became certain with this token (possibly ""); `flush()` returns what is
    left at the end (a dangling partial character comes out as U+FFFD, as a full decode would show it).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._pending: list[int] = []  # tokens since the last clean character boundary

    def push(self, token_id: int) -> str:
        self._pending.append(token_id)
        text = self._tok.decode(self._pending)
        if text.endswith(_REPLACEMENT):
            return ""  # an incomplete character at the end: wait for the next token
        self._pending.clear()
        return text

    def flush(self) -> str:
        text = self._tok.decode(self._pending)
        self._pending.clear()
        return text
