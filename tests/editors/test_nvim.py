"""Headless Neovim with the lingls plugin and the real `lingls --stdio`, used as a person would: enter insert
mode, see ghost text, press keys, read the buffer. The scripted engine (editor_engine.py) makes the server fast
and deterministic; the last test runs the embedded model."""

from __future__ import annotations

import re
import time

import pytest

from .editor_engine import TEXT, scripted_env

BODY = "def area(radius):\n    \n"
AT_BODY = (1, 4)  # the blank indented line: a statement is expected there
FIRST_LINE = TEXT.split("\n")[0]  # "total = combine(alpha, beta)"


def insert_with_ghost(nvim, keys: str = "a", timeout: float = 15.0) -> dict:
    """Enter insert mode and wait for ghost text at the cursor."""
    nvim.keys(keys)
    return nvim.wait(
        lambda s: s["mode"] == "i" and s["ghost"] and (s["ghost"]["row"], s["ghost"]["col"]) == (s["row"], s["col"]),
        timeout=timeout,
        what="ghost text at the cursor",
    )


def expected_after_insert(state: dict, text: str) -> tuple[list[str], tuple[int, int]]:
    """The buffer lines and cursor after inserting `text` at the cursor of `state` (Neovim columns are bytes)."""
    row, col = state["row"], state["col"]
    line = state["lines"][row].encode()
    new = (line[:col] + text.encode() + line[col:]).decode().split("\n")
    lines = state["lines"][:row] + new + state["lines"][row + 1 :]
    parts = text.split("\n")
    cursor = (row + len(parts) - 1, (col if len(parts) == 1 else 0) + len(parts[-1].encode()))
    return lines, cursor


def test_accept_inserts_exactly_the_ghost_text(open_nvim):
    nvim = open_nvim(BODY, env=scripted_env(), cursor=AT_BODY)
    before = insert_with_ghost(nvim)
    ghost = before["ghost"]["text"]
    assert ghost.startswith(FIRST_LINE)
    nvim.keys("<Tab>")
    lines, cursor = expected_after_insert(before, ghost)
    after = nvim.wait(lambda s: s["lines"] != before["lines"], what="the accept to edit the buffer")
    assert after["lines"] == lines
    assert (after["row"], after["col"]) == cursor
    assert after["mode"] == "i"


def test_partial_accept_word_then_line(open_nvim):
    nvim = open_nvim(BODY, env=scripted_env(), cursor=AT_BODY)
    start = insert_with_ghost(nvim)
    ghost = start["ghost"]["text"]

    nvim.keys("<C-Right>")
    s = nvim.wait(lambda s: s["lines"] != start["lines"], what="accept-word to edit the buffer")
    word = s["lines"][1][start["col"] : s["col"]]
    assert re.fullmatch(r"\s*(\w+|[^\w\s]+)", word), f"one word: {word!r}"
    assert word == "total"
    assert s["ghost"]["text"] == ghost[len(word) :], "the rest stays shown"

    nvim.keys("<C-Right>")
    s = nvim.wait(lambda s: s["col"] > start["col"] + len(word), what="second accept-word")
    assert s["lines"][1] == "    total ="

    nvim.keys("<C-Down>")
    s = nvim.wait(lambda s: s["lines"][1] != "    total =", what="accept-line")
    assert s["lines"][1] == "    " + FIRST_LINE
    assert s["ghost"]["text"] == ghost[len(FIRST_LINE) :]


def test_typing_through_keeps_it_and_a_different_char_clears_it(open_nvim):
    nvim = open_nvim(BODY, env=scripted_env(), cursor=AT_BODY)
    start = insert_with_ghost(nvim)
    ghost = start["ghost"]["text"]
    # No new request for a while, so what is on screen right after a key is the plugin's own reaction.
    nvim.lua("require('lingls.config').options.debounce_ms = 3000")

    nvim.keys("to")
    s = nvim.wait(lambda s: s["col"] == start["col"] + 2, what="typing 'to'")
    assert s["ghost"] and s["ghost"]["text"] == ghost[2:], "typing the suggestion's next characters keeps the rest"
    assert (s["ghost"]["row"], s["ghost"]["col"]) == (s["row"], s["col"])

    nvim.keys("x")  # the suggestion continues with "t"
    s = nvim.wait(lambda s: s["col"] == start["col"] + 3, what="typing 'x'")
    assert s["ghost"] is None, "a character the suggestion does not continue with clears it"


def test_nothing_outside_insert_mode(open_nvim):
    nvim = open_nvim(BODY, env=scripted_env(), cursor=AT_BODY)
    insert_with_ghost(nvim)
    nvim.keys("<Esc>")
    nvim.wait(lambda s: s["mode"] == "n" and s["ghost"] is None, what="ghost text gone in normal mode")
    nvim.keys("j")  # moving in normal mode asks for nothing
    time.sleep(0.3)
    assert nvim.state()["ghost"] is None


def test_dismiss_hides_until_the_next_edit(open_nvim):
    nvim = open_nvim(BODY, env=scripted_env(), cursor=AT_BODY)
    insert_with_ghost(nvim)
    nvim.keys("<C-]>")
    nvim.wait(lambda s: s["ghost"] is None, what="dismiss")
    time.sleep(0.3)
    assert nvim.state()["ghost"] is None
    assert nvim.state()["lines"] == ["def area(radius):", "    "], "dismiss inserts nothing"


def test_cycle_asks_for_candidates_and_accepts_the_one_shown(open_nvim):
    nvim = open_nvim(BODY, env=scripted_env(), cursor=AT_BODY)
    start = insert_with_ghost(nvim)
    first = start["ghost"]["text"]
    nvim.keys("<M-]>")
    s = nvim.wait(lambda s: s["ghost"] and s["ghost"]["text"] != first, what="another candidate")
    other = s["ghost"]["text"]
    nvim.keys("<Tab>")
    lines, _ = expected_after_insert(start, other)
    after = nvim.wait(lambda s: s["lines"] != start["lines"], what="accepting the candidate shown")
    assert after["lines"] == lines


def test_superseded_request_is_cancelled_and_stale_answer_dropped(open_nvim, tmp_path):
    log = tmp_path / "engine.log"
    env = scripted_env(LINGLS_SCRIPT_DELAY="0.1", LINGLS_SCRIPT_LOG=str(log))
    nvim = open_nvim(BODY, env=env, cursor=AT_BODY)
    # Count the plugin's $/cancelRequest calls.
    nvim.lua(
        "local lsp = require('lingls.lsp'); _G.cancels = 0; local cancel = lsp.cancel;"
        "lsp.cancel = function(...) _G.cancels = _G.cancels + 1; return cancel(...) end"
    )
    nvim.keys("a")
    nvim.wait(lambda s: s["status"] == "generating", what="a request in flight")
    nvim.keys("z")  # the slow generation is now for a stale position
    s = nvim.wait(lambda s: s["ghost"] is not None, timeout=30, what="the answer for the new position")
    assert nvim.lua("return _G.cancels") >= 1
    assert (s["ghost"]["row"], s["ghost"]["col"]) == (s["row"], s["col"]) == (1, 5)
    # the superseded stream logs its stop when its generator is closed, which can come after the new answer is drawn
    deadline = time.monotonic() + 10
    while "stopped" not in log.read_text().split() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "stopped" in log.read_text().split(), "the superseded generation stopped"

    # An answer for a cursor that has moved on is not drawn, even if nothing cancelled it. (The server itself
    # answers nothing once the text changed, so only a cursor move without an edit can show this.)
    nvim.lua("require('lingls.completion').refresh = function() end")
    nvim.keys("<Esc>kA")
    nvim.wait(lambda s: s["mode"] == "i" and s["status"] == "generating", what="a request at the end of the line")
    nvim.keys("<Left>")
    nvim.wait(lambda s: s["status"] == "ready", timeout=30, what="the stale answer")
    assert nvim.state()["ghost"] is None


def test_checkhealth(open_nvim):
    nvim = open_nvim(BODY, env=scripted_env())
    report = nvim.lua(
        "vim.cmd('checkhealth lingls'); return table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), '\\n')"
    )
    assert "lingls" in report
    assert "ERROR" not in report, report
    assert re.search(r"OK .*lingls \d", report), report
    assert "client 1 is up" in report, report


@pytest.mark.slow
def test_real_model_ghost_text_is_what_accept_inserts(open_nvim):
    """The embedded model instead of the script: whatever it suggests must be shown and inserted identically."""
    text = "import os\n\n\ndef list_python_files(folder):\n    \n"
    nvim = open_nvim(text, cursor=(4, 4), attach_timeout=60)
    before = insert_with_ghost(nvim, timeout=240)
    ghost = before["current"]
    assert ghost and before["ghost"]["text"] == ghost.replace("\t", " " * before["tabstop"])
    nvim.keys("<Tab>")
    lines, cursor = expected_after_insert(before, ghost)
    after = nvim.wait(lambda s: s["lines"] != before["lines"], what="the accept to edit the buffer")
    assert after["lines"] == lines
    assert (after["row"], after["col"]) == cursor


def test_ghost_text_has_its_own_highlight_visible_without_termguicolors(open_nvim):
    nvim = open_nvim(BODY, env=scripted_env(), cursor=AT_BODY)
    nvim.lua("vim.o.termguicolors = false")
    insert_with_ghost(nvim)
    groups = nvim.lua("""
        local ns = vim.api.nvim_get_namespaces()["lingls.ghost"]
        local groups = {}
        for _, mark in ipairs(vim.api.nvim_buf_get_extmarks(0, ns, 0, -1, { details = true })) do
          for _, chunk in ipairs(mark[4].virt_text or {}) do groups[#groups + 1] = chunk[2] end
          for _, line in ipairs(mark[4].virt_lines or {}) do
            for _, chunk in ipairs(line) do groups[#groups + 1] = chunk[2] end
          end
        end
        return groups""")
    assert groups and set(groups) <= {"LinglsGhost", "LinglsGhostNote"} and "LinglsGhost" in groups
    hl = "return vim.api.nvim_get_hl(0, { name = 'LinglsGhost', link = false })"
    # Neovim's default Comment has a GUI colour only: the ghost text gets a terminal colour and italics of its own.
    assert nvim.lua("return vim.api.nvim_get_hl(0, { name = 'Comment' }).ctermfg") is None
    own = nvim.lua(hl)
    assert own["ctermfg"] == 8 and own["cterm"]["italic"] and own["fg"] == nvim.lua(
        "return vim.api.nvim_get_hl(0, { name = 'Comment' }).fg")
    # A colorscheme whose Comment has a terminal colour: the ghost text follows it.
    nvim.lua("vim.cmd('hi clear'); vim.cmd('hi Comment ctermfg=2 guifg=#00aa00'); "
             "vim.api.nvim_exec_autocmds('ColorScheme', {})")
    assert nvim.lua("return vim.api.nvim_get_hl(0, { name = 'LinglsGhost' }).link") == "Comment"
    # A user's own definition is kept across a colorscheme change that does not clear it.
    nvim.lua("vim.api.nvim_set_hl(0, 'LinglsGhost', { ctermfg = 5 }); vim.api.nvim_exec_autocmds('ColorScheme', {})")
    assert nvim.lua(hl)["ctermfg"] == 5
