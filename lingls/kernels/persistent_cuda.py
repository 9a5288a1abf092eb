"""The persistent KDA + MoE layer as a warp-specialised CUDA C++ kernel (csrc/persistent_layer.cu).

Runs the task tables of `persistent.build_schedule(shape, programs, norm_tasks=False, local_route=True)`
(proven by `persistent.check_schedule` and `persistent.check_loader`) with one CTA per SM: a loader warp
streams every task's weights into a ring of shared-memory stages with 1-D bulk async copies, running ahead of
the consumers across task boundaries, and eight consumer warps wait for a stage and the task's input counters,
multiply from shared memory and signal. There is no task for the RMSNorms or the routing: every CTA that needs
a normed input recomputes it from the residual stream, and every CTA that hosts routed tasks routes for
itself from the router's logits and then issues all its routed experts' copies at once. Why: the Triton kernel
of `persistent` held one task's weights in flight per SM, 2.1x slower than the chain of launches, and the
first version of this runner (norm and routing tasks, one CTA routing for all) spent its time in those hops
(docs/kernel-log.md).

The source is compiled on first use with nvcc (sm_90a) into a shared library cached under
~/.cache/lingls/persistent/ and launched through ctypes on the current stream, so a CUDA graph captures it.
Importing this module needs neither CUDA nor nvcc; `layer_reference` in `persistent` is the CPU path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from lingls.kernels import persistent as pk

SOURCE = Path(__file__).with_name("csrc") / "persistent_layer.cu"
SMEM_LIMIT = 227 * 1024  # a Hopper block's dynamic shared memory
MAX_STAGES = 8
CONSUMERS = 256  # the kernel's consumer threads
RED_FLOATS = 8 * 32 + 32 + 8
MAX_TOPK = 16  # the routing the kernel keeps in shared memory (then one int: the tasks ended)
GEMV_ROWS = (8, 16, 32)  # the row counts the kernel's GEMV is instantiated for (a warp per row)
# stages in flight per SM: the bytes a loader has requested queue ahead of its consumers' own loads (inputs,
# polls) on the way back to the SM, so more in flight than the bandwidth needs makes every dependent step
# slower (first H200 run, a full ring of 5 x 40 KB in flight: 84 us per layer; see docs/kernel-log.md)
INFLIGHT = 1
# kinds whose copies may fill the whole ring regardless (the projection at the layer's start, the routed
# experts the moment the CTA's routing is known: `bench/persistent_layer_gpu.py`'s cuda_free); none by
# default, as measured: with every copy in flight at once, every L2 round trip of the layer's hops queued
# behind them (60.6 us per layer against 57.0 us limited, seventeenth session)
FREE_KINDS = ()
NVCC_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC"]

_ptr = ctypes.c_void_p
_POINTERS = ["tasks", "cnt", "stamps", "h", "out", "in_norm", "proj", "conv_w", "a_log", "dt_bias", "o_norm", "o_proj",
             "post_norm", "router", "expert_bias", "gate_up", "down", "sgu", "sdn", "state", "conv", "p", "o", "a",
             "logits", "topk_w", "topk_i", "act"]
_FLOATS = ["eps", "q_scale", "lower_bound", "scale", "limit", "shared_limit"]
_INTS = ["H", "NH", "D", "E", "I", "I_S", "I_PAD", "TOP_K", "G", "TOPK_GROUP", "proj_rows", "oproj_rows",
         "router_rows", "gu_rows", "down_rows", "max_tasks", "programs", "epoch", "done", "router_counter",
         "router_need", "stages", "stage_bytes", "scratch_floats", "timeline", "inflight", "free_kinds", "kda_quiet"]


class _Params(ctypes.Structure):
    """The kernel's `Params`, field for field (the library checks the size)."""
    _fields_ = ([(n, _ptr) for n in _POINTERS] + [(n, ctypes.c_float) for n in _FLOATS]
                + [(n, ctypes.c_int) for n in _INTS])


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """The kernel's shared memory for a schedule: `stages` stages of `stage_bytes` (the largest task's bytes)."""
    stages: int
    stage_bytes: int
    scratch_floats: int
    smem_bytes: int


def _up(n: int, to: int = 16) -> int:
    return -(-n // to) * to


def stage_bytes_by_kind(shape: pk.LayerShape) -> dict:
    """Bytes the loader copies into one stage per task kind (a KDA head takes two stages: half its state each)."""
    s, H, C = shape, shape.hidden, shape.channels
    return {pk.PROJ: s.proj_rows * H * 2, pk.OPROJ: s.oproj_rows * C * 2, pk.ROUTER: s.router_rows * H * 2,
            pk.SHARED_GU: 2 * s.gu_rows * H * 2, pk.EXPERT_GU: 2 * s.gu_rows * H * 2,
            pk.DOWN: s.down_rows * (s.shared_inter + s.top_k * s.inter) * 2, pk.KDA: s.head_dim // 2 * s.head_dim * 4}


def smem_plan(schedule: pk.Schedule) -> RingPlan:
    """As many stages as fit (at most MAX_STAGES), after the input vector, partials, scratch and task list."""
    s = schedule.shape
    stage = _up(max(stage_bytes_by_kind(s).values()), 128)
    scratch = max(5 * s.head_dim + 2 * CONSUMERS, 2 * s.experts + 2 * s.n_group)
    acts = (1 + s.top_k) * max(s.inter, s.shared_inter)
    rest = (_up(max(s.hidden, s.channels) * 2) + RED_FLOATS * 4 + _up(scratch * 4) + _up(acts * 4)
            + _up(schedule.max_tasks * pk.FIELDS * 4) + 16 + _up(4 * (2 + 2 * MAX_TOPK)))
    stages = min(MAX_STAGES, (SMEM_LIMIT - rest - 16 * MAX_STAGES) // stage)
    if stages < 2:
        raise ValueError(f"a stage of {stage} bytes leaves room for {stages} stages; the KDA task needs 2")
    return RingPlan(stages, stage, scratch, stages * stage + rest + 16 * stages)


def check_supported(schedule: pk.Schedule) -> None:
    """Refuse, with the reason, a schedule or shape the kernel does not run."""
    s = schedule.shape
    if not schedule.local_route:
        raise ValueError("the CUDA runner runs local_route schedules (norms recomputed, routing on every SM)")
    if s.top_k > MAX_TOPK:
        raise ValueError(f"top_k must be at most {MAX_TOPK}")
    for name, rows in (("proj_rows", s.proj_rows), ("oproj_rows", s.oproj_rows), ("router_rows", s.router_rows),
                       ("2 * gu_rows", 2 * s.gu_rows)):
        if rows not in GEMV_ROWS:
            raise ValueError(f"{name} = {rows}: the kernel's GEMV takes {GEMV_ROWS} rows")
    if s.down_rows > 32:
        raise ValueError("down_rows must be at most 32")
    if s.hidden % s.oproj_rows or s.experts % s.router_rows or s.hidden % s.down_rows:
        raise ValueError("the output projection's, router's and down rows must split into whole tiles")
    if s.hidden % 8 or s.channels % 8 or s.inter % 8 or s.shared_inter % 8:
        raise ValueError("hidden, channels and the experts' widths must be multiples of 8 (16-byte copies)")
    if CONSUMERS % s.head_dim or 2 * s.head_dim > CONSUMERS or s.head_dim % 2:
        raise ValueError(f"head_dim must divide {CONSUMERS} and be at most {CONSUMERS // 2}")
    if max(s.hidden, s.channels) > 8 * 2 * CONSUMERS or s.experts > 4 * CONSUMERS:
        raise ValueError("hidden and heads * head_dim must be at most 4096, experts at most 1024")
    if (1 + s.top_k) * max(s.inter, s.shared_inter) > 8 * CONSUMERS:
        raise ValueError("(1 + top_k) * the experts' width must be at most 2048 (the DOWN tasks' activations)")
    pk.check_loader(schedule)


def _build() -> Path:
    """The shared library for this source, compiled once per source and flags (cached by their hash)."""
    if not SOURCE.exists():
        raise RuntimeError(f"{SOURCE} is missing from this install: the CUDA persistent layer cannot be built")
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(NVCC_FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("LINGLS_CACHE", Path.home() / ".cache" / "lingls")) / "persistent"
    lib = cache / f"persistent_layer_{digest}.so"
    if lib.exists():
        return lib
    nvcc = shutil.which("nvcc") or (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")
    if not Path(nvcc).exists():
        raise RuntimeError("the CUDA persistent layer needs nvcc (CUDA 12.3+) to build its kernel")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build beside, then rename: no half-written library
        out = Path(tmp) / lib.name
        done = subprocess.run([str(nvcc), *NVCC_FLAGS, "-o", str(out), str(SOURCE)], capture_output=True, text=True,
                              check=False)
        if done.returncode:
            raise RuntimeError(f"nvcc failed on {SOURCE}:\n{done.stderr[-4000:]}")
        os.replace(out, lib)
    return lib


_LIB = None


def library() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(str(_build()))
        lib.lingls_persistent_layer.restype = ctypes.c_int
        lib.lingls_persistent_layer.argtypes = [ctypes.POINTER(_Params), ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                                ctypes.c_void_p]
        lib.lingls_persistent_params_size.restype = ctypes.c_size_t
        if lib.lingls_persistent_params_size() != ctypes.sizeof(_Params):
            raise RuntimeError("persistent_layer.cu's Params and persistent_cuda._Params differ")
        _LIB = lib
    return _LIB


def _check_tensors(h, out, w: pk.LayerWeights, state, conv_state, s: pk.LayerShape):
    if h.shape != (1, s.hidden) or out.shape != h.shape:
        raise ValueError(f"h and out must be [1, {s.hidden}], got {tuple(h.shape)}, {tuple(out.shape)}")
    if state.shape != (s.heads, s.head_dim, s.head_dim) or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 [{s.heads}, {s.head_dim}, {s.head_dim}]")
    fp32 = {"a_log", "dt_bias", "expert_bias"}
    for name, t in list(w._asdict().items()) + [("h", h), ("out", out), ("state", state), ("conv_state", conv_state)]:
        want = torch.float32 if name in fp32 or name == "state" else torch.bfloat16
        if t.dtype != want or not t.is_contiguous() or not t.is_cuda:
            raise ValueError(f"{name} must be a contiguous {want} CUDA tensor (got {t.dtype}, {t.device})")


def launch(h: torch.Tensor, out: torch.Tensor, w: pk.LayerWeights, state: torch.Tensor, conv_state: torch.Tensor,
           schedule: pk.Schedule, ws: pk.Workspace, table: torch.Tensor | None = None, timeline: bool = False,
           pdl: bool = True, inflight: int = INFLIGHT, free_kinds=FREE_KINDS, kda_quiet: bool = True) -> torch.Tensor:
    """The layer in one launch, as `persistent.persistent_layer`: h [1, H] -> out [1, H]; state and conv_state
    updated in place. `table`: the schedule's table on h's device (default: copied here). pdl: launched as a
    programmatic dependent launch, so its loader streams weights while the previous kernel finishes.
    inflight: ring stages the loader keeps in flight at once (at most the ring's stages), except for tasks of
    `free_kinds`, which may fill the whole ring. kda_quiet: the loader issues no copy past a KDA task until
    that task has ended."""
    s = schedule.shape
    check_supported(schedule)
    _check_tensors(h, out, w, state, conv_state, s)
    if table is None:
        table = schedule.table.to(h.device)
    plan = smem_plan(schedule)
    cnt = pk._counters(s)
    t = {"tasks": table, "cnt": ws.counters, "stamps": ws.stamps, "h": h, "out": out, "in_norm": w.in_norm,
         "proj": w.proj, "conv_w": w.conv, "a_log": w.a_log, "dt_bias": w.dt_bias, "o_norm": w.o_norm,
         "o_proj": w.o_proj, "post_norm": w.post_norm, "router": w.router, "expert_bias": w.expert_bias,
         "gate_up": w.gate_up, "down": w.down, "sgu": w.shared_gate_up, "sdn": w.shared_down, "state": state,
         "conv": conv_state, "p": ws.p, "o": ws.o, "a": ws.a, "logits": ws.logits, "topk_w": ws.topk_w,
         "topk_i": ws.topk_i, "act": ws.act}
    params = _Params(
        *(t[n].data_ptr() for n in _POINTERS),
        float(s.eps), s.head_dim ** -0.5, float(s.lower_bound), float(s.scale), float(s.limit), float(s.shared_limit),
        s.hidden, s.heads, s.head_dim, s.experts, s.inter, s.shared_inter, ws.act.shape[1], s.top_k, s.n_group,
        s.topk_group, s.proj_rows, s.oproj_rows, s.router_rows, s.gu_rows, s.down_rows, schedule.max_tasks,
        schedule.programs, schedule.epoch, schedule.done, cnt["router"], -(-s.experts // s.router_rows),
        plan.stages, plan.stage_bytes, plan.scratch_floats, int(timeline), max(1, min(inflight, plan.stages)),
        sum(1 << k for k in free_kinds), int(kda_quiet))
    err = library().lingls_persistent_layer(ctypes.byref(params), ctypes.sizeof(_Params), plan.smem_bytes, int(pdl),
                                            ctypes.c_void_p(torch.cuda.current_stream(h.device).cuda_stream))
    if err:
        raise RuntimeError(f"persistent layer launch failed (cudaError {err})")
    return out
