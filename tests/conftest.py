"""Test-wide setup. Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors: the switch must be
set before any kernel module is imported, so it lives here, at the root of the test tree. And no test may leave a
process behind (`no_process_left_behind`)."""

import multiprocessing.resource_tracker
import os

import pytest
import torch

from tests import processes

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """Errors at the session's end, naming them, if processes the tests started still run (and then kills them).

    The test process becomes the subreaper of its descendants first, so a process orphaned by its parent's death
    (a server's follower whose server was killed) is adopted by it rather than by init, and counts here. What
    outlives the tests by design is left out: processes that ran before the first test, and this process's own
    multiprocessing resource tracker (it ends with this process). A process has a few seconds to finish ending
    (a server stopped by the last test)."""
    if not processes.SUPPORTED or not processes.become_subreaper():
        yield
        return
    before = processes.descendants(os.getpid())
    yield
    tracker = multiprocessing.resource_tracker._resource_tracker._pid
    started = [p for p in processes.descendants(os.getpid()) - before if p.pid != tracker]
    left = processes.wait_gone(started, timeout=10.0)
    processes.kill(left)
    processes.reap_zombie_children()
    if left:
        pytest.fail("processes left behind by the tests (now killed):\n" + "\n".join(f"  {p}" for p in left),
                    pytrace=False)
