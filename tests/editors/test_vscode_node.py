"""Runs the VS Code side's Node test (editors/vscode/test-server/) against the real `lingls --stdio`: once with the
scripted engine (exact answers, a cancelled request) and once with the embedded model (answer shapes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .editor_engine import scripted_env

VSCODE = Path(__file__).resolve().parents[2] / "editors" / "vscode"


def run_node_test(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    if not (VSCODE / "node_modules" / "vscode-jsonrpc").exists():
        pytest.skip("editors/vscode/node_modules is missing: run `npm ci` in editors/vscode")
    full = {**os.environ, "LINGLS_CMD": json.dumps([sys.executable, "-m", "lingls.cli"]), **env}
    return subprocess.run(["node", "--test", "test-server/"], cwd=VSCODE, env=full, capture_output=True, text=True,
                          timeout=timeout)


def check(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "# fail 0" in out.stdout and "# pass 6" in out.stdout, out.stdout[-3000:]


def test_node_client_against_scripted_server():
    check(run_node_test(scripted_env(), timeout=120))


@pytest.mark.slow
def test_node_client_against_embedded_model():
    pytest.importorskip("lingls.engine.local", reason="the in-process engine is not there yet")
    check(run_node_test({"LINGLS_TEST_ENGINE": ""}, timeout=300))
