"""Quick two-GPU diagnostic of the peer all-reduce's memory mapping, stage by stage, that never hangs.

    OUT=... python3 bench/peer_probe.py [--limit 90]        (from the repo root, on a machine with 2 GPUs)

Stages, one line printed per stage and rank (`[probe] stage X rank R: OK|FAIL ...`):
  a_open          each rank cudaMallocs 2 MiB, fills it with a known pattern, swaps cudaIpcGetMemHandle handles
                  over gloo and opens the peer's with its OWN device current (cudaIpcOpenMemHandle, lazy peer
                  access): what lingls.runtime.peer_allreduce now does
  b_torch_copy    torch clones 16 KB out of the peer mapping (a DLPack view labelled this device)
  c1_load_raw     a Triton kernel loads from the peer mapping passed as a tensor (Triton checks the pointer)
  c2_load_delta   a Triton kernel loads from own pointer + delta (the way the all-reduce kernel addresses peers)
  d_store_delta   a Triton kernel stores into the peer (own pointer + delta) and raises a flag there with a
                  system-scope release atomic; the peer verifies both
  e_allreduce     PeerAllReduce.create() (with its self-check) and all-reduces of 1, 9, 16 x 2560 bf16, compared
                  bitwise with NCCL
  f_graph         200 back-to-back all-reduces captured in one CUDA graph, us per call, NCCL vs peer, 5 and 45 KB
                  (eager too), and the graph's peer result against NCCL's

A kernel fault kills its process's CUDA context, so: stages a-e run with CUDA_LAUNCH_BLOCKING=1 (a fault is
reported by the stage that caused it), every stage's line is printed and appended to OUT/peer_probe.rank*.jsonl
before the next starts, and when a pair of processes dies (or is killed for running past its limit) the next
pair starts after the stage that broke it (redoing a_open quietly first). f runs in its own pair without
CUDA_LAUNCH_BLOCKING (the timing is real), with the peer path only if e passed. The whole run stops within
--limit seconds (children killed); OUT/peer_probe.json has every record and a per-stage summary.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tp_gpu's timing helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lingls from this checkout

from lingls.runtime import peer_allreduce as pa  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

MAIN = ["a_open", "b_torch_copy", "c1_load_raw", "c2_load_delta", "d_store_delta", "e_allreduce"]
NEEDS_OPEN = {"b_torch_copy", "c1_load_raw", "c2_load_delta", "d_store_delta"}
PROBE_BYTES = 2 << 20
N = 4096  # floats of pattern at the start of each rank's probe buffer; d writes the next N
HIDDEN = 2560

if triton is not None:

    @triton.jit
    def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=m, volatile=True), mask=m)

    @triton.jit
    def _load_delta_kernel(local, delta_ptr, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        src = local + tl.load(delta_ptr) // 4  # float32 elements; delta is in bytes
        tl.store(dst + offs, tl.load(src + offs, mask=m, volatile=True), mask=m)

    @triton.jit
    def _store_delta_kernel(local, flag_local, delta_ptr, src, n, at, value, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        delta = tl.load(delta_ptr)
        tl.store(local + delta // 4 + at + offs, tl.load(src + offs, mask=m), mask=m)
        tl.debug_barrier()
        tl.atomic_xchg(flag_local + delta // 8 + tl.program_id(0), value, sem="release", scope="sys")


def pattern(rank: int, device) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32, device=device) + 1000.0 * (rank + 1)


class _PointerAttributes(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("devicePointer", ctypes.c_void_p),
                ("hostPointer", ctypes.c_void_p), ("reserved", ctypes.c_byte * 256)]  # room for newer fields


def pointer_attributes(cuda: pa._Cuda, ptr: int) -> dict:
    f = cuda.lib.cudaPointerGetAttributes
    f.argtypes, f.restype = [ctypes.POINTER(_PointerAttributes), ctypes.c_void_p], ctypes.c_int
    a = _PointerAttributes()
    err = f(ctypes.byref(a), ptr)
    if err:
        cuda.fn["cudaGetLastError"]()
        return {"error": err}
    return {"type": a.type, "device": a.device, "devicePointer_matches": a.devicePointer == ptr}


# ---- the stages (one rank's side) ------------------------------------------------------------------------------
def stage_a_open(st: dict) -> dict:
    rank, dev, ctrl = st["rank"], st["device"], st["ctrl"]
    cuda = pa._cuda()
    own = cuda.malloc(rank, PROBE_BYTES)
    st.update(cuda=cuda, own=own)
    view = pa._device_view(own, PROBE_BYTES, dev)
    st["own_view"] = view.view(torch.float32)
    st["own_view"][:N] = pattern(rank, dev)
    torch.cuda.synchronize()
    handle, offset = cuda.ipc_handle(rank, own)
    got: list = [None] * 2
    dist.all_gather_object(got, (handle, offset), group=ctrl)
    peer_handle, peer_offset = got[1 - rank]
    base = cuda.ipc_open(rank, peer_handle)
    peer = base + peer_offset
    st.update(peer=peer, peer_base=base)
    delta = peer - own
    st["delta"] = torch.tensor([delta], dtype=torch.int64, device=dev)
    return {"ok": True, "own": hex(own), "own_offset_in_alloc": offset, "peer": hex(peer), "delta": delta,
            "delta_mod_512": delta % 512, "peer_attrs": pointer_attributes(cuda, peer),
            "own_attrs": pointer_attributes(cuda, own),
            "can_access_peer": torch.cuda.can_device_access_peer(rank, 1 - rank)}


def stage_b_torch_copy(st: dict) -> dict:
    rank, dev = st["rank"], st["device"]
    pv = pa._device_view(st["peer"], PROBE_BYTES, dev).view(torch.float32)
    st["peer_view"] = pv
    got = pv[:N].clone()
    torch.cuda.synchronize()
    ok = torch.equal(got, pattern(1 - rank, dev))
    return {"ok": ok, "view_device": str(pv.device), "first": float(got[0]), "want_first": 1000.0 * (2 - rank)}


def stage_c1_load_raw(st: dict) -> dict:
    rank, dev = st["rank"], st["device"]
    pv = st.get("peer_view")
    if pv is None:
        pv = pa._device_view(st["peer"], PROBE_BYTES, dev).view(torch.float32)
    out = torch.zeros(N, dtype=torch.float32, device=dev)
    _copy_kernel[(triton.cdiv(N, 1024),)](pv, out, N, BLOCK=1024)
    torch.cuda.synchronize()
    return {"ok": torch.equal(out, pattern(1 - rank, dev))}


def stage_c2_load_delta(st: dict) -> dict:
    rank, dev = st["rank"], st["device"]
    out = torch.zeros(N, dtype=torch.float32, device=dev)
    _load_delta_kernel[(triton.cdiv(N, 1024),)](st["own_view"], st["delta"], out, N, BLOCK=1024)
    torch.cuda.synchronize()
    return {"ok": torch.equal(out, pattern(1 - rank, dev))}


def stage_d_store_delta(st: dict) -> dict:
    """Rank r writes -(pattern r) into the peer's floats [N, 2N) and flag words at byte 1 MiB; then each rank
    checks its own buffer holds what the peer wrote."""
    rank, dev, ctrl = st["rank"], st["device"], st["ctrl"]
    flags_at = (1 << 20) // 8
    words = st["own_view"].view(torch.int64)
    flag_local = words[flags_at:]
    src = -pattern(rank, dev)
    blocks = triton.cdiv(N, 1024)
    _store_delta_kernel[(blocks,)](st["own_view"], flag_local, st["delta"], src, N, N, 77 + rank, BLOCK=1024)
    torch.cuda.synchronize()
    dist.barrier(group=ctrl)  # both ranks' stores are complete
    received = st["own_view"][N:2 * N]
    flags = flag_local[:blocks].tolist()
    ok = torch.equal(received, -pattern(1 - rank, dev)) and flags == [77 + (1 - rank)] * blocks
    return {"ok": ok, "flags": flags, "first": float(received[0])}


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage()[:500])


def stage_e_allreduce(st: dict) -> dict:
    rank, dev = st["rank"], st["device"]
    cap = _Capture()
    logging.getLogger(pa.__name__).addHandler(cap)
    t0 = time.monotonic()
    peer = pa.PeerAllReduce.create()
    res: dict = {"created": peer is not None, "create_s": round(time.monotonic() - t0, 2), "log": cap.lines}
    if peer is None:
        return {"ok": False, **res}
    g = torch.Generator(device=dev).manual_seed(7 + rank)
    same, worst = True, 0.0
    for t in (1, 9, 16):
        x = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
        ref, got = x.clone(), x.clone()
        dist.all_reduce(ref)
        peer(got)
        same &= torch.equal(got, ref)
        worst = max(worst, (got.float() - ref.float()).abs().max().item())
    res.update(bitwise_equal_nccl=same, max_abs_diff_vs_nccl=worst, timed_out=peer.failed())
    res["ok"] = worst <= 0.1 and not res["timed_out"]  # bf16: one ulp of the sums at most
    return res


def stage_f_graph(st: dict) -> dict:
    from tp_gpu import capture, per_call_us

    rank, dev = st["rank"], st["device"]
    res: dict = {}
    peer = None
    if st["peer_ok"]:
        peer = pa.PeerAllReduce.create()
        res["peer_created"] = peer is not None
    else:
        res["peer_skipped"] = "e_allreduce did not pass"
    for t in (1, 9):
        kb = t * HIDDEN * 2 // 1024
        x = torch.randn(t * HIDDEN, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        ops = {"nccl": lambda: dist.all_reduce(x)}
        if peer is not None:
            ops["peer"] = lambda: peer.launch(x, out)
        for name, call in ops.items():
            def many(call=call):
                for _ in range(200):
                    call()
            try:
                res[f"{name}_eager_us_{kb}KB"] = round(per_call_us(many, calls=200, reps=3), 2)
                res[f"{name}_graph_us_{kb}KB"] = round(per_call_us(capture(many), calls=200, reps=5), 2)
            except Exception as e:  # noqa: BLE001
                res[f"{name}_error_{kb}KB"] = repr(e)[:300]
        if peer is not None:  # x was summed in place by NCCL's runs: compare the peer's sum of this x with NCCL's
            x.normal_()
            graph = capture(lambda: peer.launch(x, out))
            graph()
            ref = x.clone()
            dist.all_reduce(ref)
            res[f"peer_graph_equals_nccl_{kb}KB"] = torch.equal(out, ref)
    if peer is not None:
        res["peer_timed_out"] = peer.failed()
    res["ok"] = all(not k.startswith(("nccl_error", "peer_error")) for k in res) and not res.get("peer_timed_out")
    return res


# ---- --selftest: the plumbing on CPU (gloo, fake stages: one raises, one kills its context, one hangs) ----------
SELFTEST = os.environ.get("PEER_PROBE_SELFTEST") == "1"
_FAKE_DEAD = False


def _sync() -> None:
    if SELFTEST:
        if _FAKE_DEAD:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (fake)")
        return
    torch.cuda.synchronize()


def _fake(name: str):
    def stage(st: dict) -> dict:
        global _FAKE_DEAD
        rank, pair = st["rank"], st["pair"]
        if name == "c1_load_raw":
            raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (fake)")
        if name == "c2_load_delta" and rank == 1:
            _FAKE_DEAD = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered (fake)")
        if name == "e_allreduce" and rank == 0 and pair == 1:
            time.sleep(1000)  # a kernel spinning on a dead peer
        if name == "f_graph":
            return {"ok": True, "nccl_graph_us_5KB": 20.0, "peer_graph_us_5KB": 5.0 if st["peer_ok"] else None}
        return {"ok": True, "stage": name}
    return stage


STAGES = {"a_open": stage_a_open, "b_torch_copy": stage_b_torch_copy, "c1_load_raw": stage_c1_load_raw,
          "c2_load_delta": stage_c2_load_delta, "d_store_delta": stage_d_store_delta,
          "e_allreduce": stage_e_allreduce, "f_graph": stage_f_graph}
if SELFTEST:
    STAGES = {k: _fake(k) for k in STAGES}


# ---- one rank of a pair -----------------------------------------------------------------------------------------
def _brief(stage: str, r: dict) -> str:
    keys = [k for k in r if k not in ("ok", "log", "trace")]
    text = ", ".join(f"{k}={r[k]}" for k in keys)
    return text[:400]


def _child(rank: int, port: int, stages: list[str], blocking: bool, out_dir: str, pair: int, peer_ok: bool) -> None:
    _launch_blocking(blocking)  # before this process's CUDA starts
    path = Path(out_dir) / f"peer_probe.rank{rank}.jsonl"
    rec = open(path, "a")
    t0 = time.monotonic()

    def log(stage: str, event: str, kv: dict | None = None) -> None:
        kv = kv or {}
        d = {**kv, "pair": pair, "rank": rank, "stage": stage, "event": event, "t": round(time.monotonic() - t0, 2)}
        rec.write(json.dumps(d, default=str) + "\n")
        rec.flush()
        if event == "end":
            tag = "OK  " if kv.get("ok") else "FAIL"
            sys.stdout.write(f"[probe] stage {stage} rank {rank}: {tag} {_brief(stage, kv)}\n")
            sys.stdout.flush()

    alive = True
    try:
        if SELFTEST:
            dev = torch.device("cpu")
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        else:
            torch.cuda.set_device(rank)
            dev = torch.device("cuda", rank)
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                    device_id=dev, timeout=timedelta(seconds=40))
        ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=25))
        log("init", "end", {"ok": True, "seconds": round(time.monotonic() - t0, 1), "blocking": blocking})
        st = {"rank": rank, "device": dev, "ctrl": ctrl, "peer_ok": peer_ok, "pair": pair}
        todo = list(stages)
        if any(s in NEEDS_OPEN for s in todo) and "a_open" not in todo:
            todo.insert(0, "a_open (redo)")
        opened = None
        for stage in todo:
            name = stage.split(" ")[0]
            if name in NEEDS_OPEN and not opened:
                log(stage, "end", {"ok": False, "skipped": "a_open did not succeed"})
                continue
            log(stage, "start")
            try:
                r = STAGES[name](st)
            except Exception as e:  # noqa: BLE001
                r = {"ok": False, "error": repr(e)[:600], "trace": traceback.format_exc()[-1500:]}
            try:
                _sync()
            except Exception as e:  # noqa: BLE001 - a sticky error: this context is gone
                alive = False
                r["context_dead"] = repr(e)[:300]
            log(stage, "end", r)
            if name == "a_open":
                opened = bool(r.get("ok"))
            states: list = [None] * 2
            try:
                dist.all_gather_object(states, alive, group=ctrl)
            except Exception as e:  # noqa: BLE001 - the peer died or hangs
                log(stage, "sync_failed", {"error": repr(e)[:300]})
                states = [False, False]
            if not all(states):
                log("pair", "stop", {"reason": f"a context died in {stage}", "states": states})
                break
        log("pair", "done")
        if alive:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        log("pair", "error", {"error": repr(e)[:600], "trace": traceback.format_exc()[-1500:]})
        print(f"[probe] rank {rank} pair {pair} error: {e!r}", flush=True)
    finally:
        rec.close()
        sys.stdout.flush()
        os._exit(0)  # no teardown that could hang on a dead context


def _launch_blocking(on: bool) -> None:
    if on:
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
    else:
        os.environ.pop("CUDA_LAUNCH_BLOCKING", None)


# ---- the parent -------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(out: Path) -> list[dict]:
    rows = []
    for rank in (0, 1):
        p = out / f"peer_probe.rank{rank}.jsonl"
        if p.exists():
            for line in p.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return rows


_RUNNING: list = []  # the pair now running: killed if this process is told to stop (timeout's SIGTERM)


def _on_sigterm(signum, frame) -> None:
    for p in _RUNNING:
        if p.is_alive():
            p.kill()
    print("[probe] stopped by a signal: children killed", flush=True)
    os._exit(124)


def run_pair(stages: list[str], blocking: bool, limit: float, out: Path, pair: int, peer_ok: bool) -> dict:
    _launch_blocking(blocking)  # the children inherit it
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, port, stages, blocking, str(out), pair, peer_ok), daemon=True)
             for r in range(2)]
    t0 = time.monotonic()
    print(f"[probe] pair {pair}: stages {','.join(stages)} (CUDA_LAUNCH_BLOCKING={int(blocking)}, "
          f"limit {limit:.0f} s)", flush=True)
    _RUNNING[:] = procs
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs) and time.monotonic() - t0 < limit:
        time.sleep(0.2)
    killed = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            killed.append(r)
        p.join(timeout=5)
    rows = [d for d in _records(out) if d["pair"] == pair]
    started = [d["stage"] for d in rows if d["event"] == "start"]
    info = {"pair": pair, "stages": stages, "blocking": blocking, "seconds": round(time.monotonic() - t0, 1),
            "killed_ranks": killed, "exitcodes": [p.exitcode for p in procs],
            "last_started": started[-1] if started else None}
    if killed:
        print(f"[probe] pair {pair}: killed ranks {killed} after {info['seconds']} s "
              f"(last stage started: {info['last_started']})", flush=True)
    return info


def summarize(rows: list[dict]) -> dict:
    """stage -> rank -> its first result (a re-run of a_open as setup does not count)."""
    out: dict = {}
    for d in rows:
        if d["event"] == "end" and d["stage"] in STAGES:
            out.setdefault(d["stage"], {}).setdefault(f"rank{d['rank']}", d)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--limit", type=float, default=90.0, help="seconds for the whole probe (children killed then)")
    p.add_argument("--pair-limit", type=float, default=55.0, help="seconds for one pair of processes")
    p.add_argument("--selftest", action="store_true", help="the plumbing on CPU with fake stages (no GPU)")
    a = p.parse_args(argv)
    if a.selftest:
        os.environ["PEER_PROBE_SELFTEST"] = "1"  # for the children (spawned: they read it on import)
    signal.signal(signal.SIGTERM, _on_sigterm)
    t_start = time.monotonic()
    deadline = t_start + a.limit
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                       "PYTHONUNBUFFERED": "1"})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        (out / f"peer_probe.rank{rank}.jsonl").unlink(missing_ok=True)
    result: dict = {"bench": "peer_probe", "torch": torch.__version__, "triton": getattr(triton, "__version__", None),
                    "time": time.strftime("%Y-%m-%d %H:%M:%S"), "pairs": []}

    def save() -> None:
        rows = _records(out)
        result["summary"] = summarize(rows)
        result["records"] = rows
        result["seconds"] = round(time.monotonic() - t_start, 1)
        (out / "peer_probe.json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    n = 2 if a.selftest else torch.cuda.device_count()
    result["gpus"] = n
    result["selftest"] = a.selftest
    if n < 2 or triton is None:
        print(f"[probe] needs 2 GPUs and triton (gpus {n}, triton {result['triton']})", flush=True)
        save()
        return 2
    remaining, pair = list(MAIN), 0
    while remaining:
        left = deadline - time.monotonic() - 22  # kept for f_graph
        if left < 18:  # a pair needs ~10 s to start (torch, NCCL) before its first stage
            print(f"[probe] no time left for {remaining}", flush=True)
            break
        info = run_pair(remaining, True, min(left, a.pair_limit), out, pair, True)
        result["pairs"].append(info)
        done = summarize([d for d in _records(out) if d["pair"] == pair])
        # where the pair stopped: a stage some rank never finished, or one that killed a rank's context
        broken = next((s for s in remaining if len(done.get(s, {})) < 2
                       or any("context_dead" in r for r in done[s].values())), None)
        if broken is None:
            remaining = []
        else:
            print(f"[probe] pair {pair} ended in {broken}; the next pair starts after it", flush=True)
            remaining = remaining[remaining.index(broken) + 1:]
        pair += 1
        save()
    summary = summarize(_records(out))
    e = summary.get("e_allreduce", {})
    e_ok = len(e) == 2 and all(r.get("ok") for r in e.values())
    left = deadline - time.monotonic()
    if left >= 12:
        result["pairs"].append(run_pair(["f_graph"], False, left - 2, out, pair, e_ok))
    else:
        print("[probe] no time left for f_graph", flush=True)
    save()
    print("\n[probe] summary (stage: rank0 / rank1)")
    for stage in list(STAGES):
        got = result["summary"].get(stage, {})
        cells = [("OK" if got[k].get("ok") else "FAIL") if k in got else "-" for k in ("rank0", "rank1")]
        print(f"  {stage:14s} {cells[0]:4s} / {cells[1]}")
    f = result["summary"].get("f_graph", {}).get("rank0", {})
    for key in sorted(k for k in f if "_us_" in k or "equals" in k):
        print(f"  f_graph rank0 {key} = {f[key]}")
    print(f"[probe] wrote {out / 'peer_probe.json'} in {result['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
