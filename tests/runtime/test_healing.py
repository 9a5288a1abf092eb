"""Token healing: which token is the cursor's, which tokens may replace it, and what the user sees."""

import torch

from lingls.engine.healing import Candidates, TailStripper, cursor_index, heal, strip_tail
from lingls.engine.local import EMBEDDED
from lingls.engine.tokenizer import Tokenizer

PRE, SUF, MID = 1, 2, 3
SPECIAL = {0, PRE, SUF, MID}


def test_cursor_token_in_psm_spm_and_left_to_right_prompts():
    assert cursor_index([PRE, 10, 11, SUF, 20, 21, MID], SPECIAL, PRE) == 2
    assert cursor_index([SUF, 20, 21, PRE, 10, 11, MID], SPECIAL, PRE) == 5
    assert cursor_index([10, 11, 12], SPECIAL, PRE) == 2
    assert cursor_index([10, 11, 12], SPECIAL, None) == 2
    assert cursor_index([PRE, SUF, 20, MID], SPECIAL, PRE) is None  # empty prefix: nothing to heal
    assert cursor_index([], SPECIAL, None) is None


def test_heal_drops_the_cursor_token_and_returns_its_text():
    texts = ["<eos>", "<p>", "<s>", "<m>", "ab", "\n    ", "\ufffd"]
    assert heal([PRE, 4, 5, SUF, 4, MID], texts, SPECIAL, PRE) == ([PRE, 4, SUF, 4, MID], "\n    ")
    assert heal([4, 6], texts, SPECIAL, None) == ([4, 6], "")  # half a character: left alone


def test_a_half_typed_word_is_healed_whole_with_the_space_before_it():
    texts = ["<eos>", "<p>", "<s>", "<m>", "x = 1", "\n        ", "ret", "u", " _", "c", "(", "\ufffd", "a" * 21]
    # `ret` `u` after an indentation: the tokenizer would have cut `\n       ` ` return`
    assert heal([4, 5, 6, 7], texts, SPECIAL, None) == ([4], "\n        retu")
    assert heal([4, 5, 6, 7], texts, SPECIAL, None, whole_word=False) == ([4, 5, 6], "u")
    assert heal([PRE, 4, 8, 9, SUF, 4, MID], texts, SPECIAL, PRE) == ([PRE, 4, SUF, 4, MID], " _c")
    assert heal([4, 10, 9], texts, SPECIAL, None) == ([4, 10], "c")  # a word starts after punctuation
    assert heal([PRE, 6, 7, SUF, MID], texts, SPECIAL, PRE) == ([PRE, SUF, MID], "retu")
    assert heal([6, 7], texts, SPECIAL, None) == ([6], "u")  # a left-to-right prompt keeps a token
    assert heal([4, 12, 6, 7], texts, SPECIAL, None) == ([4, 12], "retu")  # at most MAX_TAIL_CHARS
    assert heal([4, 11, 7], texts, SPECIAL, None) == ([4, 11], "u")  # half a character is never taken


def test_candidates_agree_with_the_tail_and_exclude_special_tokens():
    texts = ["<eos>", "\n", "\n   ", "\n    ", "\n     ", " return", "x"]
    c = Candidates(texts, {0})
    assert c.mask("\n    ").tolist() == [False, True, True, True, True, False, False]
    assert c.mask(" ").tolist() == [False, False, False, False, False, True, False]
    assert c.mask(" ") is c.mask(" ")  # cached


def test_strip_tail_and_the_streaming_form_agree():
    tail = "\n        "
    for pieces in (["\n       ", " return x"], ["\n", "        ", "return"], ["\n       ", "return"], ["\n        "]):
        s = TailStripper(tail)
        assert "".join(s.feed(p) for p in pieces) == strip_tail("".join(pieces), tail)
    assert strip_tail("\n        return", tail) == "return"
    assert strip_tail("\n       return", tail) == "return"  # strayed from the tail after 7 spaces
    assert TailStripper("").feed("x") == "x"


def test_embedded_tokenizer_heals_an_indented_cursor():
    tok = Tokenizer(EMBEDDED)
    prompt = tok.fim_prompt("def f(x):\n    ", "\n")
    ids, tail = tok.heal(tok.encode(prompt))
    assert tail.endswith("    ") and tail.startswith("\n")
    assert tok.decode(ids) == "def f(x):\n"  # the prefix without its last token, then the suffix
    mask = tok.candidates().mask(tail)
    assert mask.dtype == torch.bool and mask.any() and not mask[list(tok.special_ids)].any()
