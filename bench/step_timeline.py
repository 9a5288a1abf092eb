"""Where a graph-replayed decode step spends its time: each kernel's share of the critical path.

Under programmatic dependent launch a kernel starts before the one it follows has finished (its programs wait
inside, at `gdc_wait`), so the per-kernel device times of a profile overlap and add up to more than the step,
and a kernel that looks long may only have been waiting. This benchmark replays the step's CUDA graph under
CUPTI (torch.profiler), takes every kernel's start and end, and charges each kernel with what it adds to the
step: how much later the latest end so far moves when it ends (kernels in launch order). Those shares sum to
the traced step. Per kernel name, and per position in a KDA and an MLA layer (median over the layers), beside
each kernel's own device time and its lead (how long before the previous kernel ended it started). At T=1
also under other PDL trigger policies (`POLICIES`), each captured and timed in its own graph.

    python -m bench.step_timeline OUT.json [LAYERS] [--tp N]

Rank 0's shard of a TP=N Ling-3.0-flash (default 4; random bf16 weights, all-reduce stubbed), 8k context,
T = 1 and 9.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from bench.common import CONTEXT, graphed, random_state, write_result
from lingls.bench.step import build_flash, median_ms
from lingls.kernels import pdl
from lingls.runtime.fused_step import FusedStep

REPS = 5


def traced_kernels(replay, reps: int) -> list[list[dict]]:
    """[step][kernel] = {name, start, end} in µs for `reps` synchronised replays of a captured graph."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    kernels = sorted((dict(name=e["name"], start=float(e["ts"]), end=float(e["ts"]) + float(e["dur"]))
                      for e in trace["traceEvents"] if e.get("cat") == "kernel"), key=lambda k: k["start"])
    assert kernels, "no kernel events: CUPTI did not trace the graph's kernels"
    per = len(kernels) // reps
    assert per * reps == len(kernels), f"{len(kernels)} kernels in {reps} replays"
    return [kernels[i * per:(i + 1) * per] for i in range(reps)]


def short(name: str) -> str:
    return name.split("(")[0].split("<")[0].replace("void ", "").strip("_")[:28]


def shares(step: list[dict]) -> list[dict]:
    """Each kernel of one step with its critical-path share (the latest end's increment), its own duration and
    its lead over the previous kernel's end."""
    latest = step[0]["start"]
    out = []
    for i, k in enumerate(step):
        prev_end = step[i - 1]["end"] if i else k["start"]
        out.append(dict(name=short(k["name"]), share=max(0.0, k["end"] - latest), dur=k["end"] - k["start"],
                        lead=max(0.0, prev_end - k["start"])))
        latest = max(latest, k["end"])
    return out


def layer_runs(step: list[dict]) -> dict[str, list[list[dict]]]:
    """The step's kernels cut into layers (a layer begins at an add + RMSNorm followed by a projection), keyed by
    the layer's sequence of kernel names."""
    runs: dict[str, list[list[dict]]] = defaultdict(list)
    cur: list[dict] = []
    for i, k in enumerate(step):
        nxt = step[i + 1]["name"] if i + 1 < len(step) else ""
        if k["name"].startswith("add_rms_norm") and nxt.startswith("gemv") and cur and \
                any(c["name"].startswith("down") or c["name"].startswith("gemv") for c in cur[1:]):
            runs[" > ".join(c["name"] for c in cur)].append(cur)
            cur = []
        cur.append(k)
    if cur:
        runs[" > ".join(c["name"] for c in cur)].append(cur)
    return runs


def analyse(steps: list[list[dict]]) -> dict:
    per_step = [shares(s) for s in steps]
    spans = [s[-1]["end"] - s[0]["start"] for s in steps]
    by_name: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rows in per_step:
        totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for r in rows:
            t = totals[r["name"]]
            t["share"] += r["share"]
            t["dur"] += r["dur"]
            t["count"] += 1
        for name, t in totals.items():
            for key, v in t.items():
                by_name[name][key].append(v)
    names = sorted(by_name, key=lambda n: -statistics.median(by_name[n]["share"]))
    table = [dict(kernel=n, share_us=statistics.median(by_name[n]["share"]),
                  device_us=statistics.median(by_name[n]["dur"]), launches=by_name[n]["count"][0]) for n in names]
    # per position in the most common layer shapes (median over the layers of the middle replay)
    layers = []
    runs = layer_runs(per_step[len(per_step) // 2])
    for seq, items in sorted(runs.items(), key=lambda kv: -len(kv[1]))[:3]:
        if len(items) < 2:
            continue
        cols = list(zip(*items))
        layers.append(dict(sequence=seq, layers=len(items), kernels=[
            dict(kernel=col[0]["name"], share_us=statistics.median(c["share"] for c in col),
                 device_us=statistics.median(c["dur"] for c in col),
                 lead_us=statistics.median(c["lead"] for c in col)) for col in cols]))
    return dict(traced_step_us=statistics.median(spans), kernels=table, layers=layers)


# PDL trigger policies timed side by side at T=1 (lingls.kernels.pdl: which kernel kinds let the next kernel
# launch before their own wait); the first is the shipped one, the only one timed at T=9
POLICIES = {"shipped": set(pdl.EARLY_KINDS), "late": set(), "late down": set(pdl.EARLY_KINDS) - {"down"},
            "late norm": set(pdl.EARLY_KINDS) - {"norm"}}


def report(t: int, policy: str, graph_ms: float, a: dict) -> None:
    flag = "" if a["trace_matches_graph"] else " (trace off the replay time: shares not to be read)"
    print(f"\nT={t}, trigger policy {policy!r}: graph replay {graph_ms * 1e3:.0f} us, traced "
          f"{a['traced_step_us']:.0f} us{flag}")
    print(f"  {'kernel':28} {'share us':>9} {'device us':>10} {'launches':>8}")
    for r in a["kernels"]:
        print(f"  {r['kernel']:28} {r['share_us']:9.1f} {r['device_us']:10.1f} {r['launches']:8.0f}")
    for lay in a["layers"][:2]:
        print(f"  {lay['layers']} layers of: {lay['sequence']}")
        for k in lay["kernels"]:
            print(f"    {k['kernel']:28} share {k['share_us']:6.2f}  device {k['device_us']:6.2f}  "
                  f"lead {k['lead_us']:6.2f} us")


def main(out: str, layers: int, tp: int) -> int:
    torch.manual_seed(0)
    model = build_flash(layers, tp=tp, rank=0)
    fused = FusedStep(model, kernels=True)
    state = random_state(model)
    result = dict(what=f"critical-path share per kernel of the fused step (CUPTI timestamps of graph replays), one "
                       f"TP={tp} rank of Ling-3.0-flash", layers=layers, context=CONTEXT, tp=tp,
                  device=torch.cuda.get_device_name(), torch=torch.__version__, rows=[])
    shipped = set(pdl.EARLY_KINDS)
    runs = [(1, policy, kinds) for policy, kinds in POLICIES.items()] + [(9, "shipped", shipped)]
    graphs = []
    with torch.inference_mode():
        # every graph timed before any tracing: after a trace, replays in the same process timed 100-150 us slower
        for t, policy, kinds in runs:
            ids = torch.randint(0, model.config.vocab_size, (t,), device="cuda")
            pos = torch.arange(CONTEXT - t, CONTEXT, device="cuda")
            pdl.EARLY_KINDS = kinds
            replay = graphed(lambda ids=ids, pos=pos: fused.step(ids, state, pos))
            graphs.append((replay, median_ms(replay, reps=30)))
        pdl.EARLY_KINDS = shipped
        for (t, policy, kinds), (replay, graph_ms) in zip(runs, graphs):
            a = analyse(traced_kernels(replay, REPS))
            # a trace need not describe the replay it timed: with a profiler session active, replays run at about
            # the no-PDL time (T=1 1.42 -> 1.95 ms, T=9 4.18 -> 4.66, same output bits) while the trace spans 1.42
            # and ~3.04 ms (the trace probe, docs/kernel-log.md). A trace off its replay is flagged, its shares not
            # to be read
            a["trace_matches_graph"] = abs(a["traced_step_us"] / (graph_ms * 1e3) - 1) < 0.1
            result["rows"].append(dict(T=t, policy=policy, early_kinds=sorted(kinds), graph_ms=graph_ms, **a))
            report(t, policy, graph_ms, a)
    write_result(out, result)
    print("\ngraph replay (traced), us: " + ", ".join(f"T={r['T']} {r['policy']} {r['graph_ms'] * 1e3:.0f} "
                                                    f"({r['traced_step_us']:.0f})" for r in result["rows"]))
    return 0


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default="step_timeline.json")
    p.add_argument("layers", nargs="?", type=int, default=42)
    p.add_argument("--tp", type=int, default=4, help="time rank 0's shard of a TP=N deployment (default 4)")
    a = p.parse_args()
    sys.exit(main(a.out, a.layers, a.tp))
