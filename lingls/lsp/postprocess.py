"""Turn a model's raw stream into the text a user will accept.

Rules, in order: cut at the first special token (and hold back a half-streamed one); one line when the
cursor is mid-line or in a comment, a block when the line is blank or ends in a block opener (stop at a
line that dedents below the cursor's scope, at a stop line such as a new top-level `def`, at two blank
lines, at a line that repeats the document's next line, at `max_lines`); then the degeneration guard (stop
before a line that repeats the line above it or a block of lines written before, and at a short unit
looping within the text: `_run_run_run`, `))))))`); then drop trailing blanks, the tail that repeats the
text after the cursor, and a closing bracket the text after the cursor already has. Python rules come
first; other languages get brace-aware defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

_CLOSE = {")": "(", "]": "[", "}": "{"}
_OPEN = set(_CLOSE.values())
_QUOTES = "\"'`"


@dataclass(frozen=True)
class Lang:
    comments: tuple[str, ...] = ()
    openers: tuple[str, ...] = ("{", "(", "[", ":")  # a line ending in one of these opens a block
    stop_lines: tuple[str, ...] = ()  # a block never continues past a sibling line starting with one


PYTHON = Lang(("#",), (":", "(", "[", "{"), ("def ", "async def ", "class ", "if __name__", "@"))
_C_LIKE = Lang(("//",), ("{", "(", "[", "=>"))
_HASH = Lang(("#",), ("{", "(", "[", ":", " do", " then"))
_DASH = Lang(("--",), ("{", "(", "[", " then", " do", "="))
LANGUAGES = {
    "python": PYTHON,
    **dict.fromkeys(
        "c cpp csharp java javascript javascriptreact typescript typescriptreact rust go kotlin swift "
        "scala dart php zig".split(),
        _C_LIKE,
    ),
    **dict.fromkeys("shellscript ruby perl r yaml toml makefile dockerfile elixir".split(), _HASH),
    **dict.fromkeys("lua sql haskell".split(), _DASH),
}
DEFAULT = Lang()


def lang_for(language_id: str) -> Lang:
    return LANGUAGES.get(language_id, DEFAULT)


def indent_of(line: str) -> int:
    body = line.lstrip(" \t")
    return len(line[: len(line) - len(body)].expandtabs(4))


def _scan_line(line_prefix: str, lang: Lang) -> tuple[str | None, bool]:
    """(the string quote still open at the end of `line_prefix`, whether a line comment started)."""
    quote = None
    i = 0
    while i < len(line_prefix):
        ch = line_prefix[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in _QUOTES:
            quote = ch
        elif any(line_prefix.startswith(m, i) for m in lang.comments):
            return None, True
        i += 1
    return quote, False


def in_comment(line_prefix: str, lang: Lang) -> bool:
    """Whether the cursor is in a line comment (a comment marker outside string quotes)."""
    return _scan_line(line_prefix, lang)[1]


@dataclass(frozen=True)
class Site:
    """What the rules need to know about the cursor."""

    line_prefix: str  # the cursor's line before the cursor
    line_suffix: str  # the cursor's line after the cursor
    next_line: str = ""  # the first non-blank line after the cursor's line
    lang: Lang = DEFAULT
    max_lines: int = 12
    prev_line: str = ""  # the last non-blank line before the cursor's line

    @property
    def mid_line(self) -> bool:
        return bool(self.line_suffix.strip())

    @cached_property
    def _line_state(self) -> tuple[str | None, bool]:
        return _scan_line(self.line_prefix, self.lang)

    @property
    def open_quote(self) -> str | None:
        """The string quote still open at the cursor, if any."""
        return self._line_state[0]

    @cached_property
    def multiline(self) -> bool:
        if self.mid_line or self._line_state[1]:
            return False
        head = self.line_prefix.rstrip()
        return not head or head.endswith(self.lang.openers)


@dataclass(frozen=True)
class Cleaned:
    text: str
    complete: bool  # more model output cannot change `text`: answer now


def clean(raw: str, site: Site, specials: tuple[str, ...] = (), final: bool = False,
          block: bool | None = None) -> Cleaned:
    """The completion to show for the raw model output `raw` at `site`; `final`: the stream has ended;
    `block`: force block (True) or one-line (False) rules instead of the site's own choice."""
    text, complete = cut_specials(raw, specials, final)
    if site.multiline if block is None else block:
        text, stopped = _cut_block(text, site)
    else:
        stopped = "\n" in text
        text = text.split("\n", 1)[0].rstrip("\r")
    text, looped = cut_degenerate(text, site, final or complete or stopped)
    text = _trim(text, site)
    return Cleaned(text, complete or stopped or looped or final)


# The degeneration guard. A small model stuck in a loop writes a line again (`if key in line:` under itself) or
# one short unit over and over (`_run_run_run`, `))))))`); what it wrote before the loop is kept, the loop never.
# A unit is up to MAX_LOOP_UNIT characters; how many back-to-back copies make a loop depends on what it is made
# of, because real code repeats some units legitimately:
#   a word piece (`_run`, `self.`): 3 copies; a single letter 8 (`'xxxxxx'` placeholders stay);
#   a word with a separator (`int, `, `a `): 5 (`Tuple[int, int, int, int]` stays); a phrase of two words or
#   more, not a list's items (`  SSL is used.`): 3, kept once (ling-nano wrote `client.  SSL is used.` thrice);
#   digits, separators and escapes (`0, `, `\x00`): 12 (`[0, 0, 0, 0, 0, 0, 0, 0]`, `1_000_000_000` stay);
#   quotes: 7 (an empty `""""""` docstring stays); other punctuation (`)`, `),`, `()`): 5 (`f(g(h(x)))` and
#   `]]]]` stay, `)))))` goes); a single ruler or blank character (`-`, `=`, `#`, `*`, ` `): never (docstring
#   underlines, comment rulers, indentation).
# A repeated line is one equal (ignoring indentation) to the previous non-blank line of the completion, or to
# the line above the cursor when the completion starts on a blank line; lines without a letter or digit
# (`)`, `}`, `#`, `"""`) may repeat: nested brackets close that way. A repeated block is a run of 2 to
# MAX_LOOP_LINES non-blank lines that the completion already wrote, back to back or not, at the same indentation
# or shifted deeper by the same amount: ling-nano looped `if key in value:` / `value = value` under `else:`, and
# `return f(` / `"name",` / `"""` one level deeper each time; the same lines shifted shallower are code going on
# after a nested copy (a `try:` body repeated after it), and a single line may recur (`return None`).
# What the completion kept must not end in the middle of what the loop cut: a last line left open by the cut
# (ending in an open bracket or a comma: `return _parse_args(` before `_parse_args(self._parse_args(...`) goes too.
MAX_LOOP_UNIT = 32
MAX_LOOP_LINES = 6
_RULERS = set("-=#*~_^.+/")


def loop_copies(unit: str) -> float:
    """How many back-to-back copies of `unit` make a loop (inf: never)."""
    if not unit.strip() or (len(unit) == 1 and unit in _RULERS):
        return float("inf")
    if "\\" in unit:
        return 12
    if any(ch.isalpha() for ch in unit):
        if len(unit) == 1:
            return 8
        if _phrase(unit):
            return 3  # `  SSL is used.` three times is a loop, not a list
        return 5 if any(ch in ", ;" for ch in unit) else 3
    if any(ch.isdigit() for ch in unit):
        return 12
    if set(unit) <= set(_QUOTES):
        return 7
    return 5


def _phrase(unit: str) -> bool:
    """Two words or more with letters, not all of them list items (`  SSL is used.`, not `int, str, `)."""
    words = unit.split()
    return sum(any(ch.isalpha() for ch in w) for w in words) >= 2 and not all(w.endswith(",") for w in words)


def find_loop(text: str) -> tuple[int, str] | None:
    """(offset, unit) of the earliest short unit that `text` repeats back to back at least `loop_copies(unit)`
    times, or None. Searched line by line: a line is where such a loop lives (repeated lines are the other
    check)."""
    line_start = 0
    for line in text.split("\n"):
        found: tuple[int, str] | None = None
        for p in range(1, min(MAX_LOOP_UNIT, len(line) // 2) + 1):
            run = 0  # how many characters so far equal the one p before them
            for i in range(p, len(line)):
                run = run + 1 if line[i] == line[i - p] else 0
                if not run:
                    continue
                start = i - run - p + 1
                unit = line[start : start + p]
                if (run + p) / p >= loop_copies(unit) and _primitive(unit):
                    if found is None or start < found[0]:
                        found = (start, unit)
                    break
        if found is not None:
            return line_start + found[0], found[1]
        line_start += len(line) + 1
    return None


def _primitive(unit: str) -> bool:
    """Whether `unit` is not itself copies of a shorter unit (`abab` is `ab` twice)."""
    return (unit + unit).find(unit, 1) == len(unit)


def repeated_line(text: str, site: Site, final: bool = True) -> int | None:
    """Offset in `text` of the start of the first line that repeats the line before it, or of the first block
    of lines that repeats one written before it, or None. While streaming (`final` False) the last, unfinished
    line is not judged."""
    lines = text.split("\n")
    if not final:
        lines = lines[:-1]
    first_is_new = not site.line_prefix.strip()  # the completion starts on a blank line
    prev = site.prev_line.strip() if first_is_new else (site.line_prefix + lines[0]).strip() if lines else ""
    written: list[tuple[int, str]] = []  # (offset, the line as written) of the non-blank lines so far
    offset = 0
    for i, line in enumerate(lines):
        whole = (site.line_prefix + line if i == 0 else line).rstrip()
        body = whole.strip()
        if (i > 0 or first_is_new) and body:
            if body == prev and any(ch.isalnum() for ch in body):
                return offset
            prev = body
        if body:
            written.append((offset, whole))
            block = _repeated_block(written)
            if block is not None:
                return block
        offset += len(line) + 1
    return None


def _repeated_block(written: list[tuple[int, str]]) -> int | None:
    """Where the block of 2..MAX_LOOP_LINES lines that ends with the last of `written` starts, if those lines
    (one of them with a letter or digit) appeared before it, back to back, at the same indentation or all
    shifted deeper by one amount; else None."""
    lines = [w for _, w in written]
    bodies = [w.strip() for w in lines]
    indents = [len(w) - len(w.lstrip()) for w in lines]
    for n in range(2, min(MAX_LOOP_LINES, len(lines) // 2) + 1):
        if not any(ch.isalnum() for body in bodies[-n:] for ch in body):
            continue
        for i in range(len(lines) - 2 * n + 1):
            if bodies[i:i + n] == bodies[-n:]:
                shifts = {new - old for old, new in zip(indents[i:i + n], indents[-n:])}
                if len(shifts) == 1 and shifts.pop() >= 0:
                    return written[-n][0]
    return None


def cut_degenerate(text: str, site: Site, final: bool = True) -> tuple[str, bool]:
    """`text` before its first repeated line or loop (a loop of a word piece takes its whole line with it:
    `def _run_run_run` is noise; a phrase is kept once, `foo(a))))))` keeps `foo(a)`); True if it cut."""
    cut = repeated_line(text, site, final)
    loop = find_loop(text)
    if loop is not None:
        start, unit = loop
        if _phrase(unit):  # once, from a word's start: `.  SSL is used` is found, `  SSL is used.` kept
            word = next((k for k in range(len(unit)) if unit[k - 1].isspace() and not unit[k].isspace()), 0)
            end = start + word + len(unit)
        elif any(ch.isalpha() for ch in unit):
            end = max(text.rfind("\n", 0, start), 0)
        else:
            end = start + len(unit)
        cut = end if cut is None else min(cut, end)
    if cut is None:
        return text, False
    kept = text[:cut].rstrip("\n").rstrip() if cut else ""
    if kept.endswith((*_OPEN, ",")):  # its line went on into the loop: without it, it is unfinished
        kept = kept[: max(kept.rfind("\n"), 0)].rstrip()
    return kept, True


def is_degenerate(text: str, site: Site) -> bool:
    """Whether a finished completion repeats a line or loops (what the guard removes): for evaluations."""
    return cut_degenerate(text, site)[1]


def cut_specials(raw: str, specials: tuple[str, ...], final: bool = False) -> tuple[str, bool]:
    """Text before the first special token (True if one was found); a trailing half-streamed one is held
    back (while streaming, any length; at the end, two characters or more, so a real trailing `<` stays)."""
    cut = min((i for i in (raw.find(s) for s in specials) if i >= 0), default=-1)
    if cut >= 0:
        return raw[:cut], True
    longest = max(map(len, specials), default=0)
    shortest = 2 if final else 1
    firsts = {s[0] for s in specials}
    for i in range(max(0, len(raw) - longest + 1), len(raw) - shortest + 1):
        if raw[i] in firsts and any(s.startswith(raw[i:]) for s in specials):
            return raw[:i], False
    return raw, False


def _cut_block(text: str, site: Site) -> tuple[str, bool]:
    lines = text.split("\n")
    base = indent_of(site.line_prefix)
    head = site.line_prefix.rstrip()
    opener = head != ""
    bracket = head[-1:] in _OPEN  # then a closing line at the opener's indentation ends the block, kept
    scope = base + 1 if opener else base  # a non-blank line indented less than this leaves the block
    nxt = site.next_line.strip()
    if not opener and nxt and (site.line_prefix + lines[0]).strip() == nxt:
        return "", True
    kept = [lines[0]]
    blanks = 0
    for line in lines[1:]:
        body = line.strip()
        if not body:
            blanks += 1
            if blanks >= 2:
                return "\n".join(kept), True
            kept.append(line)
            continue
        blanks = 0
        indent = indent_of(line)
        if indent < scope:
            if bracket and indent == base and body[0] in _CLOSE and body != nxt:
                kept.append(line)
            return "\n".join(kept), True
        if indent <= base and body.startswith(site.lang.stop_lines):
            return "\n".join(kept), True
        if body == nxt or len(kept) >= site.max_lines:
            return "\n".join(kept), True
        kept.append(line)
    return "\n".join(kept), False


def _trim(text: str, site: Site) -> str:
    text = text.rstrip()
    if not text:
        return ""
    suffix = site.line_suffix.strip()
    quote = site.open_quote  # the completion may start inside a string
    if suffix and not site.multiline:
        text = _drop_suffix_overlap(text, suffix, quote)
    return _drop_supplied_closer(text, suffix, quote)


def _drop_suffix_overlap(text: str, suffix: str, quote: str | None) -> str:
    """Remove the end of `text` that the text after the cursor already has (`a, b)` before `)` -> `a, b`).

    An overlap made only of identifier characters counts only when it is the whole suffix (`max` before
    `x + 1` is a word, not a repeat), and one with closing brackets only when `text` leaves that many
    brackets open before it (`(a)` before `)` closes its own)."""
    for k in range(min(len(text), len(suffix)), 0, -1):
        head = suffix[:k]
        if not text.endswith(head):
            continue
        if head.replace("_", "a").isalnum() and k < len(suffix):
            continue
        if sum(ch in _CLOSE for ch in head) > len(_unmatched_closers(text, quote)):
            continue
        return text[:-k].rstrip()
    return text


def _drop_supplied_closer(text: str, suffix: str, quote: str | None) -> str:
    """Cut `text` at its first closing bracket that closes something opened before the cursor when the text
    after the cursor starts with that same bracket (an auto-paired `)` would otherwise be doubled)."""
    if suffix[:1] not in _CLOSE:
        return text
    unmatched = _unmatched_closers(text, quote)
    if unmatched and text[unmatched[0]] == suffix[0]:
        return text[: unmatched[0]].rstrip()
    return text


def _unmatched_closers(text: str, quote: str | None) -> list[int]:
    """Indices of the closing brackets in `text` that close something opened before it, skipping string
    literals (`quote`: the string the text starts in, if any)."""
    depth = 0
    found = []
    escaped = False
    for i, ch in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote or ch == "\n":
                quote = None
        elif ch in _QUOTES:
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            if depth:
                depth -= 1
            else:
                found.append(i)
    return found
