import subprocess
import sys

from lingls import __version__


def run(*args):
    return subprocess.run([sys.executable, "-m", "lingls.cli", *args], capture_output=True, text=True, timeout=60)


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"lingls {__version__}"


def test_help_lists_the_commands():
    r = run("--help")
    assert r.returncode == 0
    for word in ("--stdio", "--tcp", "serve", "complete", "bench"):
        assert word in r.stdout


def test_help_does_not_import_torch():
    code = "import sys, lingls.cli; lingls.cli.build_parser(); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False"
