"""How lingls prompts ling-nano: the order its card names (`completion_prompt`), with the suffix where it is
FIM, and token healing at the cursor in either order."""

import json
import shutil

import pytest

from lingls.engine.healing import cursor_index
from lingls.engine.local import LocalEngine
from lingls.engine.protocol import FimTemplate
from lingls.lsp.prompt import TokenCounter, build_prompt


def counter():
    return TokenCounter(lambda s: len(s) // 4 + 1)


def test_spm_puts_the_suffix_first_and_the_prefix_next_to_the_middle():
    text = "def f(a, b):\n    return \n\nprint(f(1, 2))\n"
    offset = text.index("return ") + 7
    spm = build_prompt(text, offset, fim=FimTemplate(order="spm"), counter=counter(), budget=1000)
    assert spm.text == f"<|fim_suffix|>{text[offset:]}<|fim_prefix|>{text[:offset]}<|fim_middle|>"
    psm = build_prompt(text, offset, fim=FimTemplate(), counter=counter(), budget=1000)
    assert psm.text == f"<|fim_prefix|>{text[:offset]}<|fim_suffix|>{text[offset:]}<|fim_middle|>"
    assert spm.parts == psm.parts


def test_healing_finds_the_cursor_token_in_either_order(tokenizer):
    ids = {t: tokenizer.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")}
    pre, suf = tokenizer.encode("x = foo").ids, tokenizer.encode(")\n").ids
    special = set(range(5))
    spm = [ids["<|fim_suffix|>"], *suf, ids["<|fim_prefix|>"], *pre, ids["<|fim_middle|>"]]
    psm = [ids["<|fim_prefix|>"], *pre, ids["<|fim_suffix|>"], *suf, ids["<|fim_middle|>"]]
    assert spm[cursor_index(spm, special, ids["<|fim_prefix|>"])] == pre[-1]
    assert psm[cursor_index(psm, special, ids["<|fim_prefix|>"])] == pre[-1]


@pytest.mark.parametrize("how, order", [("psm", "psm"), ("spm", "spm"), ("prefix", None)])
def test_the_engine_prompts_as_the_card_says(assets, tmp_path, how, order):
    model = tmp_path / "m"
    shutil.copytree(assets, model, ignore=shutil.ignore_patterns("model.safetensors*", "*.png", "draft"))
    (model / "model.safetensors.zlib").symlink_to(assets / "model.safetensors.zlib")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "completion_prompt": how}))
    engine = LocalEngine(str(model), device="cpu")
    assert (engine.fim.order if engine.fim else None) == order
