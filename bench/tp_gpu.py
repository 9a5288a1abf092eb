"""Peer all-reduce against NCCL on N GPUs (default 2), then the whole Ling-3.0-flash at TP=N with each of them.

Why: NCCL's all-reduce of one token's hidden state takes ~22 us on two NVLinked H200s, and a decode step does
84 of them (../shared/docs/h200-measured.md). `lingls.kernels.peer_allreduce` is the one-shot replacement; this
script measures whether it is correct and how much it saves, in one device call that must never hang.

Phases, each in fresh processes (one per GPU, NCCL for setup) under its own time limit, so a phase that
crashes or hangs loses only itself; results stream to the parent as they come and land in OUT/tp_gpu.json:
- `coll`: (1) NCCL latency; (2) `make_parallel`'s default choice; (3) correctness of the peer all-reduce
  against NCCL for T = 1..16 rows of 2560 bf16, eager, then 1000 calls back to back (50 calls of changing sizes
  per CUDA graph, 20 replays with fresh inputs), checked against NCCL and across ranks; (4) peer latency.
  Latency: median us per call over 200 back-to-back calls, eager and inside one CUDA graph, 5 KB and 45 KB.
- `model`: build_flash(42 layers, tp=N) per rank (random bf16 weights, real shapes; fewer layers if it would
  not fit, said in the output), FusedStep at T=1 (decode) and the verify sizes of --tokens (default 9) over an
  8k context, captured in a CUDA graph: median ms with NCCL, with the peer all-reduce followed by the add +
  RMSNorm kernel, and with the two fused in one kernel (`peer`, what make_parallel sets up), the per-rank byte
  floor, the ratio, all-reduces per step, and whether the first and last ranks (and both all-reduces) produce
  the same hidden states.

    python -m bench.tp_gpu [--tp N] [--phases coll,model] [--layers 42] [--tokens 1,9] [--out DIR]
    (bench/tp_session.sh wraps it; on four GPUs: --tp 4 --tokens 1,2,4,8,9,12,16)
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import free_port, write_result

HIDDEN = 2560
N_PER_GRAPH = 200
CONTEXT = 8192
LIMITS = {"coll": 120, "model": 250}  # seconds per phase (tp_session.sh gives the whole script 400)


# ---- plumbing ------------------------------------------------------------------------------------------------
def _worker(phase: str, rank: int, world: int, port: int, args: dict, q) -> None:
    """One rank of one phase: every result goes to the parent at once (q), so a later hang keeps it."""
    import logging

    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(name)s: %(message)s")
    put = lambda key, value: q.put(("row", rank, key, value))  # noqa: E731
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
        {"coll": phase_coll, "model": phase_model}[phase](rank, world, put, args)
        q.put(("done", rank, None, None))
    except BaseException:  # noqa: BLE001 - reported, never raised into a hang
        q.put(("error", rank, None, traceback.format_exc()[-2000:]))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_phase(phase: str, args: dict, limit: float, world: int) -> dict:
    """Spawn `world` ranks, collect what they report until all are done, one fails, or `limit` seconds pass.
    Rank 0's rows land at the top level, rank r's under "rank{r}"."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(phase, r, world, port, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict = {f"rank{r}": {} for r in range(1, world)}
    finished, deadline, t0 = set(), time.monotonic() + limit, time.monotonic()
    while len(finished) < world:
        if time.monotonic() > deadline:
            out["status"] = f"gave up after {time.monotonic() - t0:.0f} s (ranks finished: {sorted(finished)})"
            break
        try:
            kind, rank, key, value = q.get(timeout=1.0)
        except queue.Empty:
            for rank, p in enumerate(procs):  # a rank that died without a word (killed, segfault)
                if rank not in finished and p.exitcode is not None:
                    out.setdefault("errors", {})[f"rank{rank}"] = f"exited with code {p.exitcode}"
                    finished.add(rank)
                    deadline = min(deadline, time.monotonic() + 20)
            continue
        if kind == "row":
            (out if rank == 0 else out[f"rank{rank}"])[key] = value
        elif kind == "error":
            out.setdefault("errors", {})[f"rank{rank}"] = value
            print(f"[{phase}] rank {rank} failed:\n{value}", flush=True)
            finished.add(rank)
            deadline = min(deadline, time.monotonic() + 20)  # the other ranks may be stuck in a collective
        else:
            finished.add(rank)
    out.setdefault("status", "ok" if "errors" not in out else "error")
    for p in procs:
        p.join(timeout=5 if len(finished) == world else 0)
        if p.is_alive():  # stuck (in a collective, or a spinning kernel): its CUDA context goes with it
            p.kill()
            p.join(timeout=10)
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def per_call_us(fn, calls: int = N_PER_GRAPH, reps: int = 5) -> float:
    """Median over `reps` of fn() (which makes `calls` all-reduces), in us per all-reduce."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()  # both ranks start together: the time is the collective's, not the other rank's lag
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def nccl_all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


# ---- phase coll: latency and correctness of the all-reduces ---------------------------------------------------
def latency(name: str, op, put) -> None:
    from bench.common import graphed

    for n in (HIDDEN, 9 * HIDDEN):
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        call = (lambda: op(x, out)) if name == "peer" else (lambda: op(x))

        def many():
            for _ in range(N_PER_GRAPH):
                call()

        kb = n * 2 // 1024
        try:
            put(f"{name}_eager_us_{kb}KB", per_call_us(many))
            put(f"{name}_graph_us_{kb}KB", per_call_us(graphed(many)))
        except Exception as e:  # noqa: BLE001
            put(f"{name}_latency_error_{kb}KB", repr(e)[:300])


def phase_coll(rank: int, world: int, put, args: dict) -> None:
    from bench.common import graphed
    from lingls.kernels.peer_allreduce import PeerAllReduce
    from lingls.serve.tensor_parallel import make_parallel

    put("gpu", torch.cuda.get_device_name())
    put("peer_access", torch.cuda.can_device_access_peer(rank, 1 - rank))
    latency("nccl", nccl_all_reduce, put)
    os.environ.pop("LINGLS_ALLREDUCE", None)
    put("make_parallel_default", type(make_parallel(rank, world).all_reduce).__name__)
    peer = PeerAllReduce.create()
    put("peer_created", peer is not None)
    if peer is None:
        return
    # eager, T = 1..16: against NCCL on the same inputs, and against the fp32 sum rounded once
    g = torch.Generator(device="cuda").manual_seed(1000 + rank)
    worst_nccl, worst_exact, same = 0.0, 0.0, True
    for t in range(1, 17):
        x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        ref, got = x.clone(), x.clone()
        dist.all_reduce(ref)
        peer(got)
        parts = torch.empty(world, t, HIDDEN, device="cuda", dtype=torch.bfloat16)
        dist.all_gather_into_tensor(parts, x)
        exact = parts.float().sum(0).bfloat16()
        worst_nccl = max(worst_nccl, (got.float() - ref.float()).abs().max().item())
        worst_exact = max(worst_exact, (got.float() - exact.float()).abs().max().item())
        same &= torch.equal(got, ref)
    put("eager_T1-16_max_abs_diff_vs_nccl", worst_nccl)
    put("eager_T1-16_max_abs_diff_vs_fp32_sum", worst_exact)
    put("eager_T1-16_bitwise_equal_nccl", same)
    # 1000 calls back to back: 50 per graph, sizes cycling 1..16, 20 replays with fresh inputs
    k = 50
    src = torch.empty(k, 16, HIDDEN, device="cuda", dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    sizes = [(i % 16) + 1 for i in range(k)]

    def calls():
        for i, t in enumerate(sizes):
            peer.launch(src[i, :t], dst[i, :t])

    for mode in ("eager", "graph"):
        src.normal_(generator=g)
        fn = graphed(calls) if mode == "graph" else calls
        bad = torch.zeros((), dtype=torch.int64, device="cuda")
        diff = torch.zeros((), device="cuda")
        cross = torch.zeros((), dtype=torch.int64, device="cuda")
        for _ in range(20):
            src.normal_(generator=g)
            dst.zero_()
            fn()
            for i, t in enumerate(sizes):
                ref = src[i, :t].clone()
                dist.all_reduce(ref)
                bad += (ref != dst[i, :t]).sum()
                diff = torch.maximum(diff, (ref.float() - dst[i, :t].float()).abs().max())
            both = torch.empty(world, *dst.shape, device="cuda", dtype=dst.dtype)
            dist.all_gather_into_tensor(both, dst)
            cross += (both[0] != both[-1]).sum()
        put(f"{mode}_1000_calls_elems_differing_from_nccl", int(bad))
        put(f"{mode}_1000_calls_max_abs_diff_vs_nccl", float(diff))
        put(f"{mode}_1000_calls_elems_differing_across_ranks", int(cross))
    put("peer_timed_out", peer.failed())
    latency("peer", lambda x, out: peer.launch(x, out), put)
    put("peer_timed_out_after_latency", peer.failed())


# ---- phase model: Ling-3.0-flash at TP=N --------------------------------------------------------------------
def weight_bytes(layers: int, tp: int, rank: int) -> int:
    from lingls.model.config import flash_config
    from lingls.model.ling import LingForCausalLM, Parallel

    cfg = flash_config(layers)
    cfg.num_nextn_predict_layers = 0
    with torch.device("meta"):
        model = LingForCausalLM(cfg, Parallel(rank, tp)).to(torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def phase_model(rank: int, world: int, put, args: dict) -> None:
    """NCCL first, for T = 1 and 9; then the peer all-reduce (set up only now, and only if phase coll found it
    correct), so a peer path that breaks the CUDA context cannot take the NCCL numbers with it."""
    from bench.common import graphed
    from lingls.bench.floor import routed_experts, step_floor_ms
    from lingls.bench.step import build_flash, copy_bandwidth, median_ms
    from lingls.kernels.peer_allreduce import PeerAllReduce
    from lingls.runtime.fused_step import FusedStep

    bw = copy_bandwidth()
    put("copy_TBps", bw / 1e12)
    layers = args["layers"]
    torch.cuda.empty_cache()  # the copy's 4 GiB go back before free memory is read
    free = torch.cuda.mem_get_info()[0]
    need = weight_bytes(layers, world, rank)
    if need > free - 10e9:  # 10 GB for state, graphs, NCCL, Triton and the peer path's context on this GPU
        layers = max(1, int(layers * (free - 10e9) / need))
        put("note", f"{args['layers']} layers need {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free: ran {layers}")
    sizes = [0] * world
    dist.all_gather_object(sizes, layers)
    layers = min(sizes)
    put("layers", layers)
    t0 = time.perf_counter()
    model = build_flash(layers, tp=world, rank=rank)
    torch.cuda.synchronize()
    put("weights_GB_per_rank", sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9)
    put("build_s", time.perf_counter() - t0)
    par = model.par
    count = [0]

    def counted(x):
        count[0] += 1
        return nccl_all_reduce(x)

    state = model.new_state(CONTEXT + 64)
    torch.manual_seed(rank)
    state.latent.normal_()
    state.kda.normal_(std=0.01)
    fused = FusedStep(model, kernels=True)
    vocab = model.config.vocab_size
    rows, inputs, outs = {}, {}, {}
    with torch.inference_mode():
        for t in args["tokens"]:
            torch.manual_seed(t)  # the same token ids on every rank
            ids = torch.randint(0, vocab, (t,), device="cuda")
            pos = torch.arange(CONTEXT - t, CONTEXT, device="cuda")
            inputs[t] = ids, pos
            par.all_reduce = counted
            distinct = routed_experts(model, lambda: model.step(ids, state.clone(), pos))
            count[0] = 0
            fused.step(ids, state.clone(), pos)
            rows[t] = {"T": t, "all_reduces_per_step": count[0], "distinct_experts": sum(distinct) / len(distinct),
                       "floor_ms": step_floor_ms(model, t, CONTEXT - t, distinct, bw, head=False)}
            put(f"T{t}", dict(rows[t]))

        def measure(name: str, op, add_norm=None) -> None:
            for t, (ids, pos) in inputs.items():
                row = rows[t]
                try:
                    par.all_reduce, par.all_reduce_add_norm = op, add_norm
                    outs[name, t] = fused.step(ids, state.clone(), pos).clone()
                    work = state.clone()
                    replay = graphed(lambda: fused.step(ids, work, pos))
                    dist.barrier()
                    row[f"{name}_ms"] = median_ms(replay, reps=30)
                    row[f"{name}_over_floor"] = row[f"{name}_ms"] / row["floor_ms"]
                    both = torch.empty(world, *outs[name, t].shape, device="cuda", dtype=outs[name, t].dtype)
                    dist.all_gather_into_tensor(both, outs[name, t])
                    row[f"{name}_ranks_identical"] = torch.equal(both[0], both[-1])
                    del replay
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_error"] = repr(e)[:300]
                put(f"T{t}", dict(row))

        measure("nccl", nccl_all_reduce)
        if not args.get("peer_ok", True):
            put("peer_skipped", "phase coll found the peer all-reduce missing, wrong or failing")
            return
        peer = PeerAllReduce.create()
        put("peer_created", peer is not None)
        if peer is None:
            return
        measure("peer_unfused", peer)  # all-reduce, then the add + RMSNorm kernel
        measure("peer", peer, peer.add_rms_norm)  # the two in one kernel, as make_parallel sets it up
        for t in inputs:
            a, b, u = outs.get(("nccl", t)), outs.get(("peer", t)), outs.get(("peer_unfused", t))
            if b is not None and u is not None:
                rows[t]["peer_fused_equals_unfused"] = torch.equal(b, u)  # the same bits, one launch fewer
            if a is not None and b is not None:
                rows[t]["peer_equals_nccl"] = torch.equal(a, b)
                rows[t]["rel_diff_peer_vs_nccl"] = ((a.float() - b.float()).norm() / a.float().norm()).item()
            rows[t]["peer_timed_out"] = peer.failed()
            put(f"T{t}", dict(rows[t]))


# ---- report ---------------------------------------------------------------------------------------------------
def report(result: dict) -> None:
    coll = result.get("coll", {})
    if coll:
        print("\n## all-reduce (us per call, rank 0; median of 5 x 200 back-to-back calls)")
        print("| size | NCCL eager | NCCL graph | peer eager | peer graph |\n|---|---|---|---|---|")
        for kb in (5, 45):
            cells = [coll.get(f"{n}_{m}_us_{kb}KB") for n in ("nccl", "peer") for m in ("eager", "graph")]
            print(f"| {kb} KB | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |")
        for key in ("make_parallel_default", "peer_created", "eager_T1-16_bitwise_equal_nccl",
                    "eager_T1-16_max_abs_diff_vs_nccl", "eager_1000_calls_elems_differing_from_nccl",
                    "graph_1000_calls_elems_differing_from_nccl", "graph_1000_calls_elems_differing_across_ranks",
                    "peer_timed_out_after_latency"):
            print(f"{key}: {coll.get(key, '-')}")
    model = result.get("model", {})
    if model:
        print(f"\n## Ling-3.0-flash TP={result.get('tp', 2)}, {model.get('layers', '?')} layers, "
              f"{model.get('weights_GB_per_rank', 0):.1f} GB/rank, ctx {CONTEXT}, FusedStep in a CUDA graph (rank 0)")
        print("| T | all-reduces | floor ms | NCCL ms | x floor | peer unfused ms | peer ms | x floor | "
              "fused == unfused | peer == NCCL | ranks equal |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for t in sorted(int(k[1:]) for k in model if k[:1] == "T" and k[1:].isdigit()):
            r = model.get(f"T{t}")
            if not r:
                continue
            f = lambda k, fmt="{:.3f}": "-" if r.get(k) is None else fmt.format(r[k])  # noqa: E731
            print(f"| {t} | {f('all_reduces_per_step', '{}')} | {f('floor_ms')} | {f('nccl_ms')} | "
                  f"{f('nccl_over_floor', '{:.2f}')} | {f('peer_unfused_ms')} | {f('peer_ms')} | "
                  f"{f('peer_over_floor', '{:.2f}')} | {f('peer_fused_equals_unfused', '{}')} | "
                  f"{f('peer_equals_nccl', '{}')} | {f('peer_ranks_identical', '{}')} |")
        if "note" in model:
            print("note:", model["note"])
    for phase, r in result.items():
        if isinstance(r, dict) and "status" in r:
            print(f"[{phase}] {r['status']} in {r.get('seconds')} s")


def peer_ok(coll: dict | None) -> bool:
    """Whether phase coll (if it ran) saw the peer all-reduce set up, agree with NCCL and never time out."""
    if coll is None:
        return True
    close = all(coll.get(f"{m}_1000_calls_max_abs_diff_vs_nccl", 1.0) <= 0.1 for m in ("eager", "graph"))  # ~1 ulp
    return (coll.get("peer_created") is True and close and coll.get("peer_timed_out") is False
            and coll.get("graph_1000_calls_elems_differing_across_ranks") == 0 and "errors" not in coll)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="ranks, one per GPU")
    p.add_argument("--tokens", default="1,9", help="step sizes T of phase model (each <= 16)")
    p.add_argument("--phases", default="coll,model")
    p.add_argument("--layers", type=int, default=42)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    a = p.parse_args(argv)
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    n = torch.cuda.device_count()  # no CUDA context in this process: the ranks get whole GPUs
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"bench": "tp_gpu", "gpus": n, "tp": a.tp, "torch": torch.__version__,
                    "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if a.tp < 2 or n < a.tp:
        print(f"bench.tp_gpu --tp {a.tp} needs at least 2 and at most the {n} GPUs visible", file=sys.stderr)
        return 2
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    for phase in a.phases.split(","):
        print(f"\n=== phase {phase} (limit {LIMITS[phase]} s)", flush=True)
        args = {"layers": a.layers, "tokens": [int(t) for t in a.tokens.split(",")],
                "peer_ok": peer_ok(result.get("coll"))}
        result[phase] = run_phase(phase, args, LIMITS[phase], a.tp)
        write_result(out / "tp_gpu.json", result)
        print(json.dumps(result[phase], default=str), flush=True)
    report(result)
    print(f"\nwrote {out / 'tp_gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
