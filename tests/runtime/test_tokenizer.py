import json

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
