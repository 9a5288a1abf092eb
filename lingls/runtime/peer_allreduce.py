"""One-shot all-reduce over peer GPU memory, for the small messages of batch-1 tensor parallelism.

Why: at batch 1 every all-reduce carries one to sixteen tokens' hidden states (2560 bf16 = 5 KB per token), and
NCCL takes ~22 us for that on two NVLinked H200s even inside a CUDA graph. A Ling-3.0-flash step does 84 of them
(two per layer), 1.85 ms: more than the whole TP=2 byte floor of the step. The message is tiny, so the right
algorithm is latency-bound, not bandwidth-bound: every rank pushes its partial straight into every peer's memory,
raises a flag there, waits for its peers' flags in its own memory, and sums. One kernel launch, one NVLink trip.

How:
- Each rank allocates one receive buffer (`_Layout`): flag words [MAX_PROGRAMS, WORLD] int64, then data
  [2 parities, WORLD slots, slot_bytes]. CUDA IPC handles of the buffers are swapped over torch.distributed
  (`reduce_tensor` -> `all_gather_object` -> rebuild), so each rank holds every peer's buffer address.
- The kernel runs `cdiv(n, BLOCK)` programs; program p owns elements [p*BLOCK, (p+1)*BLOCK) and talks to
  program p of the peers only, through flag (p, src): no grid-wide barrier is needed.
- Program p's epoch lives in device memory (`epochs[p]`) and the kernel advances it, so the op needs nothing
  from the host per call: it is CUDA-graph capturable and a graph can be replayed any number of times.
- Epoch e writes into parity e % 2. A rank can be at most one epoch ahead of a peer: to finish e it needs the
  peer's flag of e, which the peer raises in its call e, after its call e-1 (the reads of e-1) completed. So
  while a slow peer may still read e, a fast rank writes at most e+1: into the other parity.
- Stores to peers, then a CTA barrier, then a flag write with release semantics at system scope; the waiter
  polls its flag with acquire semantics at system scope, then a CTA barrier, then reads the slots (volatile
  loads: the data was written by another GPU). The sum is formed in fp32 in rank order 0..WORLD-1, so every
  rank gets bit-identical results.
- A bounded spin: a peer that never arrives (dead process, mismatched calls) sets `error` instead of hanging
  the GPU forever; `failed()` reads it.

`make_all_reduce` (used by `distributed.make_parallel`) picks this or the process group's own all-reduce
(NCCL on GPUs, gloo on CPU). Messages bigger than the buffer, or of other dtypes, take the fallback; since
every rank sees the same shapes, every rank takes the same path.

Not used: torch.distributed._symmetric_memory (its rendezvous hung on the lent machines), NVLink multicast
(kept off on shared machines).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the fallback serves there
    triton = tl = None

log = logging.getLogger(__name__)

BLOCK = 1024  # elements per program (2 KB of bf16: 16-byte vectors over 4 warps)
MAX_SPIN = 1 << 24  # flag polls before a program gives up (~10 s or more: far beyond any legitimate skew)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class _Layout:
    """Byte layout of one rank's receive buffer."""

    world: int
    max_bytes: int  # per slot: the largest message, in bytes

    @property
    def max_programs(self) -> int:
        return -(-self.max_bytes // (BLOCK * 2))  # a program moves BLOCK elements of >= 2 bytes

    @property
    def flag_bytes(self) -> int:
        return -(-self.max_programs * self.world * 8 // 256) * 256  # data starts 256-byte aligned

    @property
    def total(self) -> int:
        return self.flag_bytes + 2 * self.world * self.max_bytes


if triton is not None:

    @triton.jit
    def _one_shot_kernel(x_ptr, out_ptr, data_ptr, flag_ptr, delta_ptr, epochs_ptr, error_ptr, n, slot_elems,
                         RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                         PUSH: tl.constexpr, REDUCE: tl.constexpr, MAX_SPIN: tl.constexpr):
        """out = sum over ranks of x. PUSH and REDUCE are both set in real use; tests run them apart to
        simulate two ranks in one process (the interpreter runs programs one after another).

        data_ptr / flag_ptr are this rank's receive buffer (typed as x / int64); rank r's buffer is the same
        address plus delta_ptr[r] bytes. Typed local pointers plus 256-byte-multiple deltas (instead of raw
        integer addresses) let Triton prove 16-byte alignment and move 16-byte vectors over NVLink."""
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        e = tl.load(epochs_ptr + pid) + 1  # this call's epoch, for this program
        parity = e % 2
        esize: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth // 8
        x = tl.load(x_ptr + offs, mask=mask)
        if PUSH:
            for r in tl.static_range(WORLD):
                if r != RANK:
                    delta = tl.multiple_of(tl.load(delta_ptr + r) // esize, 128)
                    slot = tl.multiple_of((parity * WORLD + RANK) * slot_elems, 128)
                    tl.store(data_ptr + delta + slot + offs, x, mask=mask)
            tl.debug_barrier()  # every thread's stores are issued before the release below
            for r in tl.static_range(WORLD):
                if r != RANK:
                    peer_flag = flag_ptr + tl.load(delta_ptr + r) // 8 + pid * WORLD + RANK
                    tl.atomic_xchg(peer_flag, e, sem="release", scope="sys")
        if REDUCE:
            for r in tl.static_range(WORLD):
                if r != RANK:
                    flag = flag_ptr + pid * WORLD + r
                    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                    spins = 0
                    while (seen < e) & (spins < MAX_SPIN):
                        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                        spins += 1
                    if seen < e:
                        tl.atomic_xchg(error_ptr, 1)
            tl.debug_barrier()  # no thread reads a slot before the flags said it is complete
            acc = tl.zeros((BLOCK,), tl.float32)
            for r in tl.static_range(WORLD):  # fixed order: the same bits on every rank
                if r == RANK:
                    acc += x.to(tl.float32)
                else:
                    slot = tl.multiple_of((parity * WORLD + r) * slot_elems, 128)
                    acc += tl.load(data_ptr + slot + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
            tl.store(out_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=mask)
            tl.store(epochs_ptr + pid, e)


class PeerAllReduce:
    """Sum-all-reduce of a small CUDA tensor across the ranks of `group` (one process per GPU, one host).

    Build it collectively with `PeerAllReduce.create(group)`, which returns None on every rank when any rank
    cannot take part (then use the process group's all-reduce). Calling it reduces in place and returns x,
    like `dist.all_reduce`; messages it cannot take go to `dist.all_reduce`."""

    def __init__(self, rank: int, world: int, buffer: torch.Tensor, peers: list[torch.Tensor], max_bytes: int,
                 group=None):
        if max_bytes % 512:
            raise ValueError(f"max_bytes must be a multiple of 512 (the kernel's alignment hints), got {max_bytes}")
        self.rank, self.world, self.group = rank, world, group
        self.layout = _Layout(world, max_bytes)
        self.buffer, self.peers = buffer, peers  # the peers' mapped buffers stay referenced: they stay mapped
        device = buffer.device
        base = buffer.data_ptr()
        deltas = [p.data_ptr() - base for p in peers]
        if any(d % 512 for d in deltas):
            raise ValueError("peer buffers are not 512-byte aligned")
        self.deltas = torch.tensor(deltas, dtype=torch.int64, device=device)
        self.flags = buffer[:self.layout.flag_bytes].view(torch.int64)
        self._data = {dt: buffer[self.layout.flag_bytes:].view(dt) for dt in DTYPES}
        self.epochs = torch.zeros(self.layout.max_programs, dtype=torch.int64, device=device)  # never wraps
        self.error = torch.zeros(1, dtype=torch.int32, device=device)

    # ---- setup --------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, group=None, max_elems: int = 16 * 4096, dtype: torch.dtype = torch.bfloat16,
               check: bool = True) -> "PeerAllReduce | None":
        """Collective: every rank of `group` must call it. Returns the same kind of answer on every rank."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        reason = None
        payload = None
        layout = _Layout(world, -(-max_elems * torch.tensor([], dtype=dtype).element_size() // 512) * 512)
        try:
            if triton is None:
                raise RuntimeError("triton is not installed")
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA")
            from torch.multiprocessing.reductions import reduce_tensor

            device = torch.device("cuda", torch.cuda.current_device())
            buffer = torch.zeros(layout.total, dtype=torch.uint8, device=device)
            torch.cuda.synchronize(device)  # the zeros are in place before a peer can write
            payload = (socket.gethostname(), device.index, reduce_tensor(buffer))
        except Exception as e:  # noqa: BLE001 - any failure means "not this path", agreed below
            reason = f"rank {rank}: {e!r}"
        payloads: list = [None] * world
        dist.all_gather_object(payloads, payload, group=group)
        peers: list[torch.Tensor] = []
        if reason is None:
            try:
                missing = [r for r, p in enumerate(payloads) if p is None]
                if missing:
                    raise RuntimeError(f"ranks {missing} could not allocate a peer buffer")
                if len({p[0] for p in payloads}) > 1:
                    raise RuntimeError("ranks span several hosts")
                for r, (_host, dev, (rebuild, args)) in enumerate(payloads):
                    if r == rank:
                        peers.append(buffer)
                        continue
                    if not torch.cuda.can_device_access_peer(device.index, dev):
                        raise RuntimeError(f"cuda:{device.index} cannot access cuda:{dev}")
                    _enable_peer_access(device.index, dev)  # before the mapping is opened
                    peers.append(rebuild(*args))
                torch.cuda.synchronize(device)
                self = cls(rank, world, buffer, peers, layout.max_bytes, group)
            except Exception as e:  # noqa: BLE001
                reason = f"rank {rank}: {e!r}"
        if not _agree(reason, group):
            return None
        dist.barrier(group=group)  # every rank's epochs and flags exist before anyone writes to a peer
        if check:
            reason = self._self_check()
            if not _agree(reason, group):
                return None
        return self

    def _self_check(self) -> str | None:
        """One real all-reduce of known values (a peer that cannot be written shows up here, once)."""
        try:
            # two tokens of hidden state: compiles the variant that decode steps use, outside any graph capture
            x = torch.full((2, 2560), float(self.rank + 1), dtype=torch.bfloat16, device=self.buffer.device)
            self(x)
            want = self.world * (self.world + 1) / 2
            if self.failed() or not bool((x == want).all()):
                return f"rank {self.rank}: self-check sum wrong or timed out"
        except Exception as e:  # noqa: BLE001
            return f"rank {self.rank}: {e!r}"
        return None

    # ---- use ----------------------------------------------------------------------------------------------
    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype in DTYPES and x.numel() * x.element_size() <= self.layout.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fits(x):
            dist.all_reduce(x, group=self.group)
            return x
        y = x if x.is_contiguous() else x.contiguous()
        self.launch(y, y)
        if y is not x:
            x.copy_(y)
        return x

    def launch(self, x: torch.Tensor, out: torch.Tensor, push: bool = True, reduce: bool = True,
               max_spin: int = MAX_SPIN) -> None:
        n = x.numel()
        _one_shot_kernel[(triton.cdiv(n, BLOCK),)](
            x, out, self._data[x.dtype], self.flags, self.deltas, self.epochs, self.error, n,
            self.layout.max_bytes // x.element_size(),
            RANK=self.rank, WORLD=self.world, BLOCK=BLOCK, PUSH=push, REDUCE=reduce, MAX_SPIN=max_spin,
            num_warps=4)

    def failed(self) -> bool:
        """True once any call timed out waiting for a peer (host sync: call it outside the hot loop)."""
        return bool(self.error.item())


def _cudart():
    """The CUDA runtime library this process already loaded for torch (found in /proc/self/maps)."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        raise RuntimeError("libcudart is not loaded")
    return ctypes.CDLL(sorted(paths)[0])


def _enable_peer_access(device: int, peer: int) -> None:
    """Let kernels on `device` address memory of `peer` (cudaDeviceEnablePeerAccess from device's context).

    A peer's IPC buffer is opened on the peer's device, and torch enables access between a pair of devices
    only in the direction its own copies need; the kernel on this device reads and writes the peer's memory
    directly, so this direction must be on, or the first store is an illegal address (seen on 2 x H200)."""
    rt = _cudart()
    prev = torch.cuda.current_device()
    torch.cuda.set_device(device)
    try:
        err = rt.cudaDeviceEnablePeerAccess(peer, 0)
    finally:
        torch.cuda.set_device(prev)
    if err not in (0, 704):  # 704: cudaErrorPeerAccessAlreadyEnabled
        raise RuntimeError(f"cudaDeviceEnablePeerAccess(cuda:{device} -> cuda:{peer}) failed with error {err}")


def _agree(reason: str | None, group) -> bool:
    """All ranks learn whether any rank failed; the first reason is logged."""
    reasons: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, reason, group=group)
    bad = [r for r in reasons if r]
    if bad:
        log.warning("peer all-reduce not used (the process group's all-reduce serves): %s", bad[0])
    return not bad


def make_all_reduce(group=None):
    """The all-reduce a tensor-parallel rank should use: `LINGLS_ALLREDUCE` = nccl | peer (default: nccl).
    Collective on NCCL groups: every rank must call it at the same point.

    NCCL spends ~20 us on each of a decode step's 84 small all-reduces (measured: bench/results/tp_gpu.json),
    which one kernel writing into peer memory should cut to a few. But on its first run on two H200s
    (bench/tp_session.sh) the peer kernel hit an illegal address during setup, also with peer access enabled
    explicitly, and a kernel fault kills the CUDA context where no fallback can help; so the peer path is opt-in
    (`peer`) until it has run clean there. With `peer`, every rank falls back to the process group's own
    all-reduce when any rank lacks CUDA, Triton, peer access or a shared host, or gets a wrong sum or a timeout
    in the self-check."""
    mode = os.environ.get("LINGLS_ALLREDUCE", "nccl").lower()
    if mode not in ("peer", "nccl"):
        raise ValueError(f"LINGLS_ALLREDUCE must be peer or nccl, got {mode!r}")

    def plain(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    if mode == "nccl" or dist.get_world_size(group) == 1 or "nccl" not in dist.get_backend(group):
        return plain
    return PeerAllReduce.create(group) or plain  # None: some rank could not, and every rank logged why
