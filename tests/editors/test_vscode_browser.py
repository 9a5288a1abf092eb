"""The VS Code extension in a real VS Code: code-server (VS Code in the browser) with the packaged .vsix installed,
driven in a headless Chromium by vscode_browser/drive.mjs, talking to the real `lingls --stdio` with the scripted
engine of editor_engine.py (deterministic and fast). Everything is read from the DOM and from the saved file.

Needs: `tests/editors/vscode_browser/install.sh` (code-server, a headless Chromium, puppeteer-core and vsce, all from
npm; LINGLS_CHROMIUM=/path picks another browser), `npm ci` in editors/vscode, and the `lingls` command.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .editor_engine import TEXT, scripted_env

REPO = Path(__file__).resolve().parents[2]
EXTENSION = REPO / "editors" / "vscode"
HARNESS = Path(__file__).resolve().parent / "vscode_browser"
BIN = HARNESS / "node_modules" / ".bin"
FIRST_LINE, SECOND_LINE = TEXT.rstrip("\n").split("\n")  # "total = combine(alpha, beta)", "    return total"
TYPED = "def area(radius):"


def find_chromium() -> str | None:
    """LINGLS_CHROMIUM, else the Chromium that install.sh brought from npm (one pinned version everywhere: it is
    unpacked to the temporary directory on first use), else a system one."""
    override = os.environ.get("LINGLS_CHROMIUM")
    if override:
        return override
    if (HARNESS / "node_modules" / "@sparticuz" / "chromium").exists():
        unpack = "import('@sparticuz/chromium').then((m) => m.default.executablePath()).then(console.log)"
        done = subprocess.run(["node", "-e", unpack], cwd=HARNESS, capture_output=True, text=True, timeout=120)
        if done.returncode == 0 and Path(done.stdout.strip()).exists():
            return done.stdout.strip()
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    """The programs the test needs, or a skip that says which one is missing and how to get it."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    if not (BIN / "code-server").exists() or not (HARNESS / "node_modules" / "puppeteer-core").exists():
        pytest.skip("code-server / puppeteer-core are not installed: run tests/editors/vscode_browser/install.sh")
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium: run tests/editors/vscode_browser/install.sh (or `apt-get install chromium`, or set "
                    "LINGLS_CHROMIUM to a Chrome/Chromium binary)")
    if not (EXTENSION / "node_modules" / "esbuild").exists():
        pytest.skip("editors/vscode/node_modules is missing: run `npm ci` in editors/vscode")
    lingls = shutil.which("lingls")
    if lingls is None:
        pytest.skip("the `lingls` command is not installed (pip install -e .)")
    return {"chromium": chromium, "lingls": lingls}


@pytest.fixture(scope="module")
def vsix(tmp_path_factory) -> Path:
    """The extension packaged as users get it (vsce runs the esbuild bundle through vscode:prepublish)."""
    out = tmp_path_factory.mktemp("vsix") / "lingls.vsix"
    # The options of `npm run package`, with the vsce that install.sh put here instead of one npx fetches.
    options = json.loads((EXTENSION / "package.json").read_text())["scripts"]["package"].split(" package ", 1)[1]
    done = subprocess.run([str(BIN / "vsce"), "package", *options.split(), "-o", str(out)], cwd=EXTENSION,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "WARNING" not in done.stdout + done.stderr, done.stdout + done.stderr
    return out


class CodeServer:
    """code-server on 127.0.0.1 with its own user data, extensions and config, in its own process group so that
    everything it starts (extension host, file watcher, the language server) ends with it."""

    def __init__(self, root: Path, lingls: str, vsix: Path, env: dict[str, str]):
        self.root = root
        self.user = root / "user-data"
        self.settings = self.user / "User" / "settings.json"
        self.settings.parent.mkdir(parents=True)
        self.settings.write_text(json.dumps({
            "lingls.path": lingls,
            "workbench.startupEditor": "none",
            "workbench.tips.enabled": False,
            "chat.commandCenter.enabled": False,
            "telemetry.telemetryLevel": "off",
            "editor.minimap.enabled": False,
            "window.commandCenter": False,
            # Nothing beyond this machine: no extension gallery queries, no update checks.
            "extensions.autoCheckUpdates": False,
            "extensions.autoUpdate": False,
            "extensions.ignoreRecommendations": True,
            "update.mode": "none",
        }, indent=2))
        config = root / "config.yaml"
        config.write_text("auth: none\n")
        common = ["--config", str(config), "--user-data-dir", str(self.user),
                  "--extensions-dir", str(root / "extensions")]
        done = subprocess.run([str(BIN / "code-server"), *common, "--install-extension", str(vsix)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "successfully installed" in done.stdout, done.stdout + done.stderr
        self.log = root / "code-server.log"
        self._log = self.log.open("w")
        self.proc = subprocess.Popen(
            [str(BIN / "code-server"), *common, "--bind-addr", "127.0.0.1:0", "--disable-telemetry",
             "--disable-update-check", "--disable-workspace-trust"],
            env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url = self._wait_for_url()

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = re.search(r"HTTP server listening on (http://127\.0\.0\.1:\d+)", self.log.read_text())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"code-server did not start:\n{self.log.read_text()[-3000:]}")

    def close(self) -> None:
        """SIGTERM to the whole group, then SIGKILL to whatever is left of it (VS Code's file watcher can outlive
        the leader)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._log.close()


@pytest.mark.slow
def test_ghost_text_tab_word_accept_status_multi_root_and_missing_binary(pieces, vsix, tmp_path):
    project, library = tmp_path / "project", tmp_path / "library"
    project.mkdir()
    library.mkdir()
    example, second = project / "example.py", library / "stats.py"
    example.write_text("import math\n\n\n")
    second.write_text("")
    workspace = tmp_path / "two-folders.code-workspace"
    workspace.write_text(json.dumps({"folders": [{"path": str(project)}, {"path": str(library)}]}))
    shots = tmp_path / "screenshots"
    shots.mkdir()
    # A small delay per chunk keeps each generation in flight for ~0.5 s, long enough to see "generating".
    server = CodeServer(tmp_path / "code-server", pieces["lingls"], vsix, scripted_env(LINGLS_SCRIPT_DELAY="0.03"))
    try:
        args = {"url": server.url, "chromium": pieces["chromium"], "workspace": str(workspace),
                "files": [example.name, second.name], "missingPath": str(tmp_path / "nowhere" / "lingls"),
                "shots": str(shots)}
        started = time.monotonic()
        done = subprocess.run(["node", str(HARNESS / "drive.mjs"), json.dumps(args)], cwd=HARNESS,
                              capture_output=True, text=True, timeout=150)
        took = time.monotonic() - started
    finally:
        server.close()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"browser session: {took:.1f} s; steps (ms): {report['ms']}; screenshots in {shots}")
    assert "error" not in report, f"{report['error']}\nreport: {report}\ncode-server log:\n" + \
        server.log.read_text()[-3000:]

    # Ghost text at the indented body line, in the editor's DOM, and not yet in the document.
    assert report["ghost"] == f"{FIRST_LINE}\n{SECOND_LINE}"
    assert report["linesWithGhost"][-2:] == [TYPED, "    "]
    assert (shots / "ghost-text.png").stat().st_size > 10_000

    # The status bar item: ready, generating while the request was in flight, ready again.
    assert report["status"]["first"]["text"] == "lingls"
    assert "ready" in report["status"]["first"]["label"]
    states = report["status"]["states"]
    assert "codicon-sync codicon-modifier-spin" in states, states
    assert states[-1] == "codicon-sparkle", states

    # Ctrl+Right accepts one word and leaves the rest shown; Tab accepts the rest.
    assert report["linesAfterWord"][-2:] == [TYPED, "    total"]
    assert report["ghostAfterWord"] == f"{FIRST_LINE[len('total'):]}\n{SECOND_LINE}"
    assert report["linesAfterTab"][-3:] == [TYPED, f"    {FIRST_LINE}", SECOND_LINE]
    assert example.read_text() == f"import math\n\n\n{TYPED}\n    {FIRST_LINE}\n{SECOND_LINE}"

    # The second folder of the workspace: same server, same suggestion, accepted with Tab.
    assert report["secondFolder"]["ghost"] == f"{FIRST_LINE}\n{SECOND_LINE}"
    assert report["secondFolder"]["lines"][-2:] == [f"    {FIRST_LINE}", SECOND_LINE]

    # A missing binary: an error in the status bar and a notification that names the path and the setting.
    assert "not found" in report["status"]["missing"]["label"], report["status"]["missing"]
    message = " ".join(n["message"] for n in report["notifications"])
    assert str(tmp_path / "nowhere" / "lingls") in message and "lingls.path" in message, report["notifications"]
    assert any("Settings" in b for n in report["notifications"] for b in n["buttons"]), report["notifications"]
    assert "ready" in report["status"]["fixed"]["label"]
