from lingls.engine.protocol import FimTemplate
from lingls.lsp.context import ContextRing
from lingls.lsp.prompt import WINDOW_STEP, TokenCounter, build_prompt, sanitize
from lingls.lsp.settings import Settings

FIM = FimTemplate()


def counter():
    return TokenCounter(lambda s: len(s) // 4 + 1)


def test_fim_prompt_layout_with_context_chunks():
    ring = ContextRing(4)
    ring.offer("file:///w/util.py", "util.py", 0, ["def helper():", "    return 42"])
    text = "import util\n\nx = \nprint(x)\n"
    offset = text.index("x = ") + 4
    p = build_prompt(text, offset, fim=FIM, counter=counter(), budget=1000, chunks=ring.chunks_for("file:///w/a.py"),
                     path="a.py")
    assert p.text == ("<|file_sep|>util.py\ndef helper():\n    return 42\n<|file_sep|>a.py\n"
                      "<|fim_prefix|>import util\n\nx = <|fim_suffix|>\nprint(x)\n<|fim_middle|>")
    assert p.parts.prefix == text[:offset] and p.parts.suffix == text[offset:]
    assert p.parts.context == (("util.py", "def helper():\n    return 42"),)


def test_plain_prompt_without_fim_is_the_prefix():
    text = "a = 1\nb = "
    p = build_prompt(text, len(text), fim=None, counter=counter(), budget=100)
    assert p.text == text


def test_budget_keeps_whole_lines_nearest_the_cursor():
    lines = [f"line_{i:03d} = {i}\n" for i in range(500)]
    text = "".join(lines)
    offset = len("".join(lines[:300]))
    p = build_prompt(text, offset, fim=FIM, counter=counter(), budget=200)
    assert p.tokens <= 200
    prefix = p.text.split("<|fim_suffix|>")[0].removeprefix("<|fim_prefix|>")
    assert prefix.endswith(lines[299]) and prefix.startswith("line_")  # whole lines, nearest first
    assert 0 < p.suffix_chars < p.prefix_chars  # the suffix gets a fifth


def test_window_start_of_a_long_document_moves_in_steps_while_typing():
    """Typing line after line at the end of a document larger than the budget: the prompt keeps its beginning
    (the engine's prefix reuse) for WINDOW_STEP lines at a time, always within the budget, always whole lines."""
    text = "".join(f"value_{i:03d} = compute({i}, {i * 7})\n" for i in range(400))
    c, starts, lines_typed = counter(), [], 0
    for line in (f"typed_{j} = value_{j:03d} + 1\n" for j in range(3 * WINDOW_STEP)):
        for ch in line:
            text += ch
            p = build_prompt(text, len(text), fim=None, counter=c, budget=600)
            assert p.tokens <= 600
            start = len(text) - p.prefix_chars
            assert start == 0 or text[start - 1] == "\n"
            assert text.count("\n", 0, start) % WINDOW_STEP == 0
            starts.append(start)
        lines_typed += 1
    moves = sum(a != b for a, b in zip(starts, starts[1:]))
    assert 1 <= moves <= lines_typed // WINDOW_STEP + 1  # a start chosen afresh moved at nearly every line
    assert min(len(text) - s for s in starts) > 0


def test_window_of_long_lines_keeps_at_least_half_of_what_fits():
    """Lines so long that only ~11 fit: wherever the window's top falls against the WINDOW_STEP grid, it keeps
    at least half of them (moving the start to a multiple of WINDOW_STEP could otherwise drop them all)."""
    rows = [f"row_{i:03d} = [{', '.join(str(i * j) for j in range(40))}]\n" for i in range(200)]
    for n in range(170, 200):
        text = "".join(rows[:n]) + "x = "
        p = build_prompt(text, len(text), fim=None, counter=counter(), budget=600)
        assert p.tokens <= 600
        assert text[len(text) - p.prefix_chars:].count("\n") >= 5, n


def test_monster_line_is_cut():
    text = "x" * 100_000
    p = build_prompt(text, len(text), fim=FIM, counter=counter(), budget=100)
    assert p.prefix_chars <= 300


def test_sanitize_breaks_special_tokens_and_lone_surrogates():
    s = sanitize("a <|fim_middle|> \ud800 b", FIM.special_tokens())
    assert "<|fim_middle|>" not in s and "\ud800" not in s
    assert s.encode("utf-8")


def test_token_counter_caches_lines():
    calls = []
    c = TokenCounter(lambda s: calls.append(s) or 1)
    assert c.text("a\nb\na\n") == 3
    assert calls == ["a\n", "b\n"]


def test_ring_replaces_overlapping_chunks_and_evicts_oldest():
    ring = ContextRing(2)
    ring.offer("u1", "a.py", 0, [f"a{i}" for i in range(64)])
    ring.offer("u1", "a.py", 10, [f"a{i}" for i in range(10, 74)])  # mostly the same window: replaces
    assert len(ring) == 1 and ring.chunks_for("x")[0].first_line == 10
    ring.offer("u2", "b.py", 0, ["b"])
    ring.offer("u3", "c.py", 0, ["c"])
    assert [c.label for c in ring.chunks_for("x")] == ["b.py", "c.py"]
    assert [c.label for c in ring.chunks_for("u3")] == ["b.py"]
    ring.offer("u4", "d.py", 0, ["   "])  # blank: not worth a chunk
    assert len(ring) == 2


def test_settings_merge_flat_or_sectioned_and_reject_bad_values():
    s, warnings = Settings().merged({"lingls": {"maxTokens": 16, "languages": ["python"], "debounceMs": "x"}})
    assert s.max_tokens == 16 and s.languages == ("python",) and s.debounce_ms == 0
    assert len(warnings) == 1
    s2, warnings = s.merged({"maxTokens": 0, "enable": 1, "bogus": True})
    assert s2.max_tokens == 16 and s2.enable is True and len(warnings) == 3
    assert s2.language_enabled("python") and not s2.language_enabled("rust")
    assert Settings().merged("nonsense")[1]
