"""The fused kernels in the model's step on the GPU: correctness, then step time before and after.

One TP=4 rank's shard of Ling-3.0-flash (random bf16 weights, all-reduce stubbed), LAYERS layers, an 8k
context. For T = 1 and 9: the plain step (`LingForCausalLM.step`, torch ops) and `FusedStep` (the Triton
kernels) from the same state, compared (relative error of the hidden state), then each captured in a CUDA
graph and timed (median of replays) next to the step's byte floor; the fused step also without programmatic
dependent launch (same bits required), to show what PDL saves. Writes JSON, prints a table.

    python -m bench.fused_step_gpu OUT.json [LAYERS] [--ts 1,5,9] [--variants VARIANTS.json]

`--variants` times launch settings side by side with the shipped ones in the same process: a JSON object
{name: {"moe": {T: knobs}, "kda": {T: [block_v, num_warps]}}} (knobs as `moe.fused_moe` takes them, T as a
string; a T a variant does not name runs the shipped settings). Each variant's step is captured in its own CUDA
graph from the same state, its output compared with the shipped settings' (relative error; launch settings move
no rounding unless they change a summation order), and the graphs are replayed in alternation, several rounds,
so a variant and the shipped step see the same machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch

from bench.common import CONTEXT, graphed, kernel_profile, random_state, write_result
from lingls.bench.floor import routed_experts, step_floor_ms
from lingls.bench.step import build_flash, copy_bandwidth, median_ms
from lingls.runtime.fused_step import FusedStep


def main(out: str, layers: int, ts: tuple[int, ...] = (1, 9), variants: dict | None = None) -> int:
    torch.manual_seed(0)
    return measure(build_flash(layers, tp=4, rank=0), out, copy_bandwidth(), ts=ts, variants=variants)


def _variant_ops(fused: FusedStep, spec: dict, t: int):
    """(moe, kda_step) of `fused` with a variant's launch settings for T=t (the shipped ones where it has none)."""
    from lingls.kernels import kda, moe

    knobs = spec.get("moe", {}).get(str(t))
    kda_knobs = spec.get("kda", {}).get(str(t))
    pdl = fused.ops.pdl
    return (partial(moe.fused_moe, pdl=pdl, **knobs) if knobs else fused.ops.moe,
            partial(kda.fused_kda_step, pdl=pdl, block_v=kda_knobs[0], num_warps=kda_knobs[1]) if kda_knobs
            else fused.ops.kda_step)


def time_variants(fused: FusedStep, variants: dict, t: int, ids, pos, state, base_out, rounds: int = 3) -> list[dict]:
    """The shipped settings and each variant that names T=t: output against the shipped one, then graph replays
    in alternation (`rounds` medians of 30 replays each)."""
    shipped = (fused.ops.moe, fused.ops.kda_step)
    graphs, rows = {}, []
    mine = {n: v for n, v in variants.items() if any(str(t) in v.get(op, {}) for op in ("moe", "kda"))}
    try:
        for name, spec in {"shipped": {}, **mine}.items():
            fused.ops.moe, fused.ops.kda_step = _variant_ops(fused, spec, t)
            with torch.inference_mode():
                got = fused.step(ids, state.clone(), pos).float()
                work = state.clone()
                graphs[name] = graphed(lambda: fused.step(ids, work, pos))
            rows.append(dict(name=name, spec=spec, rel_to_shipped=((got - base_out).norm() / base_out.norm()).item(),
                             bit_identical_to_shipped=torch.equal(got, base_out), ms=[]))
        for _ in range(rounds):
            for row in rows:
                row["ms"].append(median_ms(graphs[row["name"]], reps=30))
        for row in rows:
            row["ms_best"], row["ms_median"] = min(row["ms"]), sorted(row["ms"])[len(row["ms"]) // 2]
    finally:
        fused.ops.moe, fused.ops.kda_step = shipped
    return rows


def profile_variants(fused: FusedStep, variants: dict, t: int, ids, pos, state, rows: list[dict]) -> None:
    """Each variant's device time per kernel (eager, after every timing: see `measure`)."""
    shipped = (fused.ops.moe, fused.ops.kda_step)
    try:
        for row in rows:
            fused.ops.moe, fused.ops.kda_step = _variant_ops(fused, row["spec"], t)
            work = state.clone()
            with torch.inference_mode():
                row["kernels"] = kernel_profile(lambda: fused.step(ids, work, pos))
    finally:
        fused.ops.moe, fused.ops.kda_step = shipped


def measure(model, out: str, bw: float, extra: dict | None = None, ts: tuple[int, ...] = (1, 9),
            variants: dict | None = None) -> int:
    """Check and time the fused step of `model` against the plain step at each T of `ts` (and `variants`' launch
    settings beside the shipped ones, see the module note); JSON to `out` (plus `extra`)."""
    layers = len(model.decoder_layers)
    vocab = model.config.vocab_size
    state = random_state(model)
    fused = FusedStep(model, kernels=True)
    fused_no_pdl = FusedStep(model, kernels=True, pdl=False)  # the same kernels, each launch waiting for the last
    fused_ref = FusedStep(model, kernels=False)  # the same wiring on the plain-torch references (fp32 math)
    rows, ok, profiled = [], True, []
    for t in ts:
        ids = torch.randint(0, vocab, (t,), device="cuda")
        pos = torch.arange(CONTEXT - t, CONTEXT, device="cuda")
        with torch.inference_mode():
            s_ref, s_fused = state.clone(), state.clone()
            want = model.step(ids, s_ref, pos).float()
            got = fused.step(ids, s_fused, pos).float()
            # PDL changes when kernels start, never what they compute: the same bits with and without it
            pdl_identical = torch.equal(got, fused_no_pdl.step(ids, state.clone(), pos).float())
            rel = ((got - want).norm() / want.norm()).item()
            ref_out = fused_ref.step(ids, state.clone(), pos).float()
            rel_kernels = ((got - ref_out).norm() / ref_out.norm()).item()  # kernels vs their references
            rel_plain = ((want - ref_out).norm() / ref_out.norm()).item()  # the bf16 torch step vs the references
            rel_state = ((s_fused.kda - s_ref.kda).norm() / s_ref.kda.norm()).item()
            distinct = routed_experts(model, lambda: model.step(ids, state.clone(), pos))
            work = state.clone()
            plain = graphed(lambda: model.step(ids, work, pos))
            plain_ms = median_ms(plain, reps=30)
            fast = graphed(lambda: fused.step(ids, work, pos))
            fused_ms = median_ms(fast, reps=30)
            no_pdl = graphed(lambda: fused_no_pdl.step(ids, work, pos))
            no_pdl_ms = median_ms(no_pdl, reps=30)
        profiled.append((t, ids, pos, work))
        if variants:  # printed as measured, so a run stopped at its time limit still shows them
            side = time_variants(fused, variants, t, ids, pos, state, got)
            print(f"T={t} shipped step {fused_ms:.3f} ms; side by side, alternated (best / median ms, rel to shipped):")
            for v in side:
                print(f"  {v['name']:>16} {v['ms_best']:.3f} / {v['ms_median']:.3f}  {v['rel_to_shipped']:.1e}")
        floor_ms = step_floor_ms(model, t, CONTEXT - t, distinct, bw, head=False)
        # a deep random-weight stack amplifies bf16 rounding (42 layers: the bf16 torch step itself is ~0.3-0.6 off
        # the fp32 references), so the kernels pass when they are as close to the references as that step is
        ok &= rel_kernels <= 2 * rel_plain + 3e-2 and pdl_identical
        rows.append(dict(T=t, rel_err_hidden=rel, rel_kernels_vs_references=rel_kernels,
                         rel_plain_vs_references=rel_plain, rel_err_kda_state=rel_state,
                         distinct_experts=sum(distinct) / len(distinct),
                         pdl_bit_identical=pdl_identical, plain_graph_ms=plain_ms, fused_graph_ms=fused_ms,
                         fused_no_pdl_graph_ms=no_pdl_ms,
                         floor_ms=floor_ms,
                         fused_over_floor=fused_ms / floor_ms, speedup=plain_ms / fused_ms))
        if variants:
            rows[-1]["variants"] = side
    # the profiles last: after a profiler session this process's graph replays run slower (the trace probe,
    # docs/kernel-log.md), so a profile between two timings made the second one slower
    # (T=9 4.094 against 4.013 ms, docs/kernel-log.md)
    for row, (t, ids, pos, work) in zip(rows, profiled):
        with torch.inference_mode():
            row["kernels"] = kernel_profile(lambda: fused.step(ids, work, pos))
        print(f"T={t} fused step, device time per kernel (eager):")
        for p in row["kernels"]:
            print(f"  {p['us_per_step']:8.1f} us  {p['launches_per_step']:6.1f} x  {p['kernel']}")
        if variants:
            profile_variants(fused, variants, t, ids, pos, work, row["variants"])
    result = dict(what=f"fused step vs plain step, one TP={model.par.size} rank of Ling-3.0-flash", layers=layers,
                  context=CONTEXT,
                  device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw_tbs=bw / 1e12, rows=rows,
                  **(extra or {}))
    write_result(out, result)
    print(f"{layers} layers, copy {bw / 1e12:.2f} TB/s")
    for r in rows:
        print(f"T={r['T']}: |fused - plain| {r['rel_err_hidden']:.1e}, |fused - references| "
              f"{r['rel_kernels_vs_references']:.1e}, |plain - references| {r['rel_plain_vs_references']:.1e}, "
              f"PDL bit-identical {r['pdl_bit_identical']}")
    print(f"{'T':>3} {'rel err':>8} {'plain ms':>9} {'no-PDL ms':>9} {'fused ms':>9} {'floor ms':>9} "
          f"{'fused/floor':>11} {'speedup':>8}")
    for r in rows:
        print(f"{r['T']:>3} {r['rel_err_hidden']:>8.1e} {r['plain_graph_ms']:>9.3f} "
              f"{r['fused_no_pdl_graph_ms']:>9.3f} {r['fused_graph_ms']:>9.3f} {r['floor_ms']:>9.3f} "
              f"{r['fused_over_floor']:>11.2f} {r['speedup']:>8.2f}")
    for r in rows:
        if "variants" in r:
            print(f"T={r['T']} launch settings side by side ({len(r['variants'][0]['ms'])} alternated rounds; "
                  f"device time of the MoE expert and KDA kernels per step, eager):")
            for v in r["variants"]:
                dev = {p["kernel"]: p["us_per_step"] for p in v.get("kernels", [])}
                mine = "  ".join(f"{k.strip('_').split('_kernel')[0]} {dev[k]:.0f}" for k in
                                 ("_gate_up_kernel", "_down_kernel", "_kda_step_kernel") if k in dev)
                print(f"  {v['name']:>16} best {v['ms_best']:.3f} ms  median {v['ms_median']:.3f}  "
                      f"rel {v['rel_to_shipped']:.1e}  {mine}")
    return 0 if ok else 1


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default="fused_step.json")
    p.add_argument("layers", nargs="?", type=int, default=42)
    p.add_argument("--ts", default="1,9", help="token counts to check and time, comma-separated")
    p.add_argument("--variants", help="JSON file of launch settings to time beside the shipped ones")
    return p.parse_args(argv)


if __name__ == "__main__":
    a = _args(sys.argv[1:])
    sys.exit(main(a.out, a.layers, tuple(int(t) for t in a.ts.split(",")),
                  json.load(open(a.variants)) if a.variants else None))
