"""CI's smoke stage: install lingls as a new user does and complete code with it.

Builds a fresh venv with torch's CPU build and `pip install .` (no extras: no Triton, no NumPy unless torch
brings it), then, each under a time limit:
1. `lingls complete FILE:LINE:COL` prints a completion and exits 0;
2. `lingls --stdio` answers one inline completion (stdio_complete.py, a standard-library LSP client);
3. `lingls serve --draft lookup` answers one /v1/completions request with text, and SIGTERM ends it, exit
   status 0, with no process of it left;
4. every `lingls bench WHAT --help` answers from the installed package (no file outside it is read).
Any failure stops the stage with a line saying which step failed and why (and the command's own output).

    python3 tests/smoke/fresh_install.py [--venv DIR]

Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests import processes  # noqa: E402  (standard library only, as this script)

HERE = Path(__file__).resolve().parent
TORCH = "torch==2.13.0"  # the CPU build: .ci/run pins the same
SOURCE = "def add(a, b):\n    return "  # completed at its end by `lingls complete`
# /v1/completions (ending in a new line, ling-nano answered EOS at once)
PROMPT = "import os\n\n\ndef main():\n    path = os.path."


class SmokeFailure(Exception):
    pass


def run(step: str, command: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    """Run a step's command; a non-zero exit or a time-out is a SmokeFailure naming the step, with its output."""
    t0 = time.monotonic()
    try:
        done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        raise SmokeFailure(f"{step}: no result in {timeout:.0f} s\n{_tail(e.stdout)}{_tail(e.stderr)}") from None
    if done.returncode != 0:
        raise SmokeFailure(f"{step}: exit status {done.returncode}\n{_tail(done.stdout)}{_tail(done.stderr)}")
    print(f"smoke: {step}: ok ({time.monotonic() - t0:.1f} s)", flush=True)
    return done


def _tail(text, lines: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "".join(f"    | {line}\n" for line in (text or "").splitlines()[-lines:])


def build_venv(venv: Path) -> Path:
    """A venv holding torch's CPU build and lingls (`pip install .`), nothing else asked for; its python."""
    python = venv / "bin" / "python"
    reused = python.exists()
    if not reused:
        run("create the venv", [sys.executable, "-m", "venv", venv], timeout=120)
        run(f"pip install {TORCH}", [python, "-m", "pip", "install", "-q", TORCH], timeout=900)
    run("pip install .", [python, "-m", "pip", "install", "-q", REPO], timeout=600)
    if reused:  # this tree's lingls, even where the venv held the same version
        run("pip install . (again)", [python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", REPO],
            timeout=600)
    if _has(python, "triton"):
        raise SmokeFailure("the venv holds Triton: the smoke stage must run where Triton is absent")
    return python


def _has(python: Path, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-I", "-c", code]).returncode == 0  # -I: not from the working directory


def clean_env(venv: Path) -> dict:
    """The environment a user's shell has after activating the venv: no PYTHONPATH into a source tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def check_complete(venv: Path, work: Path) -> None:
    path = work / "add.py"
    path.write_text(SOURCE)
    lines = SOURCE.split("\n")
    done = run("lingls complete", [venv / "bin" / "lingls", "complete", f"{path}:{len(lines)}:{len(lines[-1]) + 1}",
                                   "--device", "cpu"], timeout=180, env=clean_env(venv), cwd=work)
    if not done.stdout.strip():
        raise SmokeFailure(f"lingls complete: exit status 0 but no completion printed\n{_tail(done.stderr)}")
    print(f"smoke:   completion: {done.stdout.strip()!r}")


def check_stdio(venv: Path, work: Path) -> None:
    done = run("lingls --stdio (one inline completion)",
               [venv / "bin" / "python", HERE / "stdio_complete.py", "--timeout", "170", "--",
                venv / "bin" / "lingls", "--stdio"], timeout=180, env=clean_env(venv), cwd=work)
    print(f"smoke:   completion: {done.stdout.strip()!r}")


def check_bench_help(venv: Path, work: Path) -> None:
    for what in ("step", "prefix", "lsp", "spec", "remote"):
        done = run(f"lingls bench {what} --help", [venv / "bin" / "lingls", "bench", what, "--help"], timeout=120,
                   env=clean_env(venv), cwd=work)
        if "usage" not in done.stdout:
            raise SmokeFailure(f"lingls bench {what} --help printed no usage\n{_tail(done.stdout + done.stderr)}")
    print("smoke:   lingls bench step|prefix|lsp|spec|remote --help answer from the installed package")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_serve(venv: Path, work: Path) -> None:
    step = "lingls serve --draft lookup"
    port = _free_port()
    log = work / "serve.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([venv / "bin" / "lingls", "serve", "--draft", "lookup", "--device", "cpu",
                                 "--port", str(port)], stdout=out, stderr=out, env=clean_env(venv), cwd=work,
                                start_new_session=True)
    try:
        text = _first_completion(proc, port, deadline=time.monotonic() + 180)
        print(f"smoke: {step}: /v1/completions answered 200 ({time.monotonic() - t0:.1f} s): {text!r}")
        started = processes.descendants(proc.pid) if processes.SUPPORTED else set()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise SmokeFailure(f"{step}: still running 30 s after SIGTERM\n{_tail(log.read_text())}") from None
        if rc != 0:
            raise SmokeFailure(f"{step}: exit status {rc} after SIGTERM\n{_tail(log.read_text())}")
        left = processes.wait_gone(started, timeout=10)
        if left:
            processes.kill(left)
            raise SmokeFailure(f"{step}: processes left after SIGTERM (now killed): {[str(p) for p in left]}")
        if "Traceback" in log.read_text():
            raise SmokeFailure(f"{step}: a traceback in its output\n{_tail(log.read_text())}")
        print(f"smoke: {step}: SIGTERM -> exit 0, no process left ({time.monotonic() - t0:.1f} s)")
    except SmokeFailure:
        raise
    except Exception as e:
        raise SmokeFailure(f"{step}: {type(e).__name__}: {e}\n{_tail(log.read_text())}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _first_completion(proc: subprocess.Popen, port: int, deadline: float) -> str:
    """Wait for /health to say ok, then one completion request; its text (a SmokeFailure if empty)."""
    base = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SmokeFailure(f"lingls serve: exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if json.load(r).get("status") == "ok":
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SmokeFailure("lingls serve: /health not ok in time")
        time.sleep(0.5)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=max(5.0, deadline - time.monotonic())) as r:
        status, answer = r.status, json.load(r)
    text = answer["choices"][0]["text"] if answer.get("choices") else ""
    if status != 200 or not text.strip():
        raise SmokeFailure(f"lingls serve: /v1/completions answered {status} without text: {answer}")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, help="where to build the venv (default: a temporary directory, "
                        "removed afterwards); an existing one is reused, lingls reinstalled in it")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lingls-smoke-") as tmp:
        work = Path(tmp)
        venv = args.venv.resolve() if args.venv else work / "venv"
        try:
            build_venv(venv)
            check_complete(venv, work)
            check_stdio(venv, work)
            check_serve(venv, work)
            check_bench_help(venv, work)
        except SmokeFailure as e:
            print(f"\nSMOKE STAGE FAILED (a fresh `pip install .` does not work): {e}", file=sys.stderr)
            return 1
    print(f"smoke: a fresh install completes code ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
