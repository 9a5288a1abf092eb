"""Speculative decoding at Ling-3.0-flash shapes with SIMULATED acceptance: TPOT as a function of the forced
acceptance length a = 0..K, of K and of the drafter.

Random weights accept no drafts, so every round's accepted count is forced to a (`Speculator.force_accept`,
a device tensor: nothing is read on the host). A round is what `Speculator.decode` launches: the drafter
drafts K tokens; one verify step of K+1 tokens runs the fused step (KDA staged per position, MLA KV written by
position); the target head, the forced accept, `kda.commit` of the accepted position, the drafter's absorption
of the verified positions, the position advance and the post of [n, tokens] to pinned memory; each phase is
one CUDA graph (captured by speculative.py itself). The host loop is decode's: launch round r+1, then read
round r. Drafters (`--drafters`, run in the order given):
- mtp: the checkpoint's MTP layer (random here), chained K steps; after a verify, its rows of the verified
  positions.
- dspark: the Ling-3.0-flash-DSpark drafter at its published widths (`lingls.model.dspark`: 5 layers, 32 x 128
  heads, 6144, Markov rank 256; random weights built on the device, this rank's shard), as `lingls serve
  --draft DSPARK_DIR` runs it (`speculative.DSparkRuntime`): one 8-row block forward + 8 Markov-corrected
  choices per round (its draft time is the "draft round"), K <= 8 of them verified; after a verify, the
  context rows of the verified positions (fc + k/v of every layer).

Reported per (K, a): draft and verify GPU times (CUDA events around each graph, medians over the rounds),
round = their sum (median), TPOT = median round / (a + 1) tokens (the a accepted drafts + the target's token),
and loop TPOT = host-loop wall time per round / (a + 1). Also the plain decode step (T = 1, graph) for
comparison. Context: positions run up to --context (8192), reading --context MLA rows per MLA layer.

Modes (--tp N, default 4):
- N GPUs visible (and no --stub): N processes (torch.multiprocessing), NCCL all-reduce and all-gather
  (`distributed.make_parallel`: its peer all-reduce by default, LINGLS_ALLREDUCE=nccl for NCCL's), each holding
  its shard of all layers: the real TP=N time. E.g. --tp 2 on two H200.
- otherwise: rank 0's shard of a TP=N deployment alone on one GPU, all-reduce and all-gather stubbed (identity):
  the per-rank compute of TP=N without communication (--tp 4 on one H200: 64.5 GB of weights with the MTP layer;
  --stub forces this mode).
K runs in the order given (default 8, 4, 2: the target's K first) and a = 0..K; no new phase starts after --budget-s.
--profile adds, at a = --profile-a, for the drafters in --profile-drafters, the device time per kernel of each captured
phase (the bare K+1-token step with its head, the draft graph, the verify graph), and the verify's parts timed as graphs
of their own (the target forward, staged or not; the verify without the drafter's absorption of the verified rows), to
name what a round spends beyond the bare step. Times taken after a profile in the same process run slower
(the trace probe, docs/kernel-log.md), so compare times from runs without --profile.
--dspark-sweep times, after the rows, the DSpark draft round with one launch setting of lingls.kernels.dspark changed at
a time (SWEEPABLE), beside the shipped settings, in the same process (a fresh round and graphs per setting).
--tiny runs the same code on CPU at tiny shapes (no graphs; gloo ranks when --tp > 1), to check the script.

    python3 -m bench.spec_flash_gpu --stub --out $OUT/spec_flash.json      # one H200: TP=4 rank-0 shard
    python3 -m bench.spec_flash_gpu --tp 2 --out $OUT/spec_flash_tp2.json  # two H200: the full model, TP=2
Writes the JSON after every phase and a PNG beside it; exits 0 when every phase ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.common import kernel_rows, write_result
from lingls.bench.floor import median_ms
from lingls.model.config import LingConfig, flash_config
from lingls.model.ling import LingForCausalLM, Parallel
from lingls.runtime.graphs import capture
from lingls.runtime.runner import ModelRunner
from lingls.runtime.spec.draft_vocab import DraftVocab
from lingls.runtime.spec.round import DSparkRuntime, MTPDrafter, SpecStats, Speculator

LABEL = "SIMULATED acceptance (forced accept count; random weights)"
TARGET = {"tpot_ms": 1.0, "a": 6, "k": 8, "what": "full model, TP=2 (two H200), real NCCL all-reduce"}
DRAFT_ROUND_TARGET_MS = 0.20  # issue 36: the DSpark draft round (8-row block + Markov choices), one TP=4 rank


def build(args, par: Parallel, device: str) -> LingForCausalLM:
    """Random weights built on the device (as lingls.bench.step.build_flash, but keeping the MTP layer)."""
    if args.tiny:
        from lingls.engine.local import tiny_config_dict

        cfg = LingConfig.from_dict({**tiny_config_dict(8192), "num_nextn_predict_layers": 1})
        dtype = torch.float32
    else:
        cfg, dtype = flash_config(args.layers), torch.bfloat16
        cfg.num_nextn_predict_layers = 1
    with torch.device("meta"):
        model = LingForCausalLM(cfg, par).to(dtype)
    for name, p in model.named_parameters():
        if name.endswith(("A_log", "dt_bias", "expert_bias")):
            p.data = p.data.float()
    model = model.to_empty(device=device)
    torch.manual_seed(par.rank)
    model.init_weights(std=0.5 if args.tiny else 0.02)
    return model.eval()


def build_dspark(args, model: LingForCausalLM, par: Parallel, device: str):
    """This rank's shard of a random DSpark drafter for `model`: the published widths at flash shapes, small
    ones for --tiny."""
    from lingls.model.dspark import DSparkConfig, random_dspark
    from lingls.model.random_checkpoint import SMALL_DSPARK

    cfg = DSparkConfig.for_target(model.config, **(SMALL_DSPARK if args.tiny else {}))
    return random_dspark(cfg, par, device, model.lm_head.weight.dtype, seed=0, std=0.2 if args.tiny else 0.02)


def make_spec(name: str, runner: ModelRunner, model, k: int, head, dspark) -> Speculator:
    """A Speculator with drafter `name` at K=k, its state filled with noise (random weights draft noise).
    dspark-ref: the DSpark round on its plain-torch references instead of the kernels (what they save)."""
    if name == "mtp":
        spec = Speculator(runner, MTPDrafter(model, runner.state, k, runner.fused, head))
        spec.drafter.xy.normal_()
    else:
        kernels = None if name == "dspark" else False
        spec = Speculator(runner, DSparkRuntime(model, dspark, k, runner.capacity, runner, kernels=kernels))
        spec.drafter.ctx_k.normal_()
        spec.drafter.ctx_v.normal_()
    spec.force_accept = torch.zeros(1, dtype=torch.long, device=runner.device)
    return spec


def check_dspark_kernels(runner: ModelRunner, model, dspark, context: int) -> dict:
    """The DSpark round on the kernels against the same round on their references, on this device at these
    shapes, from the same state: context rows absorbed from random features, the block's logits (relative
    error) and the greedy drafts (how many of the 8 agree; bf16 near-ties may differ)."""
    k = dspark.config.block_size
    rts = [DSparkRuntime(model, dspark, k, runner.capacity, runner, kernels=kernels) for kernels in (True, False)]
    n = dspark.config.hidden_size * len(dspark.config.target_layer_ids)
    feats = torch.randn(k + 1, n, device=runner.device, dtype=model.lm_head.weight.dtype)
    pos = torch.tensor([context - 2 * (k + 1)], device=runner.device)
    cur = torch.tensor([17], device=runner.device)
    base = torch.randn_like(rts[0].ctx_k), torch.randn_like(rts[0].ctx_v)
    out = []
    with torch.inference_mode():
        for rt in rts:
            rt.ctx_k.copy_(base[0])
            rt.ctx_v.copy_(base[1])
            rt.accept(None, feats, None, None, pos + torch.arange(k + 1, device=pos.device), 0)
            logits = rt.block_logits(cur, pos, runner.bucket(context)).float()
            drafts, _ = rt.propose(cur, pos, runner.bucket(context))
            out.append((rt.ctx_k[:, : context].float(), logits, drafts.clone()))
    (ck, lk, dk), (cr, lr, dr) = out
    return {"context_rows_rel_err": float((ck - cr).norm() / cr.norm()),
            "block_logits_rel_err": float((lk - lr).norm() / lr.norm()),
            "greedy_drafts_agree": int((dk == dr).sum()), "of": k}


class Timer:
    """Median time of fn() in ms: CUDA events on GPU, the wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def median_ms(self, fn, reps: int) -> float:
        if self.cuda:
            return median_ms(fn, reps=reps, warm=0)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rounds_at(spec: Speculator, a: int, rounds: int, context: int) -> dict:
    """`rounds` rounds with the accepted count forced to a, through decode's own host loop."""
    r, k = spec.runner, spec.k
    kv = r.bucket(context)
    p0 = context - (rounds + 4) * (k + 1)  # every round of this run ends before `context`
    spec.force_accept.fill_(a)
    r.pos.fill_(p0)
    for slot in (0, 1):  # warm-up (the first one captures the graphs)
        spec._launch(kv, True, slot)
        spec._read(slot, True)
    r.pos.fill_(p0)
    spec.stats = SpecStats()
    sync(r.device)
    t0 = time.perf_counter()
    spec._launch(kv, True, 0)
    ns, parts = [], []
    for i in range(1, rounds + 1):
        if i < rounds:
            spec._launch(kv, True, i % 2)
        n, _ = spec._read((i - 1) % 2, True)
        ns.append(n)
        parts.append(spec.clock.read((i - 1) % 2))
    sync(r.device)
    loop_ms = (time.perf_counter() - t0) / rounds * 1e3
    draft = statistics.median(p[0] for p in parts) * 1e3
    verify = statistics.median(p[1] for p in parts) * 1e3
    round_ms = statistics.median(p[0] + p[1] for p in parts) * 1e3
    return {"k": k, "a": a, "draft_ms": draft, "verify_ms": verify, "round_ms": round_ms,
            "tpot_ms": round_ms / (a + 1), "loop_round_ms": loop_ms, "loop_tpot_ms": loop_ms / (a + 1),
            "forced_count_honoured": all(n == a for n in ns), "rounds": rounds}


SWEEPABLE = ("ATTEND_PROGRAMS_PER_SM", "ATTEND_BLOCK_N", "ATTEND_PREFETCH_THEN", "MARKOV_TILE")


def parse_sweep(text: str) -> dict[str, list]:
    """--dspark-sweep "NAME=v1,v2;NAME2=v3": launch settings of `lingls.kernels.dspark` (SWEEPABLE) to time one at
    a time ("none": no value, e.g. no register cap)."""
    out = {}
    for part in filter(None, text.split(";")):
        name, _, values = part.partition("=")
        if name not in SWEEPABLE or not values:
            raise ValueError(f"--dspark-sweep {part!r}: NAME=v1,v2 with NAME one of {', '.join(SWEEPABLE)}")
        out[name] = [None if v == "none" else int(v) for v in values.split(",")]
    return out


def sweep_dspark(runner: ModelRunner, model, dspark, k: int, a: int, sweep: dict, rounds: int, context: int) -> list:
    """The DSpark round's draft time (median ms over `rounds` rounds at forced acceptance a) with each setting
    of `sweep` changed alone from the shipped ones, the shipped ones first: a fresh Speculator per setting, so
    its graphs are captured with that setting's launches."""
    from lingls.kernels import dspark as kernels

    shipped = {name: getattr(kernels, name) for name in sweep}
    rows = []
    for name, value in [(None, None)] + [(n, v) for n, vs in sweep.items() for v in vs]:
        if name is not None:
            setattr(kernels, name, value)
        try:
            spec = make_spec("dspark", runner, model, k, None, dspark)
            with torch.inference_mode():
                rounds_at(spec, 0, 2, context)  # captures the graphs
                row = rounds_at(spec, a, rounds, context)
            rows.append({"setting": "shipped" if name is None else f"{name}={value}", "draft_ms": row["draft_ms"],
                         "round_ms": row["round_ms"]})
        except Exception as e:  # a setting the kernels refuse (shared memory, a shape) is a row, not the end
            rows.append({"setting": f"{name}={value}", "error": repr(e)})
        finally:
            spec = None
            runner.attach(None)
            if name is not None:
                setattr(kernels, name, shipped[name])
    return rows


def profile_round(spec: Speculator, k: int, context: int, reps: int = 5, top: int = 25) -> dict:
    """Device time per kernel name (CUPTI via torch.profiler) in each captured phase of a round, replayed
    `reps` times: the target's own K+1-token step with its head (what verify would cost bare), the draft graph
    and the verify graph, so the verify's extra over the bare step and the draft's parts can be named."""
    from torch.profiler import ProfilerActivity, profile

    r = spec.runner
    kv = r.bucket(context)
    graphs = {"target_step": lambda: r.run_step(k + 1, kv, True),
              "draft": spec.graphs.graphs[("draft", kv, True)].replay,
              "verify": spec.graphs.graphs[("verify", kv, True, True)].replay}
    out = {}
    for name, fn in graphs.items():
        r.pos.fill_(context - (reps + 4) * (k + 1))
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        out[name] = kernel_rows(prof, reps, top)
        out[f"{name}_gaps"] = idle_gaps(prof, reps)
    out["parts_ms"] = verify_parts(spec, k, kv, context)
    return out


def idle_gaps(prof, reps: int, top: int = 12) -> dict:
    """Where the GPU sits idle inside a phase: the kernels' [start, end) intervals of the trace (overlapping
    ones merged: with PDL a kernel starts before its predecessor ends), the idle time between them per replay
    (gaps over 50 us, the time between replays, are left out), and the largest gaps with the kernels around
    them."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    gaps, end, before = [], None, None
    for start, stop, name in spans:
        if end is not None and start > end:
            gaps.append((start - end, before, name))
        if end is None or stop > end:
            end, before = stop, name
    inside = [g for g in gaps if g[0] < 50]
    inside.sort(key=lambda g: -g[0])
    return {"idle_us_per_replay": sum(g[0] for g in inside) / reps, "gaps_per_replay": len(inside) / reps,
            "largest": [dict(us=round(g, 2), after=a[:60], before=b[:60]) for g, a, b in inside[:top]]}


def verify_parts(spec: Speculator, k: int, kv: int, context: int, reps: int = 20) -> dict:
    """What the verify graph adds to the bare K+1-token forward, by graphs of its parts (median ms): the
    target forward alone, the same with KDA staged per position, and the whole verify without the drafter's
    absorption of the verified rows (its MTP layer)."""
    r = spec.runner
    positions = r.pos + spec.arange
    drafter_accept = spec.drafter.accept
    bodies = {"forward": lambda: spec.target(spec.ids, positions, kv, staged=False),
              "forward_staged": lambda: spec.target(spec.ids, positions, kv, staged=True),
              "verify_without_drafter_accept": lambda: spec._verify(kv, True),
              "verify": lambda: spec._verify(kv, True)}
    parts = {}
    for name, body in bodies.items():
        r.pos.fill_(context - (reps + 8) * (k + 1))
        if name == "verify_without_drafter_accept":
            spec.drafter.accept = lambda *a: None
        try:
            graph, _ = capture(body, spec.live(), spec.graphs.pool)
        finally:
            spec.drafter.accept = drafter_accept
        parts[name] = median_ms(graph.replay, reps=reps, warm=2)
    return parts


def draft_head(model, n: int | None) -> DraftVocab | None:
    """An n-id draft head (`--draft-vocab`): every (V/n)-th token id, so each rank's shard holds its share. Which
    ids does not matter here (acceptance is forced); a real list comes from `lingls draft-vocab`."""
    if not n:
        return None
    v = model.config.vocab_size
    ids = [i * v // n for i in range(n)]
    return DraftVocab(ids, model.lm_head.weight, model.par.rank, model.par.size)


def say_profile(say, prof: dict) -> None:
    for phase, rows in prof.items():
        if phase == "parts_ms":
            say("verify parts, ms: " + ", ".join(f"{n} {v:.3f}" for n, v in rows.items()))
        elif phase.endswith("_gaps"):
            say(f"{phase}: idle {rows['idle_us_per_replay']:.0f} us in {rows['gaps_per_replay']:.0f} gaps; "
                + "; ".join(f"{g['us']:.1f} {g['after'][:25]} > {g['before'][:25]}" for g in rows['largest'][:5]))
        else:
            say(f"profile {phase}: "
                + "; ".join(f"{x['kernel'][:40]} {x['us_per_step']:.0f}us x{x['launches_per_step']:.0f}"
                            for x in rows[:8]))


def run_rank(args, par: Parallel, device: torch.device) -> dict:
    t_start = time.perf_counter()
    tuned = None
    if args.configs:  # a tuning run's choices (bench/tune_gpu.py), pinned in this rank's process
        from bench.tune_gpu import load_tuned

        tuned = load_tuned(args.configs)
    rank0 = par.rank == 0
    say = (lambda *m: print(*m, flush=True)) if rank0 else (lambda *m: None)
    stopped = torch.zeros(1, device=device)

    def out_of_time() -> bool:  # the same answer on every rank, or they would part ways in a collective
        stopped.fill_(float(time.perf_counter() - t_start > args.budget_s))
        if par.size > 1 and torch.distributed.is_initialized():  # the process group itself, not the model's path
            torch.distributed.all_reduce(stopped)
        return stopped.item() > 0

    allreduce = "LINGLS_ALLREDUCE=" + os.environ.get("LINGLS_ALLREDUCE", "peer (default)")
    res = {"what": f"speculative decoding TPOT vs forced acceptance length: {LABEL}", "label": LABEL,
           "tpot_convention": "median(draft + verify GPU time per round) / (a + 1); loop_tpot: host-loop wall "
                              "time per round / (a + 1)",
           "drafters": {"mtp": "the model's MTP layer chained K steps (fused kernels on CUDA, torch ops on CPU)",
                        "dspark": "Ling-3.0-flash-DSpark at the published widths: one 8-row block forward + K "
                                  "Markov-corrected choices per round (lingls.kernels.dspark on CUDA, references "
                                  "on CPU)"},
           "random_weights": True,
           "mode": args.mode, "all_reduce": allreduce if par.size > 1 else "stubbed", "tiny": args.tiny,
           "tp": args.tp, "ranks": par.size, "layers": args.layers, "context": args.context,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "target": TARGET,
           "rows": [], "target_step_ms": {}, "errors": {}, "skipped": [],
           "launch_settings": {"from": args.configs, "chosen": tuned} if tuned else "the code's CONFIGS"}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        pass

    def save():
        if rank0 and args.out:
            write_result(args.out, res)

    try:
        model = build(args, par, str(device))
        res["weights_GB_per_rank"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
        dspark = build_dspark(args, model, par, str(device)) if {"dspark", "dspark-ref"} & set(args.drafters) else None
        if dspark is not None:
            res["dspark_GB_per_rank"] = sum(p.numel() * p.element_size() for p in dspark.parameters()) / 1e9
            res["dspark_config"] = dspark.config.to_dict()
        runner = ModelRunner(model, capacity=args.context + 64, min_bucket=256,
                             verify_sizes=tuple(k + 1 for k in args.ks))
    except Exception as e:
        res["errors"]["build"] = repr(e)
        say("building the model failed:", traceback.format_exc())
        save()
        return res
    runner.state.latent.normal_()
    runner.state.kda.normal_(std=0.01)
    runner.ids[:1].fill_(17)
    sync(device)
    res["build_s"] = time.perf_counter() - t_start
    res["fused_step"] = runner.fused is not None
    say(f"{LABEL}\n{res['mode']}: {args.layers} layers, {res['weights_GB_per_rank']:.1f} GB per rank, "
        f"context {args.context}, fused step: {runner.fused is not None}, built in {res['build_s']:.1f} s")
    timer = Timer(device)
    kv = runner.bucket(args.context)
    if dspark is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        try:
            res["dspark_kernel_check"] = check_dspark_kernels(runner, model, dspark, args.context)
            say(f"DSpark kernels vs references: {res['dspark_kernel_check']}")
        except Exception as e:
            res["errors"]["dspark_kernel_check"] = repr(e)
            say("DSpark kernel check failed:", traceback.format_exc())
    try:  # the plain decode step (T = 1), for comparison
        runner.pos.fill_(args.context - args.reps - 8)
        with torch.inference_mode():
            runner.run_step(1, kv, True)  # captures the graph
            res["plain_decode_ms"] = timer.median_ms(lambda: runner.run_step(1, kv, True), args.reps)
        say(f"plain decode step (T=1): {res['plain_decode_ms']:.3f} ms/token")
    except Exception as e:
        res["errors"]["plain_decode"] = repr(e)
        say("plain decode failed:", traceback.format_exc())
    save()
    for k in args.ks:
        if out_of_time():
            res["skipped"].append(f"K={k} (time budget)")
            continue
        try:
            runner.pos.fill_(args.context - 2 * (k + 1))
            # random tokens, as the drafts are at random weights: K+1 copies of one token would route every
            # row of the early layers to the same experts and make the bare step look cheaper than a verify's
            ids = torch.randint(0, model.config.vocab_size, (k + 1,), generator=torch.Generator().manual_seed(k))
            runner.ids[:k + 1].copy_(ids)
            with torch.inference_mode():  # the target's own K+1-token step (+ head, argmax), no drafter or commit
                runner.run_step(k + 1, kv, True)
                res["target_step_ms"][k] = timer.median_ms(lambda: runner.run_step(k + 1, kv, True), args.reps)
            say(f"K={k}: plain target step of {k + 1} tokens {res['target_step_ms'][k]:.3f} ms")
            runs = []  # (drafter, reduced draft-head size or None); the MTP head's reduced one after its whole one
            for d in args.drafters:
                runs += [(d, None)] + ([(d, args.draft_vocab)] if d == "mtp" and args.draft_vocab else [])
            for drafter, n_vocab in runs:
                if drafter != "mtp" and k > dspark.config.block_size:
                    res["skipped"].append(f"dspark K={k}: more than its block ({dspark.config.block_size})")
                    continue
                if (n_vocab or drafter != args.drafters[0]) and out_of_time():
                    res["skipped"].append(f"{drafter} K={k}" + (f" with a {n_vocab}-id draft head" if n_vocab else "")
                                          + " (time budget)")
                    continue
                name = f"{drafter} K={k}" + (f" vocab={n_vocab}" if n_vocab else "")
                try:
                    spec = make_spec(drafter, runner, model, k, draft_head(model, n_vocab), dspark)
                    with torch.inference_mode():
                        rounds_at(spec, 0, 2, args.context)  # captures the round's graphs
                except Exception as e:  # one drafter's failure leaves the others' rows
                    res["errors"][name] = repr(e)
                    say(f"{name} failed:", traceback.format_exc())
                    spec = None
                    runner.attach(None)
                    continue
                for a in range(k + 1):
                    if a and out_of_time():
                        res["skipped"].append(f"{name} a>={a} (time budget)")
                        break
                    with torch.inference_mode():
                        row = rounds_at(spec, a, args.rounds, args.context)
                    row["draft_vocab"] = n_vocab
                    row["drafter"] = drafter
                    res["rows"].append(row)
                    say(f"{name} a={a}: draft {row['draft_ms']:.3f} + verify {row['verify_ms']:.3f} = round "
                        f"{row['round_ms']:.3f} ms, TPOT {row['tpot_ms']:.3f} ms (loop {row['loop_tpot_ms']:.3f})")
                    save()
                    if args.profile and drafter in args.profile_drafters and a == args.profile_a \
                            and device.type == "cuda":
                        with torch.inference_mode():
                            res.setdefault("profile", {})[f"{name} a={a}"] = prof = profile_round(spec, k, args.context)
                        say_profile(say, prof)
                        save()
                res.setdefault("graph_keys", {})[name] = [repr(key) for key in spec.graphs.graphs]
                spec = None
                runner.attach(None)
        except Exception as e:
            res["errors"][f"K={k}"] = repr(e)
            say(f"K={k} failed:", traceback.format_exc())
        spec = None
        runner.attach(None)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.dspark_sweep and dspark is not None and not out_of_time():
        try:
            res["dspark_sweep"] = sweep_dspark(runner, model, dspark, dspark.config.block_size, args.profile_a,
                                               args.dspark_sweep, args.rounds, args.context)
            for row in res["dspark_sweep"]:
                say(f"dspark sweep {row['setting']}: " + (f"draft {row['draft_ms']:.3f} ms" if "draft_ms" in row
                                                          else row["error"]))
        except Exception as e:
            res["errors"]["dspark_sweep"] = repr(e)
            say("dspark sweep failed:", traceback.format_exc())
        save()
    for d in ("dspark", "dspark-ref"):
        mine = [r["draft_ms"] for r in res["rows"] if r["drafter"] == d]
        if mine:
            res.setdefault("draft_round_ms", {})[d] = statistics.median(mine)
    res["draft_round_target_ms"] = DRAFT_ROUND_TARGET_MS
    res["total_s"] = time.perf_counter() - t_start
    save()
    if rank0:
        report(res, args)
    return res


def report(res: dict, args) -> None:
    rows = res["rows"]
    plain = res.get("plain_decode_ms")
    print(f"\n{LABEL}\n{res['mode']}, context {res['context']}; TPOT = median round / (a + 1)")
    print(f"{'drafter':>10} {'K':>3} {'head':>6} {'a':>3} {'draft ms':>9} {'verify ms':>10} {'round ms':>9}"
          f" {'TPOT ms':>8} {'loop TPOT':>10} {'speedup':>8}")
    for r in rows:
        gain = f"{plain / r['tpot_ms']:8.2f}" if plain else f"{'-':>8}"
        print(f"{r['drafter']:>10} {r['k']:>3} {_head_name(r):>6} {r['a']:>3} {r['draft_ms']:>9.3f} "
              f"{r['verify_ms']:>10.3f} {r['round_ms']:>9.3f} {r['tpot_ms']:>8.3f} {r['loop_tpot_ms']:>10.3f} {gain}")
    if plain:
        print(f"plain decode step (no speculation): {plain:.3f} ms/token (speedup = this / TPOT)")
    for k, ms in res["target_step_ms"].items():
        print(f"plain target step of K+1={k + 1} tokens (no drafter, no commit): {ms:.3f} ms")
    for hit in (r for r in rows if r["k"] == TARGET["k"] and r["a"] == TARGET["a"]):
        print(f"{hit['drafter']} K={TARGET['k']}, a={TARGET['a']}, {_head_name(hit)} draft head: "
              f"TPOT {hit['tpot_ms']:.3f} ms here ({res['mode']}); target <= {TARGET['tpot_ms']} ms "
              f"for the {TARGET['what']}")
    for d, ms in res.get("draft_round_ms", {}).items():
        print(f"{d} draft round (median over its rows): {ms:.3f} ms; target <= {res['draft_round_target_ms']} ms "
              f"on one TP=4 rank: {'met' if ms <= res['draft_round_target_ms'] else 'NOT met'} ({res['mode']})")
    if not all(r["forced_count_honoured"] for r in rows):
        print("WARNING: some round's accepted count differs from the forced one")
    for what, err in res["errors"].items():
        print(f"ERROR in {what}: {err}")
    for what in res["skipped"]:
        print(f"skipped: {what}")
    print(f"total {res['total_s']:.1f} s")
    if args.out and rows:
        try:
            plot(res, Path(args.out).with_suffix(".png"))
            print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")
        except Exception as e:
            print("plot failed:", repr(e))


def _head_name(row: dict) -> str:
    """The draft head of a row: the whole lm_head, or an N-id reduced vocabulary (`--draft-vocab`)."""
    n = row.get("draft_vocab")
    return f"{n // 1024}k" if n and n % 1024 == 0 else str(n) if n else "full"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    def run_of(r):
        return r.get("drafter", "mtp"), r["k"], r.get("draft_vocab") or 0

    runs = list(dict.fromkeys(run_of(r) for r in rows))  # (drafter, K, draft head), in the order run
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    med = {run: [r for r in rows if run_of(r) == run] for run in runs}
    for (d, k, n), mine in med.items():
        ax.plot([r["a"] for r in mine], [r["tpot_ms"] for r in mine], "o-",
                label=f"{d} K={k}" + (f", {_head_name(mine[0])} draft head" if n else ""))
    if res.get("plain_decode_ms"):
        ax.axhline(res["plain_decode_ms"], color="gray", ls="--", label="plain decode (no speculation)")
    ax.plot([TARGET["a"]], [TARGET["tpot_ms"]], "r*", ms=14, label=f"target: full model TP=2, K={TARGET['k']}")
    ax.set_xlabel("forced acceptance length a (accepted drafts per round)")
    ax.set_ylabel("TPOT, ms (median round / (a + 1))")
    ax.set_yscale("log")
    ax.set_title(f"SIMULATED acceptance: {res['mode']}, ctx {res['context']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    draft = [statistics.median(r["draft_ms"] for r in mine) for mine in med.values()]
    verify = [statistics.median(r["verify_ms"] for r in mine) for mine in med.values()]
    x = range(len(runs))
    ax2.bar(x, draft, label="draft (MTP: K chained steps; DSpark: one block + K choices)")
    ax2.bar(x, verify, bottom=draft, label="verify (K+1 tokens) + accept + commit + drafter rows")
    ax2.set_xticks(list(x), [f"{d}\nK={k}" + (f" {_head_name(mine[0])}" if n else "")
                             for (d, k, n), mine in med.items()])
    ax2.set_ylabel("ms per round (median)")
    ax2.set_title("where a round's time goes", fontsize=9)
    ax2.legend(fontsize=8)
    shapes = "tiny random model (script check)" if res["tiny"] else f"Ling-3.0-flash shapes, {res['layers']} layers"
    fig.suptitle(f"{shapes}: {LABEL}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rank_main(rank: int, size: int, port: int, args) -> None:
    import torch.distributed as dist

    from lingls.serve.tensor_parallel import make_parallel, set_safe_env

    set_safe_env()
    cuda = not args.tiny
    if args.tiny:
        torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, **({"device_id": torch.device("cuda", rank)} if cuda else {}))
    run_rank(args, make_parallel(rank, size), torch.device("cuda", rank) if cuda else torch.device("cpu"))
    if not cuda:
        dist.destroy_process_group()
        return
    # On the H200 pair, tearing the NCCL group down after the peer all-reduce's IPC mappings hung for minutes
    # after the results were written; the ranks agree they are done and leave, and the driver cleans up.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default 4; 1 with --tiny)")
    p.add_argument("--stub", action="store_true", help="rank 0's shard on one device even when --tp GPUs exist")
    p.add_argument("--ks", default="8,4,2", help="drafted tokens per round (each <= 15), in the order run")
    p.add_argument("--layers", type=int, default=42)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per (K, a)")
    p.add_argument("--reps", type=int, default=30, help="timed plain decode steps")
    p.add_argument("--budget-s", type=float, default=180.0, help="start no new phase after this many seconds")
    p.add_argument("--tiny", action="store_true", help="tiny random model on CPU (checks the script)")
    p.add_argument("--profile", action="store_true", help="kernel times of the round's graphs (GPU) at --profile-a")
    p.add_argument("--profile-a", type=int, default=6, help="the forced acceptance the profile runs at")
    p.add_argument("--drafters", default="mtp", help="comma-separated, in the order run: mtp, dspark (the "
                   "DSpark round's kernels), dspark-ref (the same round on their torch references)")
    p.add_argument("--profile-drafters", default="mtp,dspark", help="the drafters --profile profiles")
    p.add_argument("--configs", metavar="TUNE.json", help="kernel launch settings chosen by bench/tune_gpu.py")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="also run each K with an N-id draft head (--draft-vocab; 0: the whole lm_head only)")
    p.add_argument("--dspark-sweep", default="", metavar="NAME=v1,v2;...",
                   help="after the rows, the DSpark draft round (K = block size, a = --profile-a) with each of these "
                        f"launch settings of lingls.kernels.dspark changed alone ({', '.join(SWEEPABLE)}; 'none': "
                        "no value), beside the shipped ones")
    p.add_argument("--out", default="bench/results/spec_flash.json")
    args = p.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",")]
    args.drafters = args.drafters.split(",")
    args.profile_drafters = args.profile_drafters.split(",")
    try:
        args.dspark_sweep = parse_sweep(args.dspark_sweep)
    except ValueError as e:
        p.error(str(e))
    if set(args.drafters) - {"mtp", "dspark", "dspark-ref"}:
        p.error(f"--drafters {','.join(args.drafters)}: choose among mtp, dspark, dspark-ref")
    args.tp = args.tp or (1 if args.tiny else 4)
    if args.tiny:
        torch.set_num_threads(1)  # tiny ops: more threads only contend
        args.layers = 4
        args.context = min(args.context, 256)
    elif not torch.cuda.is_available():
        print("spec_flash_gpu: needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    gpus = 0 if args.tiny else torch.cuda.device_count()
    ranks = args.tp if args.tp > 1 and not args.stub and (args.tiny or gpus >= args.tp) else 1
    if ranks > 1:
        args.mode = f"full model TP={args.tp}, {ranks} {'CPU (gloo)' if args.tiny else 'GPU (NCCL)'} ranks"
    elif args.tp > 1:
        args.mode = f"TP={args.tp} rank-0 shard on one device, all-reduce stubbed"
    else:
        args.mode = "TP=1, one device"
    if ranks == 1:
        device = torch.device("cpu" if args.tiny else "cuda")
        res = run_rank(args, Parallel(0, args.tp), device)
        return 0 if not res["errors"] and not res["skipped"] else 1
    import torch.multiprocessing as mp

    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, ranks, port, args)) for rank in range(ranks)]
    for proc in procs:
        proc.start()
    deadline = time.time() + args.budget_s + 120
    for proc in procs:
        proc.join(timeout=max(1.0, deadline - time.time()))
    codes = []
    for proc in procs:
        if proc.is_alive():
            print(f"rank process {proc.pid} still running at the deadline: terminated", file=sys.stderr)
            proc.terminate()
            proc.join(10)
        codes.append(proc.exitcode)
    try:
        res = json.loads(Path(args.out).read_text())
        ok = not res["errors"] and not res["skipped"]
    except (OSError, ValueError, KeyError):
        ok = False
    return 0 if ok and all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
