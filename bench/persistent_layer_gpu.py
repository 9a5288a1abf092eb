"""One KDA + MoE layer at T=1, one TP=4 rank of Ling-3.0-flash: the persistent kernel against the chain of
launches, in the same run.

    python -m bench.persistent_layer_gpu OUT_DIR [LAYERS] [PROGRAMS,...] [VARIANT[+tl],...]

VARIANT: norm_tasks, recompute, norm_tasks_2x_rows (the Triton kernel), cuda, cuda_nopdl (the warp-specialised
CUDA C++ runner of `persistent_cuda` on the local_route tables, as a programmatic dependent launch or not),
cuda_f2, cuda_f3 (2, 3 ring stages in flight; `cuda` has the default, 1), cuda_free (the projection's and
the routed experts' copies fill the whole ring, unlimited), cuda_loud (no quiet loader during a KDA task);
default: cuda+tl, cuda_f2, cuda_free, cuda_loud. +tl: record that variant's timeline too.

- Correctness at the real shapes on layer 0: persistent vs chain vs the plain-torch layer (fp32 math), the
  output and the KDA state as relative errors, and whether the three chose the same experts.
- Timing: LAYERS layers of distinct weights (so each layer's weights stream from HBM, not L2), each graph one
  replay over all of them, median of many replays, per layer:
  chain = fused_step's launches for the layer (input norm, proj GEMV, KDA step, output GEMV, post-attention
          norm, the MoE's four launches), PDL on, as `FusedStep._run` issues them;
  persistent = one `persistent.launch` (Triton) or `persistent_cuda.launch` (CUDA C++) per layer.
  Variants (`variants`): the RMSNorms as tasks of their own or recomputed by every consumer task; twice the
  rows per GEMV task; the CUDA runner.
- The CUDA runner also on fresh random inputs inside a CUDA graph, replayed twice (two generations of its
  counters) against the plain-torch layer run twice.
  All graphs start with the same copy of the input into the residual stream. Byte floor: the layer's bytes
  (`persistent.layer_bytes`) over the copy rate measured in the same run. A/B/A/B to show the spread.
- Timeline: the persistent kernel with globaltimer stamps per task (Triton: start, weights requested, inputs
  ready, end; CUDA: the consumers' start, the weights in shared memory, inputs ready, end), the last layer of
  one graph replay: JSON and PNG per variant asked for.
Writes OUT_DIR/persistent_layer.json and OUT_DIR/persistent_timeline_VARIANT.json / .png.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import triton

from lingls.bench.step import copy_bandwidth, median_ms
from lingls.kernels import gemv, kda, moe, norm
from lingls.kernels import persistent as pk
from lingls.kernels import persistent_cuda as pc


def chain_layer(res, x, w: pk.LayerWeights, state, conv, s: pk.LayerShape, next_norm):
    """fused_step's launches for one KDA + MoE layer from its input norm x (res: the residual stream, updated in
    place): returns the next layer's input norm (by next_norm), with res advanced past the layer."""
    c = s.channels
    p = gemv.gemv(x, w.proj, pdl=True)
    q, k, v, f, g, b = p.split([c, c, c, c, c, s.heads], dim=1)
    o = kda.fused_kda_step(q, k, v, f, b, g, conv, w.conv, w.a_log, w.dt_bias, w.o_norm, state,
                           lower_bound=s.lower_bound, eps=s.eps, pdl=True)
    a = gemv.gemv(o, w.o_proj, pdl=True)
    x2, _ = norm.fused_add_rms_norm(a, res, w.post_norm, s.eps, pdl=True)
    m = moe.fused_moe(x2, w.router, w.expert_bias, w.gate_up, w.down, w.shared_gate_up, w.shared_down,
                      top_k=s.top_k, n_group=s.n_group, topk_group=s.topk_group, normalize=True, scale=s.scale,
                      pdl=True)
    x, _ = norm.fused_add_rms_norm(m, res, next_norm, s.eps, pdl=True)
    return x


BIG_TILES = dict(proj_rows=16, router_rows=16, oproj_rows=32, gu_rows=8, down_rows=16)


def _triton(h, out, w, st, cv, schedule, ws, table, timeline=False):
    return pk.launch(h, out, w, st, cv, schedule, ws, table, timeline=timeline)


def _cuda(pdl=True, **kw):
    def launch(h, out, w, st, cv, schedule, ws, table, timeline=False):
        return pc.launch(h, out, w, st, cv, schedule, ws, table, timeline=timeline, pdl=pdl, **kw)
    return launch


TRITON = dict(norm_tasks=True)
RECOMPUTE = dict(norm_tasks=False)
CUDA = dict(norm_tasks=False, local_route=True)


def variants(program_counts: list[int], only: list[str] | None = None) -> list[tuple]:
    """(name, programs, shape with its tile sizes, build_schedule's options, launch): the Triton kernel with
    the norms as tasks or recomputed by every consumer, twice the rows per GEMV task (twice the bytes each
    task has in flight); the CUDA runner and its loader's policies."""
    base = pk.LayerShape()
    out = []
    for p in program_counts:
        out += [(f"persistent_p{p}_norm_tasks", p, base, TRITON, _triton),
                (f"persistent_p{p}_recompute", p, base, RECOMPUTE, _triton),
                (f"persistent_p{p}_norm_tasks_2x_rows", p, pk.LayerShape(**BIG_TILES), TRITON, _triton),
                (f"persistent_p{p}_cuda", p, base, CUDA, _cuda()),
                (f"persistent_p{p}_cuda_nopdl", p, base, CUDA, _cuda(False)),
                (f"persistent_p{p}_cuda_free", p, base, CUDA, _cuda(free_kinds=(pk.PROJ, pk.EXPERT_GU, pk.DOWN))),
                (f"persistent_p{p}_cuda_loud", p, base, CUDA, _cuda(kda_quiet=False))]
        out += [(f"persistent_p{p}_cuda_f{n}", p, base, CUDA, _cuda(inflight=n)) for n in (2, 3)]
    return [v for v in out if only is None or v[0].split("_", 2)[2] in only]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("nan")


def wait_or_die(what: str, limit_s: float = 30.0):
    """The persistent kernel spins on counters: a scheduling bug would hang the GPU. Give up loudly instead."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > limit_s:
            print(f"{what}: no completion after {limit_s} s (deadlock?)", flush=True)
            os._exit(3)
        time.sleep(0.01)


def timeline(schedule: pk.Schedule, stamps: torch.Tensor) -> dict:
    st = stamps.cpu().long()
    t0 = int(st[:, 0].min())
    tasks = []
    for t in schedule.tasks:
        a, b, c, d = (float(v - t0) / 1e3 for v in st[t.index].tolist())
        tasks.append(dict(index=t.index, program=t.program, kind=pk.KIND_NAMES[t.kind], tile=t.tile, start_us=a,
                          issued_us=b, ready_us=c, end_us=d))
    kinds = {}
    for name in pk.KIND_NAMES[1:]:
        ts = [t for t in tasks if t["kind"] == name]
        if not ts:
            continue
        kinds[name] = dict(count=len(ts), first_start_us=min(t["start_us"] for t in ts),
                           last_ready_us=max(t["ready_us"] for t in ts), last_end_us=max(t["end_us"] for t in ts),
                           mean_wait_us=sum(t["ready_us"] - t["issued_us"] for t in ts) / len(ts),
                           mean_after_ready_us=sum(t["end_us"] - t["ready_us"] for t in ts) / len(ts),
                           mean_issue_us=sum(t["issued_us"] - t["start_us"] for t in ts) / len(ts))
    span = max(t["end_us"] for t in tasks)
    waiting = sum(max(0.0, t["ready_us"] - t["issued_us"]) for t in tasks)
    return dict(span_us=span, wait_us_summed_over_programs=waiting, programs=schedule.programs, by_kind=kinds,
                tasks=tasks)


def plot_timeline(tl: dict, path: Path, label: str, cuda: bool = False) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = dict(proj="tab:blue", kda="tab:red", oproj="tab:cyan", router="tab:olive", shared_gu="tab:green",
                  route="black", expert_gu="tab:orange", down="tab:purple", norm="tab:pink")
    fig, ax = plt.subplots(figsize=(14, 9))
    for t in tl["tasks"]:
        y = t["program"]
        ax.barh(y, t["issued_us"] - t["start_us"], left=t["start_us"], height=0.8, color=colors[t["kind"]],
                alpha=0.35)
        ax.barh(y, t["ready_us"] - t["issued_us"], left=t["issued_us"], height=0.8, color="lightgray")
        ax.barh(y, t["end_us"] - t["ready_us"], left=t["ready_us"], height=0.8, color=colors[t["kind"]])
    for name, c in colors.items():
        ax.barh(-5, 0, color=c, label=name)
    ax.barh(-5, 0, color="lightgray", label="waiting on a counter")
    ax.set_xlabel("us since the first task started (pale: " + ("waiting for the weights in shared memory"
                  if cuda else "requesting weights") + "; gray: waiting for inputs; dark: after inputs)")
    ax.set_ylabel("program")
    ax.set_ylim(-1, tl["programs"])
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"persistent KDA + MoE layer ({label}), T=1, TP=4 rank shapes: span {tl['span_us']:.1f} us")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def graph_check(schedule: pk.Schedule, run, dev) -> list[dict]:
    """The runner captured in a CUDA graph on fresh random inputs (weights, state, input), the graph replayed
    twice (two generations of the counters, no memset) against the plain-torch layer run twice."""
    s = schedule.shape
    gen = torch.Generator(device=dev).manual_seed(1234)
    wd = pk.random_layer(s, device=dev, generator=gen)
    hd = torch.randn(1, s.hidden, device=dev, generator=gen).to(torch.bfloat16)
    std = torch.randn(s.heads, s.head_dim, s.head_dim, device=dev, generator=gen) * 0.1
    cvd = torch.randn(3, s.channels, 3, device=dev, generator=gen).to(torch.bfloat16)
    w = pk.LayerWeights(*(t.cpu() for t in wd))
    h, st, cv = hd.cpu(), std.cpu(), cvd.cpu()
    ws = pk.workspace(schedule, dev)
    table = schedule.table.to(dev)
    out = torch.full_like(hd, float("nan"))
    run(hd, out, wd, std.clone(), cvd.clone(), schedule, ws, table)  # warm-up (generation 1), on copies
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(hd, out, wd, std, cvd, schedule, ws, table)
    results = []
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        wait_or_die("graph check replay")
        expect = pk.layer_reference(h, w, st, cv, s)  # advances st, cv as the replay did on the device
        results.append(dict(out_vs_ref=rel(out.cpu(), expect), state_vs_ref=rel(std.cpu(), st),
                            conv_vs_ref=rel(cvd.cpu().float(), cv.float()),
                            epoch=int(ws.counters[schedule.epoch].item())))
    return results


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0]) if argv else Path(".")
    n_layers = int(argv[1]) if len(argv) > 1 else 20
    program_counts = [int(p) for p in argv[2].split(",")] if len(argv) > 2 else [132]
    asked = argv[3].split(",") if len(argv) > 3 else ["cuda+tl", "cuda_f2", "cuda_free", "cuda_loud"]
    only = [a.removesuffix("+tl") for a in asked]
    with_timeline = {a.removesuffix("+tl") for a in asked if a.endswith("+tl")}
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    s = pk.LayerShape()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {n_layers} layers of distinct weights", flush=True)
    t0 = time.time()
    layers = [pk.random_layer(s, device=dev) for _ in range(n_layers)]
    states = [(torch.randn(s.heads, s.head_dim, s.head_dim, device=dev) * 0.1,
               torch.randn(3, s.channels, 3, device=dev).to(torch.bfloat16)) for _ in range(n_layers)]
    final_norm = layers[0].in_norm.clone()
    h0 = torch.randn(1, s.hidden, device=dev).to(torch.bfloat16)
    print(f"weights {sum(t.numel() * t.element_size() for t in layers[0]) * n_layers / 1e9:.1f} GB in "
          f"{time.time() - t0:.1f} s", flush=True)
    result = dict(machine=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(0).multi_processor_count,
                  torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                  shape=dataclasses.asdict(s), layers=n_layers, copy_bandwidth=bw,
                  layer_bytes=pk.layer_bytes(s, layers[0]))
    result["floor_us"] = result["layer_bytes"] / bw * 1e6

    # correctness on layer 0 at the real shapes
    w, (st0, cv0) = layers[0], states[0]
    ref_st, ref_cv = st0.clone(), cv0.clone()
    expect = pk.layer_reference(h0, w, ref_st, ref_cv, s)
    ch_st, ch_cv, res = st0.clone(), cv0.clone(), h0.clone()
    x, _ = norm.fused_add_rms_norm(res, None, w.in_norm, s.eps)
    chain_layer(res, x, w, ch_st, ch_cv, s, final_norm)
    check, outs = {}, {}
    for name, programs, shape, options, run in variants(program_counts, only):
        schedule = pk.build_schedule(shape, programs, **options)
        ws = pk.workspace(schedule, dev)
        table = schedule.table.to(dev)
        ps_st, ps_cv = st0.clone(), cv0.clone()
        out = torch.full_like(h0, float("nan"))
        t_first = time.time()
        compiled = run(h0, out, w, ps_st, ps_cv, schedule, ws, table)
        wait_or_die(f"{name}, first launch")
        ids = sorted(ws.topk_i.tolist())
        outs[name] = (out, ps_st)
        check[name] = dict(
            out_vs_ref=rel(out, expect), out_vs_chain=rel(out, res), out_equal_chain=bool(torch.equal(out, res)),
            state_vs_ref=rel(ps_st, ref_st), conv_vs_ref=rel(ps_cv, ref_cv), experts=ids,
            tasks=len(schedule.tasks), max_tasks_per_program=schedule.max_tasks,
            first_call_s=round(time.time() - t_first, 1))
        if run is _triton:
            check[name].update(registers=compiled.n_regs, spills=compiled.n_spills)
        else:
            check[name].update(ring=dataclasses.asdict(pc.smem_plan(schedule)), default_inflight=pc.INFLIGHT,
                               default_free_kinds=[pk.KIND_NAMES[k] for k in pc.FREE_KINDS])
            tri = outs.get(f"persistent_p{programs}_norm_tasks")
            if tri is not None:
                check[name].update(out_vs_triton=rel(out, tri[0]), out_equal_triton=bool(torch.equal(out, tri[0])),
                                   state_vs_triton=rel(ps_st, tri[1]))
            check[name]["graph_generations"] = graph_check(schedule, run, dev)
        print(f"check {name}: {check[name]}", flush=True)
    result["check"] = dict(chain_vs_ref=rel(res, expect), chain_state_vs_ref=rel(ch_st, ref_st), persistent=check)
    print(f"chain vs ref: out {result['check']['chain_vs_ref']:.2e}, state {result['check']['chain_state_vs_ref']:.2e}",
          flush=True)

    # timing: both as CUDA graphs over all layers
    res = torch.empty_like(h0)
    hs = [torch.empty_like(h0) for _ in range(n_layers + 1)]

    def chain_all():
        res.copy_(h0)
        x, _ = norm.fused_add_rms_norm(res, None, layers[0].in_norm, s.eps, pdl=True)
        for i, (lw, (st, cv)) in enumerate(zip(layers, states)):
            x = chain_layer(res, x, lw, st, cv, s, layers[i + 1].in_norm if i + 1 < n_layers else final_norm)

    def graph(fn):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        wait_or_die("graph replay")
        return g

    graphs = {"chain": graph(chain_all)}
    tl_graphs = {}
    # a captured graph holds its buffers' addresses, not the tensors: every variant's workspace and table stay
    # referenced here until the end, or the allocator hands their memory to the next variant, whose counters
    # or timeline stamps would then overwrite an earlier graph's task table or counters
    alive = []
    for name, programs, shape, options, run in variants(program_counts, only):
        schedule = pk.build_schedule(shape, programs, **options)
        ws = pk.workspace(schedule, dev)
        table = schedule.table.to(dev)
        alive.append((ws, table))

        def pers_all(schedule=schedule, ws=ws, table=table, run=run, tl_=False):
            hs[0].copy_(h0)
            for i, (lw, (st, cv)) in enumerate(zip(layers, states)):
                run(hs[i], hs[i + 1], lw, st, cv, schedule, ws, table, timeline=tl_)

        graphs[name] = graph(pers_all)
        if name.split("_", 2)[2] in with_timeline:
            tl_graphs[name] = (graph(lambda pers_all=pers_all: pers_all(tl_=True)), ws, schedule)
    reps = 200
    timings = {name: [] for name in graphs}
    for _ in range(2):  # A B A B
        for name, g in graphs.items():
            timings[name].append(median_ms(g.replay, reps=reps, warm=10) * 1e3 / n_layers)
    result["per_layer_us"] = timings
    tls = {}
    for name, (tl_graph, tl_ws, tl_schedule) in tl_graphs.items():
        tl_graph.replay()
        wait_or_die("timeline replay")
        tls[name] = tl = timeline(tl_schedule, tl_ws.stamps)
        label = name.split("_", 2)[2]
        (out_dir / f"persistent_timeline_{label}.json").write_text(json.dumps(tl, indent=1))
        try:
            plot_timeline(tl, out_dir / f"persistent_timeline_{label}.png", label, cuda=label.startswith("cuda"))
        except Exception as e:  # the numbers matter more than the picture
            print(f"plot failed: {e}")
    result["timeline_summary"] = {n: {k: v for k, v in tl.items() if k != "tasks"} for n, tl in tls.items()}
    (out_dir / "persistent_layer.json").write_text(json.dumps(result, indent=1))

    print(f"\nper layer (median of {reps} replays of {n_layers} layers, two alternations), floor "
          f"{result['floor_us']:.2f} us ({result['layer_bytes'] / 1e6:.1f} MB at {bw / 1e12:.2f} TB/s)")
    for name, ts in timings.items():
        print(f"  {name:38s} {' / '.join(f'{t:7.2f}' for t in ts)} us   {min(ts) / result['floor_us']:.2f}x floor"
              f"  {min(ts) / min(timings['chain']):.2f}x chain")
    for name, tl in tls.items():
        print(f"timeline of {name} (last layer of a replay): span {tl['span_us']:.1f} us")
        for k, v in tl["by_kind"].items():
            print(f"  {k:10s} n={v['count']:4d} first start {v['first_start_us']:6.1f}"
                  f" last ready {v['last_ready_us']:6.1f} last end {v['last_end_us']:6.1f}"
                  f" mean issue {v['mean_issue_us']:5.2f} wait {v['mean_wait_us']:5.2f}"
                  f" after {v['mean_after_ready_us']:5.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
