"""Runs the VS Code extension's own unit tests (editors/vscode/test-unit/, Node's test runner): the parts of the
extension that need no VS Code, such as how `lingls.path` is resolved to the program the client starts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

VSCODE = Path(__file__).resolve().parents[2] / "editors" / "vscode"


def test_extension_unit_tests():
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    if not (VSCODE / "node_modules" / "esbuild").exists():
        pytest.skip("editors/vscode/node_modules is missing: run `npm ci` in editors/vscode")
    out = subprocess.run(["node", "--test", "test-unit/"], cwd=VSCODE, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "# fail 0" in out.stdout and "# pass 6" in out.stdout, out.stdout[-3000:]
