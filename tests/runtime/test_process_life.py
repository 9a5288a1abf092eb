"""`lingls serve --tp 2` (two CPU ranks over gloo): SIGTERM and Ctrl+C (SIGINT to the process group) end every
process it started, exit 0 and print no traceback; a follower whose leader is killed (SIGKILL) exits by itself."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from tests import processes

pytestmark = pytest.mark.skipif(not processes.SUPPORTED, reason="reads the process table from /proc")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, port: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"lingls serve exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.load(r)["status"] == "ok":
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"lingls serve not ready in {timeout:.0f} s")


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to the group"])
def test_stopping_the_server_ends_every_rank_without_a_traceback(tiny_dir, tmp_path, how):
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        # a session of its own: the process group a terminal's Ctrl+C reaches, and no signal strays to pytest
        proc = subprocess.Popen([sys.executable, "-m", "lingls.cli", "serve", "--model", str(tiny_dir), "--tp", "2",
                                 "--device", "cpu", "--port", str(port)],
                                stdout=err, stderr=err, start_new_session=True)
    try:
        _wait_ready(proc, port)
        started = processes.descendants(proc.pid)
        assert any("multiprocessing.spawn" in p.cmdline for p in started), [str(p) for p in started]
        if how == "SIGTERM":
            proc.terminate()
        else:
            os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=60)
        left = processes.wait_gone(started, timeout=15)
        assert not left, f"still running after {how}: {[str(p) for p in left]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert rc == 0 and "stopping" in text, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text


LEADER = textwrap.dedent("""
    import multiprocessing, sys, time
    from lingls.serve.tensor_parallel import _follower

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        shared = (ctx.Queue(), ctx.Value("q", 0, lock=False), ctx.Value("q", 0, lock=False), ctx.Queue())
        follower = ctx.Process(target=_follower, daemon=True, args=(1, 2, int(sys.argv[1]), sys.argv[2], "cpu",
                                                                    None, None, ("none", None, None, None), *shared))
        follower.start()
        time.sleep(600)
""")


def test_a_follower_exits_when_its_leader_is_killed(tiny_dir):
    """The follower is caught where it would wait longest: joining the process group (its store connection is
    accepted here and never answered); the leader then dies by SIGKILL, which it cannot answer."""
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen()
        store.settimeout(90)
        leader = subprocess.Popen([sys.executable, "-c", LEADER, str(store.getsockname()[1]), str(tiny_dir)],
                                  start_new_session=True)
        try:
            conn, _ = store.accept()  # the follower is in init_process_group now
            follower = processes.descendants(leader.pid)
            leader.kill()
            leader.wait()
            left = processes.wait_gone(follower, timeout=15)
            conn.close()
            assert not left, f"still running after its leader was killed: {[str(p) for p in left]}"
        finally:
            if leader.poll() is None:
                leader.kill()
                leader.wait()
