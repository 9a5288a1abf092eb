from lingls.lsp.postprocess import PYTHON, Lang, Site, clean, in_comment, lang_for

SPECIALS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>", "<|endoftext|>")
C = lang_for("c")


def py(prefix, suffix="", next_line="", **kw):
    return Site(prefix, suffix, next_line, PYTHON, **kw)


def done(raw, site, **kw):
    return clean(raw, site, SPECIALS, final=True, **kw).text


def test_mode_choice():
    assert py("    ").multiline
    assert py("def f(x):").multiline
    assert py("    x = foo(").multiline
    assert not py("    x = 1 +").multiline
    assert not py("    foo(", ")").multiline  # mid-line
    assert not py("    # note: ").multiline  # in a comment
    assert in_comment("x = 1  # a", PYTHON)
    assert not in_comment('x = "# not a comment', PYTHON)
    assert in_comment("int x; // y", C)


def test_single_line_stops_at_newline_and_is_complete_early():
    site = py("    x = 1 +")
    partial = clean(" 2\n    y = 3", site, SPECIALS)
    assert partial.text == "2" or partial.text == " 2"
    assert partial.complete
    assert not clean(" 2", site, SPECIALS).complete


def test_block_stops_at_dedent_below_scope():
    site = py("def f(x):")
    raw = "\n    y = x * 2\n    return y\n\nprint(f(3))\n"
    assert done(raw, site) == "\n    y = x * 2\n    return y"
    assert clean(raw, site, SPECIALS).complete


def test_block_on_blank_line_keeps_siblings_but_stops_at_stop_line():
    site = py("")
    raw = "def f():\n    return 1\n\n\ndef g():\n    pass"
    assert done(raw, site) == "def f():\n    return 1"
    inside = py("    ")
    assert done("a = 1\n    b = 2\nc = 3", inside) == "a = 1\n    b = 2"


def test_block_stops_at_repeated_next_line_and_max_lines():
    site = py("    ", next_line="    return total")
    assert done("total = sum(xs)\n    return total\n", site) == "total = sum(xs)"
    capped = py("def f():", max_lines=2)
    assert done("\n    a\n    b\n    c", capped) == "\n    a"


def test_closing_line_of_a_bracket_block_is_kept():
    site = py("x = foo(")
    assert done("\n    1,\n    2,\n)\ny = 2", site) == "\n    1,\n    2,\n)"
    brace = Site("int f() {", "", "", C)
    assert done("\n  return 1;\n}\nint g() {", brace) == "\n  return 1;\n}"
    assert done("\n  return 1;\n}", Site("int f() {", "", "}", C)) == "\n  return 1;"


def test_special_tokens_never_leak():
    site = py("x = ")
    assert done("1<|endoftext|>junk", site) == "1"
    assert clean("1<|endoftext|>", site, SPECIALS).complete
    streaming = clean("foo<|fim_", site, SPECIALS)
    assert streaming.text == "foo" and not streaming.complete
    assert done("a <|end", site) == "a"
    assert done("a <", site) == "a <"


def test_suffix_overlap_is_dropped():
    assert done("a, b)", py("foo(", ")")) == "a, b"
    assert done('hello")', py('print("', '")')) == "hello"
    assert done("a, b)", py("foo(", ", b)")) == "a"
    assert done("max", py("y = ", "x + 1")) == "max"  # a word, not a repeat


def test_closer_supplied_by_the_suffix_is_not_doubled():
    assert done("x) + 1", py("foo(", ")")) == "x"
    assert done("(a)", py("foo(", ")")) == "(a)"  # its own brackets balance
    assert done("')'", py("foo(", ")")) == "')'"  # inside a string


def test_whitespace_only_is_nothing():
    assert done("   \n  ", py("    x = 1 +")) == ""


def test_unknown_language_gets_defaults():
    site = Site("  if (x) {", "", "", Lang())
    assert site.multiline
    assert done("\n    y();\n  }\nz();", site) == "\n    y();\n  }"


# The degeneration guard: a completion stops before a repeated line or a looping unit, and is empty rather
# than noise; legitimate repetition survives.

def test_repeated_line_in_the_completion_stops_it():
    site = py("            ", prev_line='            key, _, value = line.partition("=")')
    raw = "if key in line:\n                if key in line:\n            "
    assert done(raw, site) == "if key in line:"
    assert clean(raw, site, SPECIALS).complete  # decided while streaming: more output cannot change it
    after_opener = py("def pop(self):")
    assert done("\n    return self.items.pop()\n    return self.items.pop()", after_opener) == \
        "\n    return self.items.pop()"


def test_first_line_repeating_the_line_above_the_cursor_is_empty():
    site = py("    ", prev_line="    import os")
    assert done("import os\n    import sys", site) == ""
    assert done("import sys\n    import re", site) == "import sys\n    import re"


def test_unfinished_line_is_not_judged_while_streaming():
    site = py("    ", prev_line="    x = 1")
    partial = clean("y = 2\n    y = 2", site, SPECIALS)  # the last line may still grow into `y = 2 + x`
    assert partial.text == "y = 2\n    y = 2" and not partial.complete
    assert done("y = 2\n    y = 2", site) == "y = 2"


def test_looping_word_piece_is_empty_not_noise():
    site = py("")
    assert done("def _run_run_run_run_run_run_run_run", site) == ""
    assert done("import os\ndef _run_run_run_run", site) == "import os"
    assert done("_run_run_run_run", py("    x = foo(", ")")) == ""
    # a long unit (17 characters) looping inside a call, as ling-nano wrote after `def main():`: the line the
    # loop continued (`return _parse_args(`, left open) goes with it
    raw = '"""\n    Run.\n    """\n    return _parse_args(\n        _parse_args(' + "self._parse_args(" * 8
    assert done(raw, py("    ")) == '"""\n    Run.\n    """'
    assert done("x = [\n    a,\n    b_run_run_run_run", py("    ")) == "x = ["  # the one line the loop went on from


def test_a_looping_phrase_keeps_the_text_before_it():
    # ling-nano in a docstring of code it never saw: a two-or-more-word unit three times is a loop
    assert done("client.  SSL is used.  SSL is used.  SSL is used.", py("    ")) == "client.  SSL is used."
    assert done("# Returns the value. Returns the value. Returns the value.", py("")) == "# Returns the value."
    for line in ('names = ["a b", "c d", "a b"]', "shape = (None, None, None)", "pairs = [a, b, a, b, a, b, a, b]",
                 "Tuple[int, str, int, str, int, str]"):
        assert done(line, py("    ")) == line, line


def test_looping_punctuation_keeps_the_text_before_the_loop():
    assert done("foo(a))))))))", py("    y = ")) == "foo(a)"
    assert clean("foo(a))))))", py("    y = "), SPECIALS).complete


def test_legitimate_repetition_survives():
    site = py("    ", prev_line="    import os")
    assert done("import sys\n    import re\n    import json", site) == "import sys\n    import re\n    import json"
    init = py("        ", prev_line="    def __init__(self, a, b):")
    assert done("self.a = a\n        self.b = b", init) == "self.a = a\n        self.b = b"
    for line in ("zeros = [0, 0, 0, 0, 0, 0, 0, 0]", "shape: Tuple[int, int, int, int] = x", "f(g(h(x)))",
                 "# " + "-" * 60, 'MAGIC = b"\\x00\\x00\\x00\\x00"', "n = 1_000_000_000", "grid[0][0][0][0] = 1",
                 'PLACEHOLDER = "xxxxxx"', "assert a == a"):
        assert done(line, py("    ")) == line, line
    # closing lines repeat when nested brackets close
    nested = py("x = foo(")
    assert done("\n    bar(\n        1,\n    )\n)", nested) == "\n    bar(\n        1,\n    )\n)"
    brace = Site("int f() {", "", "", C)
    assert done("\n  if (x) {\n    y();\n  }\n}", brace) == "\n  if (x) {\n    y();\n  }\n}"


def test_a_repeated_block_of_lines_stops_the_completion():
    """ling-nano's loop in `for line in f:` (2-line blocks, the first repeat after an `else:` branch): the
    completion stops where a block it already wrote starts again, back to back or not; single lines recur."""
    site = py("            ", prev_line='            key, _, value = line.partition("=")')
    body = "                value = value\n            "
    raw = ("if key in value:\n" + body + "else:\n" + body + "if key in value:\n" + body) * 3
    assert done(raw, site) == "if key in value:\n                value = value\n            else:\n" \
        "                value = value"
    streaming = clean("if a:\n    x = 1\nif a:\n    x = 1", py(""), SPECIALS)  # the last line may still grow
    assert streaming.text.endswith("x = 1") and not streaming.complete
    assert done("if a:\n    x = 1\nif a:\n    x = 1\n", py("")) == "if a:\n    x = 1"
    legit = "if a:\n    return None\nif b:\n    return None\nelse:\n    pass"
    assert done(legit, py("")) == legit
    calls = "\n    bar(\n        1,\n    ),\n    bar(\n        2,\n    ),\n)"  # lines recur, blocks do not
    assert done(calls, py("x = foo(")) == calls
    # ling-nano after `def main():`: a block written again one level deeper each time (the `"""` lines too)
    deeper = ('"""Run."""\n    return make(\n        "name",\n        """\n        return make(\n'
              '            "name",\n            """\n')
    assert done(deeper, py("    ")) == '"""Run."""\n    return make(\n        "name",\n        """'
    shallower = "try:\n    load()\n    save()\nexcept OSError:\n    pass\nload()\nsave()"  # code going on
    assert done(shallower, py("")) == shallower
