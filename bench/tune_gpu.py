"""Choose the launch settings of the MLA decode, KDA step, fused MoE and GEMV kernels on this GPU, then time the
fused step.

At batch 1 these kernels are latency-bound: how many programs stream at once and how many loads each has in
flight decides their time, and that depends on the GPU. So each candidate setting is timed here, in a CUDA
graph over all the layers of one rank (TP=4 unless --tp) of Ling-3.0-flash (random bf16 weights, 8k context:
every call reads another layer's weights, as in a real step), for T=1 (decode) and T=9 (verify of 8 drafts).
MLA sweeps (splits, block rows, warps); KDA its value columns per program and warps (staged per position at
T=9, as in verification); MoE sweeps its router and routing, gate-up (split-K) and down settings (FMA path at
T=1) one kernel at a time, rejecting any candidate whose output or experts differ from the reference; GEMV its
settings per shape (the FMA path at T=1). The best go into `mla.CONFIGS` / `kda.CONFIGS` / `moe.CONFIGS` /
`gemv.CONFIGS` for this process, and `fused_step_gpu.measure` then checks and times the whole step with them.
The JSON lists every candidate. `--ship PATH` writes a copy of lingls/kernels/tuned.json with the winners over the
shipped entries, each naming this GPU and commit (LINGLS_COMMIT where the tree has no git): copy it over the
package's file to ship them. Every MoE stage starts from the
shipped settings, so a sweep cut short by the budget never replaces them with an untimed choice.

    python -m bench.tune_gpu OUT.json [LAYERS [TUNING_BUDGET_S [T,... [STAGE,...]]]] [--tp N] [--ship PATH]
    (T: 1 and/or 9, default both; STAGE: mla, kda, moe (or moe-down: only its down kernel), gemv (or gemv-tma:
    only the descriptor-load path's candidates, T > 1), default all;
    --tp: the rank shapes of TP=N, default 4; the settings are kept per width, heads or expert rows per rank,
    so each TP degree has its own)
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import CONTEXT, graphed
from bench.fused_step_gpu import measure
from lingls.bench.step import build_flash, copy_bandwidth, median_ms
from lingls.kernels import TUNED, gemv, kda, mla, moe
from lingls.model.config import KDA
from lingls.runtime.fused_step import FusedStep

MLA_CANDIDATES = [(128, 32, 8), (64, 32, 8), (128, 16, 4), (256, 16, 4), (128, 64, 8), (32, 32, 4), (64, 32, 4),
                  (32, 16, 4), (16, 32, 4)]  # (splits, rows per block, warps)
# verify steps: several heads per program in one larger tile (each split's rows cross L2 once per program, not
# once per head; the acc tile spills more): (splits, rows per block, warps, heads per program)
MLA_CANDIDATES += [(32, 16, 8, 4), (64, 16, 8, 4), (16, 16, 8, 4), (32, 32, 8, 2), (32, 16, 8, 2), (64, 16, 8, 2)]
DEADLINE = [float("inf")]  # candidates are skipped after this time (the device call has a wall-clock limit)
# router: experts and H columns per program, H ranges, warps; the routing's warps (its own launch)
ROUTER = [dict(router_block_e=e, router_block_k=bk, router_split=s, router_warps=w, route_warps=rw)
          for e, bk, s, w, rw in ((8, 512, 5, 2, 1), (8, 512, 5, 4, 2), (8, 512, 5, 4, 4), (16, 256, 10, 4, 1),
                                  (8, 128, 4, 4, 4), (16, 512, 5, 4, 4), (16, 512, 5, 4, 2), (16, 512, 5, 8, 4),
                                  (8, 512, 5, 8, 4), (8, 512, 5, 4, 8), (8, 512, 5, 4, 16))]
# gate-up: rows per program, H ranges per block (split-K), warps, H tile, FMA path (T=1 only)
GATE_UP = [dict(block_i=b, gu_split=s, gu_warps=w, gu_block_k=bk, gu_fma=f)
           for b, s, w, bk, f in ((32, 1, 4, 256, False), (16, 1, 4, 256, False), (32, 2, 4, 256, False),
                                  (32, 4, 4, 128, False), (16, 4, 4, 128, False), (64, 4, 8, 128, False),
                                  (16, 4, 4, 128, True), (8, 5, 4, 512, True), (16, 5, 4, 256, True),
                                  (32, 4, 4, 64, True), (16, 2, 4, 128, True), (8, 10, 2, 256, True),
                                  (64, 1, 4, 256, False), (64, 1, 8, 256, False), (32, 1, 8, 256, False),
                                  (32, 1, 4, 512, False),
                                  (8, 1, 2, 256, True), (4, 1, 2, 256, True), (8, 1, 4, 512, True),  # T=1: no partials
                                  (8, 1, 8, 512, True), (4, 1, 4, 512, True), (4, 1, 2, 512, True),
                                  (16, 1, 8, 512, True), (8, 1, 8, 1024, True), (4, 1, 4, 256, True))]
# down: rows per program, slot shares, warps, FMA path (T=1 only), I columns per chunk (0: all), every tile
# requested before the wait (T=1 only; the shipped TP=4 form: in the step it beat the 16-way split with partials,
# alone it did not, so judge these in the step with bench/ab_session.sh)
DOWN = [dict(block_h=h, split_d=d, dn_warps=w, dn_fma=f, dn_block_i=bi, dn_ahead=a)
        for h, d, w, f, bi, a in
        ((16, 4, 4, False, 0, False), (32, 4, 4, False, 0, False), (64, 8, 4, False, 0, False),
         (32, 16, 4, False, 0, False), (64, 16, 4, False, 0, False), (128, 8, 8, False, 0, False),
         (16, 16, 4, True, 0, False), (32, 16, 4, True, 0, False), (32, 8, 4, True, 0, False),
         (64, 16, 8, True, 0, False), (64, 4, 8, True, 0, False), (64, 32, 4, False, 0, False),
         (128, 16, 8, False, 0, False), (32, 32, 4, False, 0, False), (64, 16, 8, False, 0, False),
         (128, 32, 8, False, 0, False),
         # I in chunks (192 = 3 x 64, 384 = 3 x 128)
         (64, 8, 4, False, 64, False), (64, 16, 4, False, 64, False), (64, 16, 4, False, 128, False),
         (128, 16, 4, False, 64, False), (128, 8, 8, False, 128, False), (64, 8, 4, False, 128, False),
         (32, 16, 4, False, 128, False), (128, 16, 8, False, 128, False), (64, 32, 4, False, 64, False),
         (16, 16, 4, True, 64, False), (16, 16, 4, True, 128, False), (32, 16, 4, True, 64, False),
         (32, 16, 4, True, 128, False), (16, 16, 2, True, 128, False), (64, 16, 8, True, 64, False),
         # one token, few rows per program, all (or half) the slots: no partials to sum
         (8, 1, 2, True, 0, False), (8, 2, 2, True, 0, False), (16, 1, 4, True, 0, False), (4, 1, 1, True, 0, False),
         (8, 1, 1, True, 0, False),
         # the same with every tile requested before the wait
         (16, 1, 4, True, 64, True), (32, 1, 8, True, 64, True), (16, 1, 8, True, 64, True), (16, 2, 4, True, 64, True),
         (8, 1, 2, True, 64, True))]
# (block_v, num_warps); 64 value columns (two programs per head) compile without spills at T=1 with 4 or 8 warps
# and at T=9 with 4 (ptxas, sm_90; 8 warps spill 88 bytes there), 128 spill; one warp up to 16 columns at T=16
KDA_CANDIDATES = [(bv, w) for bv in (8, 16, 32) for w in (2, 4, 8)] + [(64, 4), (64, 8), (4, 1), (8, 1), (16, 1)]
GEMV = [{}] + [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st, fma=f)
               for bn, bk, w, st, f in ((16, 128, 4, 3, False), (32, 128, 4, 3, False), (32, 256, 4, 3, False),
                                        (64, 256, 4, 3, False), (64, 128, 8, 4, False), (32, 512, 4, 2, False),
                                        (16, 256, 4, 4, False), (16, 256, 4, 3, True), (32, 128, 4, 3, True),
                                        (32, 256, 8, 3, True), (64, 64, 4, 3, True), (64, 128, 8, 2, True),
                                        (8, 512, 4, 3, True), (4, 512, 2, 3, True), (4, 512, 4, 3, True),
                                        (8, 512, 8, 3, True), (16, 512, 8, 3, True), (8, 256, 4, 3, True))] + \
       [dict(block_n=bn, block_k=bk, split_k=sk, num_warps=4, num_stages=3, fma=f)  # more programs per row block
        for bn, bk, sk, f in ((8, 256, 2, True), (16, 128, 4, True), (8, 128, 4, True), (32, 128, 4, False),
                              (16, 128, 8, False))]  # {}: the shipped settings (CONFIGS, else the automatic plan)
# verify steps through descriptor loads and the swapped warpgroup MMA (gemv's `tma` path): rows, K tile, K ranges,
# pipeline stages
GEMV_TMA = [dict(block_n=bn, block_k=bk, split_k=sk, num_warps=4, num_stages=st, tma=True)
            for bn, bk, sk, st in ((64, 128, 2, 4), (64, 128, 4, 3), (64, 128, 1, 4), (128, 128, 2, 3),
                                   (64, 256, 2, 3), (64, 64, 4, 4), (128, 64, 4, 4),
                                   (64, 128, 1, 6), (64, 128, 1, 8), (64, 256, 1, 4))]  # unsplit, deeper
GEMV += GEMV_TMA


def graph_us(calls, per_graph: int) -> float:
    """Median µs per call of `calls` (a list of closures) captured back to back in one CUDA graph."""
    replay = graphed(lambda: [c() for c in calls])
    return median_ms(replay, reps=20) * 1e3 / per_graph


def tune_mla(model, t: int) -> list[dict]:
    """The attention of every MLA layer as the step runs it (split kernel, then the merge with W_v and the gate)."""
    layers = [layer.attention for layer in model.decoder_layers if layer.kind != KDA]
    heads, rank = layers[0].heads, layers[0].rank
    caches = [torch.randn(CONTEXT + 64, rank + layers[0].rope, device="cuda", dtype=torch.bfloat16) for _ in layers]
    w_vs = [a.kv_b_proj.weight.detach().view(heads, a.nope + a.vdim, rank)[:, a.nope:] for a in layers]
    q_lat = torch.randn(t, heads, rank, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(t, heads, layers[0].rope, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(t, heads, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(CONTEXT - t, CONTEXT, device="cuda")
    want = mla.mla_attend_reference(q_lat, q_rope, caches[0][:CONTEXT], pos, 0.07, w_vs[0], gate).float()
    rows = []
    for splits, bn, warps, *per_program in MLA_CANDIDATES:
        if time.time() > DEADLINE[0]:
            break
        if per_program and (t == 1 or heads % per_program[0]):  # one token: all heads fit one tile already
            continue
        knobs = dict(num_splits=splits, block_n=bn, num_warps=warps)
        if per_program:
            knobs["heads"] = per_program[0]
        try:
            got = mla.mla_decode_triton(q_lat, q_rope, caches[0][:CONTEXT], pos, 0.07, w_vs[0], gate, **knobs).float()
            err = ((got - want).norm() / want.norm()).item()
            us = graph_us([lambda c=c, w=w: mla.mla_decode_triton(q_lat, q_rope, c[:CONTEXT], pos, 0.07, w, gate,
                                                                   **knobs)
                           for c, w in zip(caches, w_vs)], len(caches))
            rows.append(dict(T=t, **knobs, us=us, rel_err=err))
        except Exception as e:  # noqa: BLE001 - a candidate that fails to compile or run is reported, not fatal
            rows.append(dict(T=t, **knobs, error=repr(e)[:200]))
    return rows


def tune_gemv(fused: FusedStep, t: int, candidates: list[dict] = GEMV) -> list[dict]:
    """Every GEMV shape of the step (all its layers' weights of that shape, so no call hits L2 for another)."""
    shapes: dict[tuple[int, int, bool], list[torch.Tensor]] = {}
    for entry in fused.layers:
        layer = entry["layer"]
        for key in ("proj", "mla_proj"):  # a KDA or MLA layer's fused projections, then its output projection
            if key in entry:
                shapes.setdefault((entry[key].shape[0], entry[key].shape[1], False), []).append(entry[key])
                w = layer.attention.dense.weight
                shapes.setdefault((w.shape[0], w.shape[1], False), []).append(w)
        if "gate_up" in entry:
            gu, dn = entry["gate_up"], layer.mlp.down_proj.weight
            shapes.setdefault((gu.shape[0] // 2, gu.shape[1], True), []).append(gu)
            shapes.setdefault((dn.shape[0], dn.shape[1], False), []).append(dn)
    rows = []
    for (n, k, swiglu), ws in shapes.items():
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(t, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
        for cand in candidates:
            if (t > 1 and cand.get("fma")) or (t == 1 and cand.get("tma")) or time.time() > DEADLINE[0]:
                continue
            try:
                want = gemv.gemv_reference(x, ws[0], swiglu=swiglu).float()
                err = ((gemv.gemv(x, ws[0], swiglu=swiglu, pdl=True, **cand).float() - want).norm()
                       / want.norm()).item()
                us = graph_us([lambda w=w, o=o: gemv.gemv(x, w, swiglu=swiglu, out=o, pdl=True, **cand)
                               for w, o in zip(ws, outs)], len(ws))
                rows.append(dict(T=t, n=n, k=k, swiglu=swiglu, **cand, us=us, rel_err=err))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(T=t, n=n, k=k, swiglu=swiglu, **cand, error=repr(e)[:200]))
    return rows


def tune_kda(fused: FusedStep, t: int) -> list[dict]:
    """The KDA step of every KDA layer (its own weights, state and inputs), staged per position at T > 1 as in
    a verify step; each candidate checked against the reference on the first layer."""
    rows, calls = [], []
    for entry in fused.layers:
        if "proj" not in entry:
            continue
        attn = entry["layer"].attention
        c, h, d = attn.heads * attn.d, attn.heads, attn.d
        inp = dict(q=torch.randn(t, c, device="cuda", dtype=torch.bfloat16),
                   k=torch.randn(t, c, device="cuda", dtype=torch.bfloat16),
                   v=torch.randn(t, c, device="cuda", dtype=torch.bfloat16),
                   f=torch.randn(t, c, device="cuda", dtype=torch.bfloat16),
                   b=torch.randn(t, h, device="cuda", dtype=torch.bfloat16),
                   z=torch.randn(t, c, device="cuda", dtype=torch.bfloat16),
                   conv_state=torch.randn(3, c, 3, device="cuda", dtype=torch.bfloat16),
                   conv_weight=entry["conv"], a_log=attn.A_log, dt_bias=attn.dt_bias, norm_weight=attn.o_norm.weight,
                   state=torch.randn(h, d, d, device="cuda") * 0.01)
        stage = (torch.empty(t, h, kda.STAGE_ROWS, d, device="cuda"),
                 torch.empty(t, 3, c, device="cuda", dtype=torch.bfloat16))
        calls.append((inp, stage if t > 1 else None, dict(lower_bound=attn.lower_bound, eps=attn.eps)))
    first, _, kw = calls[0]
    pristine = first["conv_state"].clone(), first["state"].clone()  # the timed calls update the live state

    def fresh() -> dict:
        return {**first, "conv_state": pristine[0].clone(), "state": pristine[1].clone()}

    want = kda.kda_step_reference(**fresh(), **kw).float()
    for bv, warps in KDA_CANDIDATES:
        if time.time() > DEADLINE[0]:
            break
        knobs = dict(block_v=bv, num_warps=warps)
        try:
            got = kda.fused_kda_step(**fresh(), **kw, **knobs).float()
            err = ((got - want).norm() / want.norm()).item()
            us = graph_us([lambda i=i, st=st, k=k: kda.fused_kda_step(**i, stage=st, **k, **knobs)
                           for i, st, k in calls], len(calls))
            rows.append(dict(T=t, **knobs, us=us, rel_err=err))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(T=t, **knobs, error=repr(e)[:200]))
    return rows


def routing_ok(x, w: moe.MoEWeights, cfg: dict, ti: torch.Tensor) -> bool:
    """The kernel's experts are the reference router's (fp64 logits), up to choices whose scores tie to 1e-5."""
    logits = x.double() @ w.router_w.double().t()
    _, ri = moe.ref.route_grouped_topk(logits, w.expert_bias.double(), cfg["top_k"], cfg["n_group"],
                                       cfg["topk_group"], cfg["normalize"], cfg["scale"])
    choice = logits.sigmoid() + w.expert_bias.double()
    for t in range(x.shape[0]):
        got, want = ti[t].long(), ri[t].long()
        if set(got.tolist()) != set(want.tolist()) and \
                (choice[t, got].sort().values - choice[t, want].sort().values).abs().max().item() > 1e-5:
            return False
    return True


def tune_moe(fused: FusedStep, t: int, stages=(ROUTER, GATE_UP, DOWN)) -> list[dict]:
    entries = [e["moe"] for e in fused.layers if "moe" in e]
    x = torch.randn(t, fused.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    cfg = fused.moe_cfg
    best = dict(moe.config_for(t, entries[0].down.shape[2]))
    rows = []
    for stage in stages:
        results = []
        for cand in [{}] + stage:  # {}: the best so far (at first, the shipped settings)
            if (t > 1 and (cand.get("dn_fma") or cand.get("gu_fma"))) or time.time() > DEADLINE[0]:
                continue
            knobs = {**best, **cand}
            try:
                got, tw, ti = moe.fused_moe(x, *entries[0], **cfg, **knobs, return_routing=True, pdl=True)
                want = moe.fused_moe_reference(x, *entries[0], **cfg, routing=(tw, ti)).float()
                err = ((got.float() - want).norm() / want.norm()).item()
                if not routing_ok(x, entries[0], cfg, ti):
                    err = float("inf")  # chose experts the reference router would not (beyond near-ties)
                us = graph_us([lambda w=w: moe.fused_moe(x, *w, **cfg, **knobs, pdl=True) for w in entries],
                              len(entries))
                if err < 2e-2:  # a candidate that computes something else never wins
                    results.append((us, knobs))
                rows.append(dict(T=t, **knobs, us=us, rel_err=err))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(T=t, **knobs, error=repr(e)[:200]))
        if results:
            best = min(results, key=lambda r: r[0])[1]
    return rows


def router_probe(fused: FusedStep) -> dict:
    """µs per layer at T=1 of the router launch alone (the matvec) and of it followed by the routing's launch:
    what the routing costs, at the shipped settings."""
    entries = [e["moe"] for e in fused.layers if "moe" in e]
    cfg, knobs = fused.moe_cfg, moe.config_for(1, entries[0].down.shape[2])
    x = torch.randn(1, fused.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    e, h = entries[0].router_w.shape
    k_per, split = moe._h_ranges(h, knobs["router_split"], knobs["router_block_k"])
    part = torch.empty(split, 16, e, device="cuda")
    tw, ti = torch.empty(1, cfg["top_k"], device="cuda"), torch.empty(1, cfg["top_k"], device="cuda", dtype=torch.int32)
    slots = torch.empty(cfg["top_k"] + 1, device="cuda", dtype=torch.int32)
    wt = torch.empty(1, e, device="cuda")
    routing = dict(TOP_K=cfg["top_k"], K_PAD=cfg["top_k"], G=cfg["n_group"], G_PAD=cfg["n_group"],
                   EPG=e // cfg["n_group"], EPG_PAD=e // cfg["n_group"], E_PAD=e, TOPK_GROUP=cfg["topk_group"],
                   NORMALIZE=cfg["normalize"], HAS_SHARED=True, WRITE_TOPK=False)

    def launch(w, route: bool):
        moe._router_kernel[(e // knobs["router_block_e"], split)](
            x, w.router_w, part, 1, e, h, k_per, BLOCK_E=knobs["router_block_e"], BLOCK_K=knobs["router_block_k"],
            K_ITERS=k_per // knobs["router_block_k"], FMA=True, USE_PDL=True, F32_DOT=False,
            num_warps=knobs["router_warps"], launch_pdl=True)
        if route:
            moe._route_token_kernel[(1,)](part, w.expert_bias, tw, ti, slots, wt, e, float(cfg["scale"]), SPLIT=split,
                                          USE_PDL=True, num_warps=knobs["route_warps"], launch_pdl=True, **routing)

    return {f"route_{route}": graph_us([lambda w=w, r=route: launch(w, r) for w in entries], len(entries))
            for route in (False, True)}


def step_ms(model, fused: FusedStep, t: int) -> float:
    """Median ms of the fused step at T tokens (CUDA graph), with the launch settings in effect now."""
    state = model.new_state(CONTEXT + 64)
    ids = torch.randint(0, model.config.vocab_size, (t,), device="cuda")
    pos = torch.arange(CONTEXT - t, CONTEXT, device="cuda")
    return median_ms(graphed(lambda: fused.step(ids, state, pos)), reps=30)


def pin(table: dict, width: int, chosen: dict) -> None:
    """Put the settings chosen at T=1 and T=9 into a kernel's CONFIGS under this width (heads or expert rows per
    rank), over the nearest width's settings."""
    entry = dict(table.get(width) or table[min(table, key=lambda w: abs(w - width))])
    entry.update({k: chosen[t] for k, t in ((1, 1), (16, 9)) if t in chosen})
    table[width] = entry


def load_tuned(path: str) -> dict:
    """Pin the settings a tuning run chose (its JSON) into the kernels' CONFIGS for this process: another
    benchmark can run with them before they are copied into the code."""
    res = json.loads(Path(path).read_text())
    chosen, heads, rows = res["chosen"], res["heads_per_rank"], res["expert_rows_per_rank"]
    pin(mla.CONFIGS, heads, {int(t): tuple(v) for t, v in chosen["mla"].items()})
    pin(kda.CONFIGS, heads, {int(t): tuple(v) for t, v in chosen["kda"].items()})
    pin(moe.CONFIGS, rows, {int(t): v for t, v in chosen["moe"].items()})
    gemv.CONFIGS.update({ast.literal_eval(key): v for key, v in chosen["gemv"].items()})
    return chosen


def write_tuned(doc: dict, path: Path) -> None:
    """tuned.json's layout: one entry per line, so a diff shows which shapes a tuning run changed."""
    kernels = [k for k in doc if k != "about"]
    lines = ["{", f' "about": {json.dumps(doc["about"])},']
    for i, kernel in enumerate(kernels):
        entries = doc[kernel]
        lines += [f' "{kernel}": [', *(f"  {json.dumps(e)}{',' if j < len(entries) - 1 else ''}"
                                       for j, e in enumerate(entries)), " ]" + ("," if i < len(kernels) - 1 else "")]
    path.write_text("\n".join(lines + ["}"]) + "\n")


def ship(path: str, chosen: dict, widths: dict, tp: int) -> None:
    """Write tuned.json with this run's winners over the shipped entries, each naming the GPU and commit timed.
    `chosen`: per kernel, gemv by (N, K, swiglu, T bucket), the others by T; `widths`: heads or expert rows per
    rank of the kernels keyed by width."""
    doc = json.loads(TUNED.read_text())
    commit = os.environ.get("LINGLS_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short=8", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    gpu = torch.cuda.get_device_name()
    for kernel in (k for k in doc if k != "about" and chosen.get(k)):
        won = (chosen[kernel] if kernel == "gemv" else
               {(widths[kernel], 1 if t == 1 else 16): v for t, v in chosen[kernel].items()})
        entries = {tuple(e["key"]): e for e in doc[kernel]}
        for key, settings in won.items():
            entries[key] = {"key": list(key), "settings": list(settings) if isinstance(settings, tuple) else settings,
                            "gpu": gpu, "commit": commit, "shape": entries.get(key, {}).get("shape", f"TP={tp}")}
        doc[kernel] = list(entries.values())
    write_tuned(doc, Path(path))
    print(f"tuned settings with this run's winners: {path} (copy over {TUNED} to ship them)")


def main(out: str, layers: int, budget_s: float, tokens: tuple[int, ...] = (1, 9),
         stages: tuple[str, ...] = ("mla", "kda", "moe", "gemv"), tp: int = 4, ship_to: str | None = None) -> int:
    t0 = time.time()
    DEADLINE[0] = t0 + budget_s
    torch.manual_seed(0)
    bw = copy_bandwidth()
    model = build_flash(layers, tp=tp, rank=0)
    heads, expert_rows = model.config.num_attention_heads // tp, model.config.moe_intermediate_size // tp
    fused = FusedStep(model, kernels=True)
    tuning, chosen = {"mla": [], "moe": [], "gemv": [], "kda": []}, {"mla": {}, "moe": {}, "gemv": {}, "kda": {}}
    with torch.inference_mode():
        before = {t: step_ms(model, fused, t) for t in (1, 9)}  # the settings the code shipped with
        print(f"fused step with the shipped settings: {before}", flush=True)
        try:
            probe = router_probe(fused)
        except Exception as e:  # noqa: BLE001 - a diagnostic; the tuning goes on without it
            probe = {"error": repr(e)[:300]}
        print(f"T=1 router launch, us per layer: {probe}", flush=True)
        for t in tokens:
            rows = tune_mla(model, t) if "mla" in stages else []
            tuning["mla"] += rows
            ok = [r for r in rows if "us" in r and r["rel_err"] < 2e-2]
            if ok:
                b = min(ok, key=lambda r: r["us"])
                chosen["mla"][t] = tuple(b[k] for k in ("num_splits", "block_n", "num_warps", "heads") if k in b)
            rows = tune_kda(fused, t) if "kda" in stages else []
            tuning["kda"] += rows
            ok = [r for r in rows if "us" in r and r["rel_err"] < 2e-2]
            if ok:
                b = min(ok, key=lambda r: r["us"])
                chosen["kda"][t] = (b["block_v"], b["num_warps"])
            moe_stages = (ROUTER, GATE_UP, DOWN) if "moe" in stages else (DOWN,) if "moe-down" in stages else ()
            rows = tune_moe(fused, t, moe_stages) if moe_stages else []
            tuning["moe"] += rows
            ok = [r for r in rows if "us" in r and r["rel_err"] < 2e-2]
            if ok:
                b = min(ok, key=lambda r: r["us"])
                chosen["moe"][t] = {k: v for k, v in b.items() if k not in ("T", "us", "rel_err")}
            rows = (tune_gemv(fused, t) if "gemv" in stages else tune_gemv(fused, t, [{}] + GEMV_TMA)
                    if "gemv-tma" in stages and t > 1 else [])
            tuning["gemv"] += rows
            for shape in {(r["n"], r["k"], r["swiglu"]) for r in rows}:
                ok = [r for r in rows if "us" in r and r["rel_err"] < 2e-2 and (r["n"], r["k"], r["swiglu"]) == shape]
                if ok:
                    b = min(ok, key=lambda r: r["us"])
                    knobs = {key: b[key] for key in ("block_n", "block_k", "split_k", "num_warps", "num_stages", "fma",
                                                     "tma") if key in b}
                    if knobs:  # the shipped settings won: nothing to change
                        chosen["gemv"][(*shape, 1 if t == 1 else 16)] = knobs
            print(f"T={t} tuned in {time.time() - t0:.0f} s: mla {chosen['mla'].get(t)}, moe {chosen['moe'].get(t)}, "
                  f"gemv {[(s, c) for s, c in chosen['gemv'].items() if s[3] == (1 if t == 1 else 16)]}", flush=True)
    # T=1 settings serve decode steps, the T=9 ones every verify size up to 16 (the CONFIGS keys)
    pin(mla.CONFIGS, heads, chosen["mla"])
    pin(moe.CONFIGS, expert_rows, chosen["moe"])
    pin(kda.CONFIGS, heads, chosen["kda"])
    gemv.CONFIGS.update(chosen["gemv"])
    defaults = {"mla": {t: mla.config_for(t, heads) for t in (1, 9)},
                "moe": {t: moe.config_for(t, expert_rows) for t in (1, 9)},
                "kda": {t: kda.config_for(t, heads) for t in (1, 9)},
                "gemv": {str(key): c for key, c in gemv.CONFIGS.items()}}
    for kind in ("mla", "moe", "kda"):
        for t in (1, 9):
            base = [r for r in tuning[kind] if r["T"] == t and "us" in r][:1]
            if base:
                print(f"{kind} T={t}: first candidate {base[0]['us']:.1f} us, best "
                      f"{min(r['us'] for r in tuning[kind] if r['T'] == t and 'us' in r):.1f} us")
    rc = measure(model, out, bw, extra=dict(tp=tp, heads_per_rank=heads, expert_rows_per_rank=expert_rows,
                                            fused_ms_shipped_settings=before, router_probe_us=probe, tuning=tuning,
                                            chosen={k: {str(t): v for t, v in c.items()} for k, c in chosen.items()},
                                            configs_used={k: {str(t): v for t, v in c.items()}
                                                          for k, c in defaults.items()}))
    if ship_to:
        ship(ship_to, chosen, {"mla": heads, "kda": heads, "moe": expert_rows}, tp)
    print(f"total {time.time() - t0:.0f} s")
    print(json.dumps({"chosen": {k: {str(t): v for t, v in c.items()} for k, c in chosen.items()}}))
    # the shipped GEMV settings are the first candidate: what pinning the winners saves
    for t in (1, 9):
        shipped = sum(r["us"] for r in tuning["gemv"] if r["T"] == t and "us" in r and "block_n" not in r)
        best = sum(min(r["us"] for r in tuning["gemv"] if r["T"] == t and "us" in r and (r["n"], r["k"]) == (n, k))
                   for n, k in {(r["n"], r["k"]) for r in tuning["gemv"] if r["T"] == t})
        print(f"gemv T={t}: shipped settings {shipped:.1f} us per set of shapes, tuned {best:.1f} us")
    return rc


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default="tune.json")
    p.add_argument("layers", nargs="?", type=int, default=42)
    p.add_argument("budget_s", nargs="?", type=float, default=float("inf"), help="tuning budget, seconds")
    p.add_argument("tokens", nargs="?", default="1,9", help="T values, e.g. 1,9")
    p.add_argument("stages", nargs="?", default="mla,kda,moe,gemv")
    p.add_argument("--tp", type=int, default=4, help="tune rank 0's shard of a TP=N deployment (default 4)")
    p.add_argument("--ship", metavar="PATH", help="write tuned.json with the winners to PATH")
    a = p.parse_args()
    sys.exit(main(a.out, a.layers, a.budget_s, tuple(int(t) for t in a.tokens.split(",")), tuple(a.stages.split(",")),
                  a.tp, a.ship))
