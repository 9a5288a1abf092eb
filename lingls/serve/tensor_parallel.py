"""Tensor parallelism for `lingls serve --tp N`: one process per GPU, each holding its shard (`Parallel`).

Rank 0 lives in the server process and runs the ModelRunner as the single-GPU server does; ranks 1..N-1 are
spawned processes that mirror every runner call it makes, so all ranks launch the same steps in the same order
and meet in the same collectives (NCCL on GPUs; gloo on CPU, for tests). Sampling needs no broadcast: each
rank gathers the vocab-parallel logits and draws with the same counter-based random stream (`sampling.py`),
so every rank picks the same token on its own device and feeds it to its next step.

Mirroring costs the host nothing per step: rank 0 sends each prefill / decode command through a queue, then
counts, in shared memory, how many tokens its consumer has taken; a follower takes as many from its own
decode loop and stops when rank 0 marks the request done (stop rules, cancellation and preemption are host
decisions that only rank 0 makes). NVLink multicast is kept off (NCCL_NVLS_ENABLE=0 and friends).

The followers live and die with rank 0: Ctrl+C (which the terminal sends to the whole process group) is rank 0's
to answer, and stopping the engine stops them; a follower whose rank 0 is gone, however it went (SIGKILL
included), exits at once, wherever it waits (`_live_and_die_with_rank0`).

The all-reduces of the decode and verify steps (two per layer, one to sixteen tokens of hidden state) go through
`kernels.peer_allreduce.PeerAllReduce` on GPUs: one Triton kernel that writes into the peers' memory, 3.7 us per call in
a CUDA graph on 2 x H200 where NCCL takes ~20 us. `LINGLS_ALLREDUCE=nccl` turns it off; it also steps aside by
itself (every rank agrees) when any rank lacks peer access, and for messages too large for its buffer (prefill
chunks).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import socket
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lingls.engine.local import LocalEngine
from lingls.engine.protocol import EngineError
from lingls.model.ling import Parallel

log = logging.getLogger(__name__)

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_safe_env() -> None:
    """Multicast over NVLink can take a shared host's GPUs down: off, always, here and in every child."""
    os.environ.update(SAFE_ENV)


def make_parallel(rank: int, size: int) -> Parallel:
    """The collectives a rank's shard needs, over the default process group. Collective: on NCCL it sets up the
    peer all-reduce (`LINGLS_ALLREDUCE`, see kernels.peer_allreduce.make_all_reduce), so every rank calls it
    together."""
    from lingls.kernels.peer_allreduce import make_all_reduce

    all_reduce = make_all_reduce()

    def all_gather_last(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if x.is_cuda:
            out = torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x)
            if x.shape[0] == 1:  # one row: the ranks' shards already lie end to end (no concatenating copy)
                return out.view(1, -1)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    fused = getattr(all_reduce, "add_rms_norm", None)  # the peer all-reduce's fused add + RMSNorm
    return Parallel(rank, size, all_reduce, all_gather_last, fused)


def check_gpus(tp: int) -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < tp:
        raise EngineError(f"--tp {tp} needs {tp} CUDA GPUs, and this machine has {n} visible "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_rank(rank: int, size: int, port: int, model_dir: str, device: str, dtype: str | None, capacity: int | None,
               draft: tuple):
    """Join the process group, load this rank's shard, build and warm its runner (all ranks do this together).

    draft = (--draft, --draft-k, --simulate-accept, --draft-vocab): every rank drafts the same tokens from the
    same (all-reduced) hidden states and accepts the same count, so rank 0's speculative rounds and the
    followers' stay in step."""
    from lingls.engine.local import attach_drafter
    from lingls.model import load_model
    from lingls.runtime.runner import ModelRunner

    set_safe_env()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, **({"device_id": torch.device("cuda", rank)} if cuda else {}))
    torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if cuda else torch.float32)
    model = load_model(model_dir, device=f"cuda:{rank}" if cuda else "cpu", dtype=torch_dtype,
                       par=make_parallel(rank, size))
    cap = capacity or min(model.config.max_position_embeddings, 32768 if cuda else 4096)
    runner = ModelRunner(model, capacity=cap)
    runner.warmup(greedy_only=True)
    attach_drafter(runner, *draft)
    return runner


@contextlib.contextmanager
def _sigint_blocked():
    """SIGINT blocked in this thread: the processes it starts inherit the mask and so ignore a Ctrl+C that comes
    before `_live_and_die_with_rank0` runs (while they import torch)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _live_and_die_with_rank0() -> None:
    """In a follower: ignore SIGINT (rank 0 answers Ctrl+C and stops the followers), and exit as soon as rank 0's
    process ends. multiprocessing hands every child a sentinel, the read end of a pipe whose write end only the
    parent holds; the kernel closes that end when the parent ends, however it ends, so a thread waiting on it
    wakes even while the main thread is stuck in a queue or a collective that will never complete."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank0 = multiprocessing.parent_process()

    def watch() -> None:
        rank0.join()
        os._exit(0)  # nothing to hand back to a rank 0 that is gone

    threading.Thread(target=watch, name="lingls-rank0-watch", daemon=True).start()


def _follower(rank, size, port, model_dir, device, dtype, capacity, draft, commands, taken, done, ready) -> None:
    """Ranks 1..N-1: replay rank 0's runner calls until told to stop (None) or until rank 0 is gone."""
    _live_and_die_with_rank0()
    try:
        runner = _load_rank(rank, size, port, model_dir, device, dtype, capacity, draft)
        ready.put((rank, None))
    except BaseException:
        ready.put((rank, traceback.format_exc()))
        return
    while (cmd := commands.get()) is not None:
        try:
            if cmd[0] == "prefill":
                runner.prefill(*cmd[1:])
                continue
            _, max_new, greedy, seq, base = cmd
            steps = runner.decode(max_new, greedy)
            i = 0
            while True:
                while taken.value <= base + i and done.value < seq:
                    time.sleep(0)
                if taken.value <= base + i:  # rank 0 stopped before taking token i
                    break
                if next(steps, None) is None:
                    break
                i += 1
            steps.close()
        except Exception:  # rank 0 met the same error and reports it; stay in step with it
            log.exception("rank %d: command %s failed", rank, cmd[0])
    dist.destroy_process_group()


class _Rank0Runner:
    """Rank 0's runner, publishing each call for the followers to mirror."""

    def __init__(self, runner, queues, taken, done):
        self.runner, self.queues, self.taken, self.done = runner, queues, taken, done
        self.capacity, self.cache, self.spec = runner.capacity, runner.cache, runner.spec
        self._seq = 0

    def prefill(self, prompt: list[int], sampling, allowed=None) -> int:
        for q in self.queues:
            q.put(("prefill", list(prompt), sampling, allowed))  # every rank masks the same first token
        return self.runner.prefill(prompt, sampling, allowed)

    def chosen(self) -> int:
        return self.runner.chosen()  # every rank chose the same token

    def decode(self, max_new: int, greedy: bool):
        self._seq += 1
        base = self.taken.value
        for q in self.queues:
            q.put(("decode", max_new, greedy, self._seq, base))
        steps = self.runner.decode(max_new, greedy)
        try:
            while True:
                self.taken.value += 1  # followers may take this token (and launch its step) now
                token = next(steps, None)
                if token is None:
                    return
                yield token
        finally:
            steps.close()
            self.done.value = self._seq


class TensorParallelEngine(LocalEngine):
    """LocalEngine over N ranks. `device="cpu"` runs the ranks on CPU with gloo (tests)."""

    def __init__(self, model_dir: str | None, tp: int, device: str | None = None, dtype: str | None = None,
                 capacity: int | None = None, draft: str | None = None, draft_k: int | None = None,
                 simulate_accept: int | None = None, draft_vocab: str | None = None):
        if tp < 1:
            raise EngineError(f"--tp must be >= 1, got {tp}")
        self.kind = "cpu" if device == "cpu" else "cuda"
        if self.kind == "cuda":
            check_gpus(tp)
        super().__init__(model_dir, device=self.kind, dtype=dtype, capacity=capacity, draft=draft, draft_k=draft_k,
                         simulate_accept=simulate_accept, draft_vocab=draft_vocab)
        self.tp = tp
        self.name = self.model_dir.name
        self._procs: list = []
        self._queues: list = []

    def load(self) -> None:
        with self._load_lock:
            if self.runner is not None:
                return
            set_safe_env()
            ctx = mp.get_context("spawn")
            port = _free_port()
            draft = (self.draft, self.draft_k, self.simulate_accept, self.draft_vocab)
            taken, done, ready = ctx.Value("q", 0, lock=False), ctx.Value("q", 0, lock=False), ctx.Queue()
            self._queues = [ctx.Queue() for _ in range(1, self.tp)]
            self.load_progress = f"starting {self.tp} ranks"
            with _sigint_blocked():
                for rank in range(1, self.tp):
                    p = ctx.Process(target=_follower, daemon=True, args=(
                        rank, self.tp, port, str(self.model_dir), self.kind, self.dtype, self.capacity, draft,
                        self._queues[rank - 1], taken, done, ready))
                    p.start()
                    self._procs.append(p)
            t0 = time.perf_counter()
            self.load_progress = f"loading {self.tp} shards of {self.model_dir}"
            try:
                runner = _load_rank(0, self.tp, port, str(self.model_dir), self.kind, self.dtype, self.capacity, draft)
            except Exception as e:
                self._stop_followers(grace=0.0)
                raise EngineError(f"cannot load the model on {self.tp} ranks: {e}") from None
            try:
                self._await_followers(ready)
            except EngineError:
                self._stop_followers(grace=0.0)
                raise
            self.runner = _Rank0Runner(runner, self._queues, taken, done)
            self.load_progress = f"ready on {self.tp} ranks ({time.perf_counter() - t0:.1f} s)"

    def _await_followers(self, ready) -> None:
        """Every follower's word that it loaded; a follower that failed, or exited without a word (killed, out of
        memory), is an EngineError rather than a wait forever."""
        waiting = set(range(1, self.tp))
        while waiting:
            try:
                rank, error = ready.get(timeout=0.5)
            except queue.Empty:
                gone = [(r, self._procs[r - 1].exitcode) for r in sorted(waiting) if not self._procs[r - 1].is_alive()]
                if gone:
                    raise EngineError(f"rank {gone[0][0]} exited (code {gone[0][1]}) while loading") from None
                continue
            if error:
                raise EngineError(f"rank {rank} failed to load: {error.strip().splitlines()[-1]}")
            waiting.discard(rank)

    def _stop_followers(self, grace: float = 5.0) -> None:
        """Tell the followers to stop, give them `grace` seconds to finish the step they are in, then end them."""
        for q in self._queues:
            q.put(None)
        deadline = time.monotonic() + grace
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs.clear()

    async def close(self) -> None:
        await super().close()
        self._stop_followers(grace=5.0 if self.runner is not None else 0.0)  # a loading follower has no step to end
        if dist.is_initialized() and not self._load_lock.locked():  # a load still running uses the group
            dist.destroy_process_group()
