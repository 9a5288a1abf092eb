import json
import random
import textwrap
from pathlib import Path

import pytest

from lingls.engine.local import EMBEDDED
from lingls.engine.protocol import EngineError
from lingls.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(EMBEDDED)


def test_fim_tokens_come_from_tokenizer_config(tok):
    assert tok.fim.prefix == "<|fim_prefix|>" and tok.fim.middle == "<|fim_middle|>"
    ids = tok.encode(tok.fim_prompt("a = ", "\n"))
    assert ids[0] == tok.encode("<|fim_prefix|>")[0] and len(tok.encode("<|fim_middle|>")) == 1
    assert tok.encode("<|endoftext|>")[0] in tok.eos_ids  # plus generation_config.json's eos_token_id list
    assert tok.eos_ids <= tok.special_ids


def test_incremental_detokenisation_never_splits_a_character(tok):
    text = 's = "héllo wörld 你好 🎉 ∑"\n    return s\n'
    ids = tok.encode(text)
    d = tok.detokenizer()
    parts = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)
    assert sum(1 for p in parts if p == "") > 0  # some tokens held back half a character


def test_special_tokens_are_not_shown(tok):
    d = tok.detokenizer()
    assert "".join(d.push(i) for i in tok.encode("x<|endoftext|>y")) + d.flush() == "xy"


def test_broken_directories_say_what_is_wrong(tmp_path):
    with pytest.raises(EngineError, match="no tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ nope")
    with pytest.raises(EngineError, match="not a readable tokenizer.json"):
        Tokenizer(tmp_path)


def test_model_without_fim_tokens_has_no_template(tmp_path):
    raw = json.loads((EMBEDDED / "tokenizer.json").read_text())
    raw["added_tokens"] = [t for t in raw["added_tokens"] if "fim" not in t["content"]]
    for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"):
        raw["model"]["vocab"].pop(t, None)
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    tok = Tokenizer(tmp_path)
    assert tok.fim is None
    with pytest.raises(EngineError, match="fill-in-the-middle"):
        tok.fim_prompt("a", "b")


def _edits(seed: int, text: str, n: int):
    """Random keystroke-like edits anywhere in `text` (inserts, deletes, another window of the text), each text."""
    rng = random.Random(seed)
    source = text
    for _ in range(n):
        pos = rng.randrange(len(text) + 1)
        op = rng.random()
        if op < 0.5:
            text = text[:pos] + rng.choice(["x", " ", "\n", "  ", "\t", "é", "(", "'", "\n    ", "1", "\r\n", "\n\n",
                                             "🎉", " <", "<|fim_middle|>", "\n  <|file_sep|>"]) + text[pos:]
        elif op < 0.92:
            text = text[:pos] + text[pos + rng.randrange(1, 5):]
        else:
            start = rng.randrange(len(source))
            text = source[start:start + rng.randrange(50, 6000)]
        yield text


CODE = Path(textwrap.__file__).read_text()


def test_prompts_encoded_by_pieces_equal_whole_encoding(tok):
    fresh = Tokenizer(EMBEDDED)
    start = CODE.index("\ndef ", len(CODE) // 3) + 1
    for end in range(start + 4000, start + 4300):  # typing: the window's start stays, the end grows
        assert fresh.encode_prompt(CODE[start:end]) == tok.encode(CODE[start:end])
    assert fresh._cuts_exact and len(fresh._last.starts) > 10
    for seed in range(2):
        for text in _edits(seed, CODE[:6000], 300):
            assert fresh.encode_prompt(text) == tok.encode(text)


def _trained(tmp_path, pre_tokenizer, decoder) -> Tokenizer:
    """A small BPE trained here with the given split, saved as a model directory's tokenizer."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, trainers

    hf = HF(models.BPE())
    if pre_tokenizer is not None:
        hf.pre_tokenizer, hf.decoder = pre_tokenizer, decoder
    specials = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"]
    hf.train_from_iterator([CODE], trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False))
    hf.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer(tmp_path)


def test_cl100k_style_split_is_cut_too(tmp_path):
    from tokenizers import Regex, decoders, pre_tokenizers

    cl100k = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
    tok = _trained(tmp_path, pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(cl100k), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), decoders.ByteLevel())
    for text in _edits(3, CODE[:5000], 200):
        assert tok.encode_prompt(text) == tok.encode(text)
    assert tok._cuts_exact


def test_tokenizers_that_merge_across_lines_encode_prompts_whole(tmp_path):
    tok = _trained(tmp_path, None, None)  # no pre-tokenizer: merges cross newlines and blanks
    for text in _edits(4, CODE[:3000], 60):
        assert tok.encode_prompt(text) == tok.encode(text)
    assert tok._cuts_exact is False
