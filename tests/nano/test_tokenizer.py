import json

SPECIALS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"]
CODE = 'def f(x: int) -> str:\n\t"""Ünïcödé, 中文, emoji 🐍."""\n    return  f"{x!r:>8}"\r\n\n'


def test_special_tokens_have_fixed_ids(tokenizer):
    assert [tokenizer.token_to_id(t) for t in SPECIALS] == [0, 1, 2, 3, 4]
    for i, t in enumerate(SPECIALS):
        assert tokenizer.encode(t, add_special_tokens=False).ids == [i]


def test_byte_level_round_trip(tokenizer):
    ids = tokenizer.encode(CODE, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == CODE
    assert all(i >= len(SPECIALS) for i in ids)


def test_prompt_with_fim_tokens_splits_at_them(tokenizer):
    ids = tokenizer.encode("<|fim_prefix|>x = 1\n<|fim_suffix|>\n<|fim_middle|>", add_special_tokens=False).ids
    assert ids[0] == 1 and ids[-1] == 3 and 2 in ids


def test_tokenizer_config_names_fim_tokens(assets, tokenizer):
    conf = json.loads((assets / "tokenizer_config.json").read_text())
    assert conf["eos_token"] == "<|endoftext|>"
    assert (conf["fim_prefix_token"], conf["fim_suffix_token"], conf["fim_middle_token"], conf["file_sep_token"]) == \
        tuple(SPECIALS[1:])
    for key in ("eos_token", "fim_prefix_token", "fim_suffix_token", "fim_middle_token", "file_sep_token"):
        assert tokenizer.token_to_id(conf[key]) is not None
    assert conf["fim_format"]["psm"].startswith("<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>")
