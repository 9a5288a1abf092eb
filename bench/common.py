"""What the benchmarks share: the shard's context, CUDA-graph capture, the random state a step is timed on,
per-kernel profiles, and writing a result file that says where it was measured. (The floors they divide by are
`lingls.bench.floor`'s, one computation for every benchmark.)

Every result JSON gets a `run` record (`run_info`): the GPU, torch, Triton and Python versions and the commit of
the tree that ran, so a figure in docs/performance.md can name its machine and commit from the file alone.
"""

from __future__ import annotations

import json
import platform
import socket
import subprocess
from pathlib import Path

import torch

CONTEXT = 8192


def graphed(fn):
    """Capture fn() once (after warm-up on a side stream) and return a replay closure."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def random_state(model):
    """The state the shard benchmarks step: a latent cache of CONTEXT rows and KDA states of random values (the
    arithmetic of a zero state is not a decode's)."""
    state = model.new_state(CONTEXT + 64)
    state.latent.normal_()
    state.kda.normal_(std=0.01)
    return state


def kernel_profile(fn, reps: int = 10, top: int = 14) -> list[dict]:
    """Device time per kernel name over `reps` eager calls of fn, per call, largest first (CUPTI via
    torch.profiler; eager so every launch is attributed, while the graph times above include the gaps)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return kernel_rows(prof, reps, top)


def kernel_rows(prof, reps: int, top: int) -> list[dict]:
    """A profile of `reps` calls -> per call: the total, then the `top` kernel names by device time."""
    rows = [dict(kernel=e.key[:90], us_per_step=e.device_time_total / reps, launches_per_step=e.count / reps)
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    launches = sum(r["launches_per_step"] for r in rows)
    return [dict(kernel="(all kernels)", us_per_step=total, launches_per_step=launches)] + rows[:top]


def commit() -> str | None:
    """The short commit of the tree being run (with `+dirty` when it has changes), or None outside a checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True,
                             timeout=10)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root:
            return None  # not a checkout: e.g. a snapshot of bench/ab_session.sh inside another repository's .cache
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def run_info() -> dict:
    """Where and with what a result was measured."""
    info = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "gpus": torch.cuda.device_count(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "commit": commit()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def write_result(path: str | Path, record: dict) -> Path:
    """Write `record` as JSON to `path` (parents made), with a `run` record added (see `run_info`); values JSON does
    not know are written as their str()."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**record, "run": run_info()}, indent=1, default=str) + "\n")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (for a server or a process group this benchmark starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
