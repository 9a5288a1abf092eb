"""The process table as tests see it, read from /proc (Linux): which processes descend from one, whether one still
runs, and making the test process the subreaper of its descendants, so that a process orphaned by the death of
its parent (a server's follower) stays visible as a descendant instead of moving under init."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
SUPPORTED = (PROC / "self" / "stat").exists()
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


@dataclass(frozen=True)
class Process:
    """One process, named by pid and start time (clock ticks after boot), so a reused pid is another process."""

    pid: int
    start: int
    cmdline: str

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.cmdline}"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process, or None when it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ", which may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def running() -> dict[int, tuple[int, int]]:
    """Every running process (zombies left out): pid -> (parent pid, start time)."""
    table = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None and stat[0] != "Z":
            table[int(entry.name)] = (stat[1], stat[2])
    return table


def descendants(root: int) -> set[Process]:
    """The running processes below `root` (children, theirs, and so on)."""
    table = running()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.add(Process(pid, table[pid][1], _cmdline(pid)))
        todo += children.get(pid, [])
    return found


def alive(p: Process) -> bool:
    stat = _stat(p.pid)
    return stat is not None and stat[0] != "Z" and stat[2] == p.start


def wait_gone(procs, timeout: float) -> list[Process]:
    """Wait up to `timeout` seconds for every process of `procs` to end; the ones still running."""
    deadline = time.monotonic() + timeout
    left = [p for p in procs if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    return left


def kill(procs) -> None:
    for p in procs:
        if alive(p):
            os.kill(p.pid, signal.SIGKILL)


def become_subreaper() -> bool:
    """Adopt every orphaned descendant of this process (prctl PR_SET_CHILD_SUBREAPER); False where not possible."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_zombie_children() -> None:
    """Collect the exit status of this process's children that have ended (orphans it adopted as subreaper)."""
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            if stat[0] == "Z" and stat[1] == os.getpid():
                try:
                    os.waitpid(int(entry.name), os.WNOHANG)
                except ChildProcessError:
                    pass
