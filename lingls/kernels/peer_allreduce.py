"""One-shot all-reduce over peer GPU memory, for the small messages of batch-1 tensor parallelism.

Why: at batch 1 every all-reduce carries one to sixteen tokens' hidden states (2560 bf16 = 5 KB per token), and
NCCL takes ~22 us for that on two NVLinked H200s even inside a CUDA graph. A Ling-3.0-flash step does 84 of them
(two per layer), 1.85 ms: more than the whole TP=2 byte floor of the step. The message is tiny, so the right
algorithm is latency-bound, not bandwidth-bound: every rank pushes its partial straight into every peer's memory,
raises a flag there, waits for its peers' flags in its own memory, and sums. One kernel launch, one NVLink trip.

How:
- Each rank allocates one receive buffer (`_Layout`): flag words [MAX_PROGRAMS, WORLD] int64, then data
  [2 parities, WORLD slots, slot_bytes], as a cudaMalloc allocation of its own. Its CUDA IPC handle
  (cudaIpcGetMemHandle, 64 bytes) goes to the peers over torch.distributed (`all_gather_object`), and each rank
  opens its peers' handles with its OWN device current (cudaIpcOpenMemHandle with lazy peer access), so the
  mappings live in the context whose kernels use them. (The first version rebuilt torch's shared CUDA tensors,
  which maps them in the peer device's context; its kernel faulted on its first access on 2 x H200, with or
  without peer access enabled; the context is the likely cause, not yet confirmed: bench/peer_probe.py tests
  the new mapping step by step.) The runtime is called through ctypes on the libcudart torch loaded; the own buffer
  becomes a tensor through DLPack.
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
- Every all-reduce in a layer is followed by the residual add and the next RMSNorm. `add_rms_norm` does all
  three in one launch (`_one_shot_add_norm_kernel`, one program per token row, so the norm's sum of squares
  stays in the program) with the same bits as the two kernels, saving a launch per all-reduce (84 per step).
  It runs on its own channel of the buffer (flags, slots, epochs), because it splits a message by rows and
  the plain kernel by BLOCK elements: sharing epochs would let a fast rank reuse a slot a peer still reads.
- A bounded spin: a peer that never arrives (dead process, mismatched calls) sets `error` instead of hanging
  the GPU forever; `failed()` reads it.

`make_all_reduce` (used by `serve.tensor_parallel.make_parallel`) picks this or the process group's own all-reduce
(NCCL on GPUs, gloo on CPU). Messages bigger than the buffer, or of other dtypes, take the fallback; since
every rank sees the same shapes, every rank takes the same path.

Not used: torch.distributed._symmetric_memory (its rendezvous hung on the lent machines), NVLink multicast
(kept off on shared machines).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.dlpack

try:
    import triton
    import triton.language as tl

    from lingls.kernels.norm import NUM_WARPS as NORM_WARPS
    from lingls.kernels.norm import add_rms_norm_row
except ImportError:  # CPU-only installs: the fallback serves there
    triton = tl = None

log = logging.getLogger(__name__)

BLOCK = 1024  # elements per program (2 KB of bf16: 16-byte vectors over 4 warps)
MAX_SPIN = 1 << 24  # flag polls before a program gives up (~10 s or more: far beyond any legitimate skew)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHANNELS = 2  # 0: the plain all-reduce; 1: all-reduce + residual add + RMSNorm (one program per row)


@dataclass(frozen=True)
class _Layout:
    """Byte layout of one rank's receive buffer: `CHANNELS` independent channels, each its flag words then its
    data. A channel's programs keep their own epochs, so two kernels that split messages differently (the plain
    all-reduce by BLOCK elements, the fused add + RMSNorm by rows) never meet in one flag or slot."""

    world: int
    max_bytes: int  # per slot: the largest message, in bytes

    @property
    def max_programs(self) -> int:
        return -(-self.max_bytes // (BLOCK * 2))  # a program moves BLOCK elements of >= 2 bytes

    @property
    def flag_bytes(self) -> int:
        return -(-self.max_programs * self.world * 8 // 256) * 256  # data starts 256-byte aligned

    @property
    def channel_bytes(self) -> int:
        return self.flag_bytes + 2 * self.world * self.max_bytes

    @property
    def total(self) -> int:
        return CHANNELS * self.channel_bytes


if triton is not None:

    @triton.jit
    def _push(x, offs, mask, pid, e, parity, data_ptr, flag_ptr, delta_ptr, slot_elems,
              RANK: tl.constexpr, WORLD: tl.constexpr):
        """Store x into this rank's slot of every peer's buffer (parity e % 2), then raise flag (pid, RANK)
        there to epoch e, with release semantics once every thread's stores are issued."""
        esize: tl.constexpr = x.dtype.primitive_bitwidth // 8
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

    @triton.jit
    def _wait_and_sum(x, offs, mask, pid, e, parity, data_ptr, flag_ptr, error_ptr, slot_elems,
                      RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, MAX_SPIN: tl.constexpr):
        """Wait (bounded) for every peer's flag (pid, r) to reach epoch e, then the fp32 sum of all ranks'
        slices in rank order 0..WORLD-1 (x for this rank's own): the same bits on every rank."""
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
        for r in tl.static_range(WORLD):
            if r == RANK:
                acc += x.to(tl.float32)
            else:
                slot = tl.multiple_of((parity * WORLD + r) * slot_elems, 128)
                acc += tl.load(data_ptr + slot + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
        return acc

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
        x = tl.load(x_ptr + offs, mask=mask)
        if PUSH:
            _push(x, offs, mask, pid, e, parity, data_ptr, flag_ptr, delta_ptr, slot_elems, RANK, WORLD)
        if REDUCE:
            acc = _wait_and_sum(x, offs, mask, pid, e, parity, data_ptr, flag_ptr, error_ptr, slot_elems, RANK,
                                WORLD, BLOCK, MAX_SPIN)
            tl.store(out_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=mask)
            tl.store(epochs_ptr + pid, e)

    @triton.jit
    def _one_shot_add_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, data_ptr, flag_ptr, delta_ptr, epochs_ptr,
                                  error_ptr, N, slot_elems, eps, RANK: tl.constexpr, WORLD: tl.constexpr,
                                  BLOCK: tl.constexpr, PUSH: tl.constexpr, REDUCE: tl.constexpr,
                                  MAX_SPIN: tl.constexpr, USE_PDL: tl.constexpr):
        """Row `program_id` of x [T, N]: a = sum over ranks of x (rounded to x's dtype, as the plain all-reduce
        leaves it), then `norm.add_rms_norm_row`: h = a + residual (rounded, written back to the residual),
        out = w * rms_norm(h). The same bits as the all-reduce followed by the norm kernel (same row code, same
        warps), in one launch: a whole row per program, so the norm's sum of squares never leaves the program.
        Flags, slots and epochs are those of `_one_shot_kernel`, on channel 1 of the receive buffer."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        offs = row * N + cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: loaded before the wait
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        e = tl.load(epochs_ptr + row) + 1
        parity = e % 2
        x = tl.load(x_ptr + offs, mask=mask)
        if PUSH:
            _push(x, offs, mask, row, e, parity, data_ptr, flag_ptr, delta_ptr, slot_elems, RANK, WORLD)
        if REDUCE:
            acc = _wait_and_sum(x, offs, mask, row, e, parity, data_ptr, flag_ptr, error_ptr, slot_elems, RANK,
                                WORLD, BLOCK, MAX_SPIN)
            add_rms_norm_row(acc.to(x_ptr.dtype.element_ty), res_ptr + row * N, w, out_ptr + row * N, cols, mask,
                              N, eps, True)
            tl.store(epochs_ptr + row, e)


class PeerAllReduce:
    """Sum-all-reduce of a small CUDA tensor across the ranks of `group` (one process per GPU, one host).

    Build it collectively with `PeerAllReduce.create(group)`, which returns None on every rank when any rank
    cannot take part (then use the process group's all-reduce). Calling it reduces in place and returns x,
    like `dist.all_reduce`; messages it cannot take go to `dist.all_reduce`.

    `buffer` is this rank's receive buffer (uint8, `_Layout(world, max_bytes).total` bytes, zeroed, 512-byte
    aligned); `peers[r]` is rank r's receive buffer as this process addresses it: an int address (or a tensor,
    whose data_ptr() is taken), mapped so that kernels on this rank's device may read and write it."""

    def __init__(self, rank: int, world: int, buffer: torch.Tensor, peers: list, max_bytes: int, group=None):
        if max_bytes % 512:
            raise ValueError(f"max_bytes must be a multiple of 512 (the kernel's alignment hints), got {max_bytes}")
        self.rank, self.world, self.group = rank, world, group
        self.layout = _Layout(world, max_bytes)
        self.buffer = buffer
        self._mapping = None  # create(): what close() gives back (own allocation, opened peer mappings)
        device = buffer.device
        base = buffer.data_ptr()
        addresses = [p if isinstance(p, int) else p.data_ptr() for p in peers]
        deltas = [a - base for a in addresses]
        if len(deltas) != world or deltas[rank] != 0:
            raise ValueError("peers must list every rank's buffer, this rank's own at its rank")
        if any(d % 512 for d in deltas):
            raise ValueError("peer buffers are not 512-byte aligned")
        self.deltas = torch.tensor(deltas, dtype=torch.int64, device=device)
        self.flags, self._data, self.epochs = self._channel(0)
        self.norm_flags, self._norm_data, self.norm_epochs = self._channel(1)
        self.error = torch.zeros(1, dtype=torch.int32, device=device)

    def _channel(self, c: int):
        """Channel c's flag words, its data (one view per dtype) and its programs' epochs (never wrap)."""
        lay = self.layout
        chunk = self.buffer[c * lay.channel_bytes:(c + 1) * lay.channel_bytes]
        epochs = torch.zeros(lay.max_programs, dtype=torch.int64, device=self.buffer.device)
        return chunk[:lay.flag_bytes].view(torch.int64), {dt: chunk[lay.flag_bytes:].view(dt) for dt in DTYPES}, epochs

    # ---- setup --------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, group=None, max_elems: int = 16 * 4096, dtype: torch.dtype = torch.bfloat16,
               check: bool = True) -> "PeerAllReduce | None":
        """Collective: every rank of `group` must call it. Returns the same kind of answer on every rank.

        Each rank cudaMallocs its receive buffer (its own allocation: an IPC handle covers a whole allocation,
        and torch's caching allocator sub-allocates, or uses expandable segments that cudaIpcGetMemHandle
        refuses) and exports it with cudaIpcGetMemHandle; the handles travel as bytes; each rank opens its
        peers' handles with ITS OWN device current (cudaIpcOpenMemHandle, lazy peer access), so the mappings
        live in the context that runs the kernel. (torch's own rebuild of a shared CUDA tensor opens it with
        the peer's device current; the kernel of the version that used it faulted on 2 x H200.)"""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        reason = None
        payload = None
        layout = _Layout(world, -(-max_elems * torch.tensor([], dtype=dtype).element_size() // 512) * 512)
        cuda = device = own = None
        opened: list[int] = []
        try:
            if triton is None:
                raise RuntimeError("triton is not installed")
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA")
            device = torch.device("cuda", torch.cuda.current_device())
            cuda = _cuda()
            own = cuda.malloc(device.index, -(-layout.total // _ALLOC_ROUND) * _ALLOC_ROUND)  # zeroed, synced
            handle, offset = cuda.ipc_handle(device.index, own)
            payload = (socket.gethostname(), device.index, handle, offset)
        except Exception as e:  # noqa: BLE001 - any failure means "not this path", agreed below
            reason = f"rank {rank}: {e!r}"
        payloads: list = [None] * world
        dist.all_gather_object(payloads, payload, group=group)
        self = None
        if reason is None:
            try:
                missing = [r for r, p in enumerate(payloads) if p is None]
                if missing:
                    raise RuntimeError(f"ranks {missing} could not allocate a peer buffer")
                if len({p[0] for p in payloads}) > 1:
                    raise RuntimeError("ranks span several hosts")
                addresses = []
                for r, (_host, dev, handle, offset) in enumerate(payloads):
                    if r == rank:
                        addresses.append(own)
                        continue
                    if dev != device.index and not torch.cuda.can_device_access_peer(device.index, dev):
                        raise RuntimeError(f"cuda:{device.index} cannot access cuda:{dev}")
                    base = cuda.ipc_open(device.index, handle)  # mapped in this device's context
                    opened.append(base)
                    addresses.append(base + offset)
                buffer = _device_view(own, layout.total, device)
                self = cls(rank, world, buffer, addresses, layout.max_bytes, group)
                self._mapping = (cuda, device.index, own, opened)
                torch.cuda.synchronize(device)
            except Exception as e:  # noqa: BLE001
                reason = f"rank {rank}: {e!r}"
        if not _agree(reason, group):
            if self is not None:
                self.close()
            elif cuda is not None:  # no kernel ran: nobody writes into these any more
                _release(cuda, device.index, own, opened)
            return None
        dist.barrier(group=group)  # every rank's epochs and flags exist before anyone writes to a peer
        if check:
            reason = self._self_check()
            if not _agree(reason, group):
                return None  # the mappings stay open: a peer may still be inside its half of the check
        return self

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's. Collective in spirit: call it on every rank after
        every rank's last all-reduce has completed (a barrier after a synchronize), or a peer may still write
        here. Unneeded at process exit."""
        mapping, self._mapping = self._mapping, None
        if mapping is None:
            return
        cuda, device, own, opened = mapping
        torch.cuda.synchronize(device)
        self.buffer = self.flags = self._data = self.norm_flags = self._norm_data = None
        _release(cuda, device, own, opened)

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
        if n * x.element_size() > self.layout.max_bytes or x.dtype not in DTYPES:
            raise ValueError(f"{n} x {x.dtype} does not fit the peer buffers ({self.layout.max_bytes} bytes)")
        _one_shot_kernel[(triton.cdiv(n, BLOCK),)](
            x, out, self._data[x.dtype], self.flags, self.deltas, self.epochs, self.error, n,
            self.layout.max_bytes // x.element_size(),
            RANK=self.rank, WORLD=self.world, BLOCK=BLOCK, PUSH=push, REDUCE=reduce, MAX_SPIN=max_spin,
            num_warps=4)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     pdl: bool = False):
        """`norm.add_rms_norm(all_reduce(x), residual, weight, eps)` in one launch, bit for bit: returns (normed,
        residual), residual updated in place. The kernel leaves x as it was; messages the buffer cannot take go
        through the two-step form, which reduces x in place. pdl: programmatic dependent launch (the norm
        weight is loaded before waiting for the previous kernel)."""
        from lingls.kernels.norm import add_rms_norm

        if not (self.fits(x) and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous()
                and residual.dtype == x.dtype and x.shape[0] <= self.layout.max_programs):
            return add_rms_norm(self(x), residual, weight, eps, pdl=pdl)
        return self.launch_add_norm(x, residual, weight, eps, pdl=pdl), residual

    def launch_add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        pdl: bool = False, push: bool = True, reduce: bool = True,
                        max_spin: int = MAX_SPIN) -> torch.Tensor:
        """The kernel of `add_rms_norm`, unchecked (tests run its halves apart, as `launch`'s)."""
        t, n = x.shape
        out = torch.empty(t, n, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
        pdl = pdl and x.is_cuda
        _one_shot_add_norm_kernel[(t,)](
            x, residual, weight, out, self._norm_data[x.dtype], self.norm_flags, self.deltas, self.norm_epochs,
            self.error, n, self.layout.max_bytes // x.element_size(), float(eps), RANK=self.rank, WORLD=self.world,
            BLOCK=triton.next_power_of_2(n), PUSH=push, REDUCE=reduce, MAX_SPIN=max_spin, USE_PDL=pdl,
            num_warps=NORM_WARPS, **({"launch_pdl": True} if pdl else {}))
        return out

    def failed(self) -> bool:
        """True once any call timed out waiting for a peer (host sync: call it outside the hot loop)."""
        return bool(self.error.item())


# ---- CUDA runtime through ctypes ------------------------------------------------------------------------------
_ALLOC_ROUND = 2 << 20  # receive buffers are whole 2 MiB allocations: nothing else shares what a handle exports
_IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]  # cudaIpcMemHandle_t: CUDA_IPC_HANDLE_SIZE bytes, by value


def _cudart():
    """The CUDA runtime library this process already loaded for torch (found in /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        raise RuntimeError("libcudart is not loaded")
    return ctypes.CDLL(sorted(paths)[0])


class _Cuda:
    """The few runtime calls the peer mapping needs, with their C signatures; every call names its device and
    puts the previous current device back. A failed call raises, and its error is cleared from the runtime's
    last-error slot (or torch's next kernel launch check would report it)."""

    def __init__(self, lib=None):
        c = ctypes
        self.lib = lib = lib or _cudart()
        sigs = {
            "cudaGetDevice": [c.POINTER(c.c_int)],
            "cudaSetDevice": [c.c_int],
            "cudaMalloc": [c.POINTER(c.c_void_p), c.c_size_t],
            "cudaFree": [c.c_void_p],
            "cudaMemset": [c.c_void_p, c.c_int, c.c_size_t],
            "cudaDeviceSynchronize": [],
            "cudaGetLastError": [],
            "cudaIpcGetMemHandle": [c.POINTER(_IpcMemHandle), c.c_void_p],
            "cudaIpcOpenMemHandle": [c.POINTER(c.c_void_p), _IpcMemHandle, c.c_uint],
            "cudaIpcCloseMemHandle": [c.c_void_p],
        }
        self.fn = {}
        for name, args in sigs.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, c.c_int
            self.fn[name] = f
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [c.c_int], c.c_char_p

    def check(self, err: int, what: str) -> None:
        if err:
            self.fn["cudaGetLastError"]()
            raise RuntimeError(f"{what} failed: error {err} ({self.lib.cudaGetErrorString(err).decode()})")

    def on(self, device: int, name: str, *args) -> None:
        """fn name(*args) with `device` current."""
        prev = ctypes.c_int(-1)
        self.check(self.fn["cudaGetDevice"](ctypes.byref(prev)), "cudaGetDevice")
        self.check(self.fn["cudaSetDevice"](device), f"cudaSetDevice({device})")
        try:
            self.check(self.fn[name](*args), f"{name} on cuda:{device}")
        finally:
            self.fn["cudaSetDevice"](prev.value)

    def malloc(self, device: int, nbytes: int) -> int:
        """A zeroed allocation of its own (cudaMalloc), complete before this returns."""
        ptr = ctypes.c_void_p()
        self.on(device, "cudaMalloc", ctypes.byref(ptr), nbytes)
        try:
            self.on(device, "cudaMemset", ptr, 0, nbytes)
            self.on(device, "cudaDeviceSynchronize")
        except Exception:
            self.on(device, "cudaFree", ptr)
            raise
        return ptr.value

    def ipc_handle(self, device: int, ptr: int) -> tuple[bytes, int]:
        """(handle, offset): the handle exports the allocation that holds ptr, which starts offset bytes before
        ptr (0 for a cudaMalloc'd pointer; asked of the driver where it can tell)."""
        handle = _IpcMemHandle()
        self.on(device, "cudaIpcGetMemHandle", ctypes.byref(handle), ctypes.c_void_p(ptr))
        return ctypes.string_at(ctypes.addressof(handle), 64), ptr - _range_start(ptr)  # all 64 bytes, NULs too

    def ipc_open(self, device: int, handle: bytes) -> int:
        """Map a peer's exported allocation into `device`'s context; its base address there."""
        if len(handle) != 64:
            raise ValueError(f"an IPC handle has 64 bytes, got {len(handle)}")
        h = _IpcMemHandle.from_buffer_copy(handle)
        ptr = ctypes.c_void_p()
        self.on(device, "cudaIpcOpenMemHandle", ctypes.byref(ptr), h, _IPC_LAZY_ENABLE_PEER_ACCESS)
        return ptr.value


_CUDA: _Cuda | None = None


def _cuda() -> _Cuda:
    global _CUDA
    if _CUDA is None:
        _CUDA = _Cuda()
    return _CUDA


def _range_start(ptr: int) -> int:
    """Start of the allocation holding ptr (cuMemGetAddressRange; ptr itself when the driver cannot say)."""
    try:
        drv = ctypes.CDLL("libcuda.so.1")
        f = drv.cuMemGetAddressRange_v2
        f.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        f.restype = ctypes.c_int
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        if f(ctypes.byref(base), ctypes.byref(size), ptr) == 0 and base.value <= ptr < base.value + size.value:
            return base.value
    except (OSError, AttributeError):
        pass
    return ptr


def _release(cuda: _Cuda, device: int, own: int | None, opened: list[int]) -> None:
    for ptr in opened:
        try:
            cuda.on(device, "cudaIpcCloseMemHandle", ctypes.c_void_p(ptr))
        except RuntimeError as e:
            log.warning("peer all-reduce: %s", e)
    if own is not None:
        try:
            cuda.on(device, "cudaFree", ctypes.c_void_p(own))
        except RuntimeError as e:
            log.warning("peer all-reduce: %s", e)


# ---- a tensor over memory torch did not allocate (DLPack, no copy) --------------------------------------------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_DL_KEEP: list = []  # the structs torch reads (deleter slot included) live as long as the process: a few per process


def _device_view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over [ptr, ptr + nbytes) that torch treats as memory of `device` (kDLCUDA with the
    device's index: torch asks no pointer attributes, so a peer's mapping opened in this device's context is
    labelled this device, where it is addressable). torch never frees it: the caller owns the memory."""
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"no view on {device}")
    shape, strides = (ctypes.c_int64 * 1)(nbytes), (ctypes.c_int64 * 1)(1)
    m = _DLManagedTensor()
    m.dl_tensor.data = ptr
    m.dl_tensor.device = _DLDevice(2 if device.type == "cuda" else 1,
                                   (device.index if device.index is not None else torch.cuda.current_device())
                                   if device.type == "cuda" else 0)
    m.dl_tensor.ndim = 1
    m.dl_tensor.dtype = _DLDataType(1, 8, 1)  # kDLUInt, 8 bits
    m.dl_tensor.shape, m.dl_tensor.strides, m.dl_tensor.byte_offset = shape, strides, 0
    m.manager_ctx = m.deleter = None
    _DL_KEEP.append((m, shape, strides))
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.argtypes, new_capsule.restype = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p], ctypes.py_object
    t = torch.utils.dlpack.from_dlpack(new_capsule(ctypes.addressof(m), b"dltensor", None))
    if t.data_ptr() != ptr or t.numel() != nbytes or t.device.type != device.type:
        raise RuntimeError(f"DLPack view came back as {t.device} at {t.data_ptr():#x}, asked {device} at {ptr:#x}")
    return t


def _agree(reason: str | None, group) -> bool:
    """All ranks learn whether any rank failed; the first reason is logged."""
    reasons: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, reason, group=group)
    bad = [r for r in reasons if r]
    if bad:
        log.warning("peer all-reduce not used (the process group's all-reduce serves): %s", bad[0])
    return not bad


def make_all_reduce(group=None):
    """The all-reduce a tensor-parallel rank should use: `LINGLS_ALLREDUCE` = peer | nccl (default: peer where
    possible). Collective on NCCL groups: every rank must call it at the same point.

    Measured on 2 x H200 inside CUDA graphs (bench/results/peer_probe.json, tp_gpu.json): NCCL 19-22 us per
    all-reduce of one to nine tokens' hidden state, this kernel 3.7-4.2 us, bit-identical to NCCL over 1000
    calls; a decode step does 84 of them. (Its first version mapped the peers in the peer device's context and
    faulted there; peers are now opened with the own device current.) Every rank falls back to the process
    group's own all-reduce when any rank lacks CUDA, Triton, peer access or a shared host, or gets a wrong sum
    or a timeout in the self-check; `nccl` forces that fallback."""
    mode = os.environ.get("LINGLS_ALLREDUCE", "peer").lower()
    if mode not in ("peer", "nccl"):
        raise ValueError(f"LINGLS_ALLREDUCE must be peer or nccl, got {mode!r}")

    def plain(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    if mode == "nccl" or dist.get_world_size(group) == 1 or "nccl" not in dist.get_backend(group):
        return plain
    return PeerAllReduce.create(group) or plain  # None: some rank could not, and every rank logged why
