"""KDA step, commit and add+RMSNorm kernels on the GPU: correctness first, then median time against the byte floor.

Shapes: one TP=4 rank of Ling-3.0-flash (KDA: H=8 heads of D=128, C=1024; hidden 2560), T = 1 (decode,
state updated in place) and T = 9 (verify of 8 drafts, states staged), plus T = 16 staged.

Checks (any failure makes the exit code 1; every check draws fresh random inputs and poisons outputs with NaN):
- each timed kda_step variant against the torch reference (fp32 upcast of the same bf16 inputs): output
  ||err||/||ref|| < 1e-2 (bf16 rounding), state (staged: the recurrence inputs) < 1e-5, conv state exact;
- staged verify + commit, captured in ONE CUDA graph with the accepted index set only on device between
  replays, equals the reference run on the accepted prefix alone (index 0, T-1 and a random one);
- a race hunt: 2 input sets launched alternately 200 times (so a stale read of the other set's scratch or
  conv state would show); every output must be bit-identical to its set's first;
- PDL: 4 consecutive steps on one state with pdl=True, eager and inside a CUDA graph, equal the reference chain;
- commit of 35 layers in one launch (the replay of the staged inputs, against the torch replay); add_rms_norm
  (residual bit-exact, normed < 1e-2).
Timing: every kernel captured N_SETS times over distinct buffers (N_SETS x the state > L2, so the state comes
from HBM as in a real 35-layer step) in one CUDA graph; the median replay time over N_SETS is its time. Floor:
the bytes the op must move (inputs, weights, state and conv state read, outputs and states written) over the
device-to-device copy rate measured in this run. (block_v, num_warps) is swept (sm_90 register use: 16/4 and
8/4 fit with no spill, 32/8 and 64/4 spill); the best is also run without PDL.

    python -m bench.kernels_kda OUT.json            # on the GPU
    TRITON_INTERPRET=1 python -m bench.kernels_kda --smoke OUT.json   # the checks only, small sizes, CPU
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys

import torch

from bench.common import write_result
from lingls.bench.step import median_ms
from lingls.kernels import kda, norm

LB, EPS = -5.0, 1e-6
N_SETS = 64


class Ctx:
    def __init__(self, dev: str, h: int, d: int, hidden: int, layers: int):
        self.dev, self.h, self.d, self.c, self.hidden, self.layers = dev, h, d, h * d, hidden, layers
        self.gen = torch.Generator().manual_seed(0)
        self.checks: list[dict] = []

    def randn(self, *shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=self.gen) * scale).to(self.dev, dtype)

    def step_inputs(self, t: int) -> dict:
        """One layer's random step: q, k, v, f, z, b as strided views of one fused [T, 5C+H] GEMV output."""
        c, h = self.c, self.h
        q, k, v, f, z, b = self.randn(t, 5 * c + h).split([c, c, c, c, c, h], dim=1)
        return dict(q=q, k=k, v=v, f=f, b=b, z=z, conv_state=self.randn(3, c, 3),
                    conv_weight=self.randn(3, c, 4, scale=0.5), a_log=self.randn(h, scale=0.5, dtype=torch.float32),
                    dt_bias=self.randn(c, dtype=torch.float32), norm_weight=self.randn(self.d, scale=0.3) + 1,
                    state=self.randn(h, self.d, self.d, scale=0.3, dtype=torch.float32))

    def stage(self, t: int):
        return (torch.full((t, self.h, kda.STAGE_ROWS, self.d), float("nan"), device=self.dev),
                torch.full((t, 3, self.c), float("nan"), device=self.dev, dtype=torch.bfloat16))

    def check(self, name: str, ok: bool, **info):
        self.checks.append(dict(name=name, ok=bool(ok), **info))
        details = " ".join(f"{k}={v:.1e}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
        print(f"  [{'ok' if ok else 'FAIL'}] {name} {details}")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def upcast(inp: dict) -> dict:
    return {n: None if x is None else x.float().clone() for n, x in inp.items()}


def live_copy(inp: dict) -> dict:
    return {**inp, "conv_state": inp["conv_state"].clone(), "state": inp["state"].clone()}


# ---------------------------------------------------------------------------------------------------------
# correctness


def check_step(cx: Ctx, t: int, staged: bool, **kw) -> bool:
    inp = cx.step_inputs(t)
    run = live_copy(inp)
    out = torch.full((t, cx.c), float("nan"), device=cx.dev, dtype=torch.bfloat16)
    stage = cx.stage(t) if staged else None
    kda.fused_kda_step(**run, lower_bound=LB, eps=EPS, out=out, stage=stage, **kw)
    want = upcast(inp)
    want_stage = (torch.empty(t, cx.h, kda.STAGE_ROWS, cx.d, device=cx.dev),
                  torch.empty(t, 3, cx.c, 3, device=cx.dev)) if staged else None
    want_out = kda.kda_step_reference(**want, lower_bound=LB, eps=EPS, stage=want_stage)
    got_state, got_conv = (stage[0], stage[1]) if staged else (run["state"], run["conv_state"])
    ref_state, ref_conv = (want_stage[0], want_stage[1]) if staged else (want["state"], want["conv_state"])
    e_out, e_state = rel(out, want_out), rel(got_state, ref_state)
    conv_ok = torch.equal(got_conv.float(), ref_conv)
    untouched = not staged or (torch.equal(run["state"], inp["state"])
                               and torch.equal(run["conv_state"], inp["conv_state"]))
    ok = e_out < 1e-2 and e_state < 1e-5 and conv_ok and untouched
    cx.check(f"kda_step T={t} {'staged' if staged else 'live'} {kw}", ok, out_err=e_out, state_err=e_state,
             conv_exact=conv_ok, live_untouched=untouched)
    return ok


def check_verify_commit_graph(cx: Ctx, t: int, pdl: bool) -> None:
    """Staged step + commit captured in one graph; the accepted index changes on device between replays."""
    inp = cx.step_inputs(t)
    run = live_copy(inp)
    stage = cx.stage(t)
    index = torch.zeros(1, device=cx.dev, dtype=torch.int32)
    out = torch.empty(t, cx.c, device=cx.dev, dtype=torch.bfloat16)

    def body():
        run["state"].copy_(inp["state"])  # each replay verifies from the same pre-step state
        run["conv_state"].copy_(inp["conv_state"])
        kda.fused_kda_step(**run, lower_bound=LB, eps=EPS, out=out, stage=stage, pdl=pdl)
        kda.fused_commit(index, run["state"][None], stage[0][None], run["conv_state"][None], stage[1][None], pdl=pdl)

    replay = capture(cx, body)
    for accepted in sorted({0, t - 1, int(torch.randint(0, t, (1,), generator=cx.gen))}):
        index.fill_(accepted)
        replay()
        prefix = {n: (x[: accepted + 1] if n in ("q", "k", "v", "f", "b", "z") else x) for n, x in upcast(inp).items()}
        kda.kda_step_reference(**prefix, lower_bound=LB, eps=EPS)
        e = rel(run["state"], prefix["state"])
        conv_ok = torch.equal(run["conv_state"].float(), prefix["conv_state"])
        cx.check(f"graph(verify T={t} staged + commit) pdl={pdl} accepted={accepted}", e < 1e-5 and conv_ok,
                 state_err=e, conv_exact=conv_ok)


def check_race(cx: Ctx, t: int, staged: bool, rounds: int, **kw) -> None:
    sets = [cx.step_inputs(t) for _ in range(2)]
    first, bad = [None, None], 0
    for i in range(rounds):
        inp = sets[i % 2]
        run = live_copy(inp)
        stage = cx.stage(t) if staged else None
        out = kda.fused_kda_step(**run, lower_bound=LB, eps=EPS, stage=stage, **kw)
        got = torch.cat([out.float().flatten(), (stage[0] if staged else run["state"]).flatten(),
                         (stage[1] if staged else run["conv_state"]).float().flatten()])
        if first[i % 2] is None:
            first[i % 2] = got
        elif not torch.equal(got, first[i % 2]):
            bad += 1
    cx.check(f"race hunt T={t} {'staged' if staged else 'live'} x{rounds} {kw}", bad == 0, mismatches=bad)


def check_pdl_chain(cx: Ctx, in_graph: bool) -> None:
    steps = [cx.step_inputs(t) for t in (1, 3, 1, 2)]
    for s in steps[1:]:
        for n in ("conv_weight", "a_log", "dt_bias", "norm_weight"):
            s[n] = steps[0][n]
    live = {"state": steps[0]["state"].clone(), "conv_state": steps[0]["conv_state"].clone()}
    outs = [torch.empty(s["q"].shape, device=cx.dev, dtype=torch.bfloat16) for s in steps]

    def body():
        live["state"].copy_(steps[0]["state"])
        live["conv_state"].copy_(steps[0]["conv_state"])
        for s, o in zip(steps, outs):
            kda.fused_kda_step(**{**s, **live}, lower_bound=LB, eps=EPS, out=o, pdl=True)

    if in_graph:
        capture(cx, body)()
    else:
        body()
    ref_live = {"state": steps[0]["state"].float().clone(), "conv_state": steps[0]["conv_state"].float().clone()}
    errs = [rel(o, kda.kda_step_reference(**{**upcast(s), **ref_live}, lower_bound=LB, eps=EPS))
            for s, o in zip(steps, outs)]
    e = rel(live["state"], ref_live["state"])
    ok = max(errs) < 1e-2 and e < 1e-5 and torch.equal(live["conv_state"].float(), ref_live["conv_state"])
    cx.check(f"pdl chain of 4 steps on one state ({'graph' if in_graph else 'eager'})", ok, out_err=max(errs),
             state_err=e)


def staged_inputs(cx: Ctx, t: int) -> torch.Tensor:
    """[L, T, H, STAGE_ROWS, D] as a staged step leaves them: unit keys, log decay in (-5, 0), values, beta."""
    L = cx.layers
    k = torch.nn.functional.normalize(cx.randn(L, t, cx.h, cx.d, dtype=torch.float32), dim=-1)
    g = -5 * torch.rand(L, t, cx.h, cx.d, device=cx.dev)
    beta = torch.rand(L, t, cx.h, 1, device=cx.dev).expand(L, t, cx.h, cx.d)
    return torch.stack([k, g, cx.randn(L, t, cx.h, cx.d, dtype=torch.float32), beta], dim=3).contiguous()


def check_commit_layers(cx: Ctx, t: int) -> None:
    L = cx.layers
    staged, staged_conv = staged_inputs(cx, t), cx.randn(L, t, 3, cx.c)
    start = cx.randn(L, cx.h, cx.d, cx.d, scale=0.3, dtype=torch.float32)
    live, live_conv = start.clone(), cx.randn(L, 3, cx.c, 3)
    a = int(torch.randint(0, t, (1,), generator=cx.gen))
    want, want_conv = start.clone(), live_conv.clone()
    kda.fused_commit(torch.tensor([a], device=cx.dev), live, staged, live_conv, staged_conv)
    kda.commit_reference(torch.tensor([a], device=cx.dev), want, staged, want_conv, staged_conv)
    e = rel(live, want)
    ok = e < 1e-5 and torch.equal(live_conv, want_conv)
    cx.check(f"commit (replay) {L} layers T={t} accepted={a}", ok, state_err=e)


def check_add_rms_norm(cx: Ctx, t: int) -> None:
    x, res, w = cx.randn(t, cx.hidden), cx.randn(t, cx.hidden, scale=3.0), cx.randn(cx.hidden, scale=0.3) + 1
    out = torch.full((t, cx.hidden), float("nan"), device=cx.dev, dtype=torch.bfloat16)
    got, got_res = norm.fused_add_rms_norm(x, res.clone(), w, EPS, out=out)
    want, want_res = norm.add_rms_norm_reference(x, res.clone(), w, EPS)
    e = rel(got, want)
    exact = torch.equal(got_res, want_res) if cx.dev == "cuda" else True  # the interpreter truncates bf16
    cx.check(f"add_rms_norm T={t} N={cx.hidden}", e < 1e-2 and exact, normed_err=e, residual_exact=exact)


# ---------------------------------------------------------------------------------------------------------
# timing


def capture(cx: Ctx, body):
    """body captured in a CUDA graph (warmed up first); returns replay. Off GPU, body itself."""
    if cx.dev != "cuda":
        return body
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()

    def replay():
        graph.replay()
        torch.cuda.synchronize()
    return replay


def graph_us(cx: Ctx, launches: list, reps: int = 100) -> float:
    """Median replay time of one graph holding all launches, per launch, in microseconds."""
    graph = torch.cuda.CUDAGraph()
    for f in launches:
        f()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for f in launches:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times) * 1e3 / len(launches)


def kda_bytes(cx: Ctx, t: int, staged: bool) -> int:
    state, conv = cx.h * cx.d * cx.d * 4, 3 * cx.c * 3 * 2
    reads = state + conv + t * (5 * cx.c + cx.h) * 2 + 3 * cx.c * 4 * 2 + cx.h * 4 + cx.c * 4 + cx.d * 2
    staged_inputs_bytes = cx.h * kda.STAGE_ROWS * cx.d * 4
    writes = t * cx.c * 2 + (t * (staged_inputs_bytes + conv // 3) if staged else state + conv)
    return reads + writes


def time_kda(cx: Ctx, t: int, staged: bool, bw: float, **kw) -> dict:
    sets = []
    for _ in range(N_SETS):
        inp = cx.step_inputs(t)
        sets.append((inp, cx.stage(t) if staged else None, torch.empty(t, cx.c, device=cx.dev, dtype=torch.bfloat16)))
    us = graph_us(cx, [lambda s=s: kda.fused_kda_step(**s[0], lower_bound=LB, eps=EPS, out=s[2], stage=s[1], **kw)
                       for s in sets])
    floor = kda_bytes(cx, t, staged) / bw * 1e6
    return dict(op="kda_step", t=t, staged=staged, **kw, us=us, floor_us=floor, x_floor=us / floor)


def time_reference(cx: Ctx, t: int, bw: float) -> dict:
    inp = cx.step_inputs(t)
    us = median_ms(lambda: kda.kda_step_reference(**inp, lower_bound=LB, eps=EPS), reps=10, warm=1) * 1e3
    floor = kda_bytes(cx, t, False) / bw * 1e6
    return dict(op="kda_step_reference (torch, eager)", t=t, staged=False, us=us, floor_us=floor, x_floor=us / floor)


def time_commit(cx: Ctx, t: int, bw: float, pdl: bool) -> dict:
    L = cx.layers
    staged, staged_conv = staged_inputs(cx, t), cx.randn(L, t, 3, cx.c)
    live = cx.randn(L, cx.h, cx.d, cx.d, scale=0.3, dtype=torch.float32)
    live_conv = torch.empty(L, 3, cx.c, 3, device=cx.dev, dtype=torch.bfloat16)
    index = torch.tensor([t // 2], device=cx.dev)
    us = graph_us(cx, [lambda: kda.fused_commit(index, live, staged, live_conv, staged_conv, pdl=pdl)])
    floor = (2 * (live.numel() * 4 + live_conv.numel() * 2) + staged.numel() * 4) / bw * 1e6
    return dict(op=f"commit ({L} layers)", t=t, staged=True, pdl=pdl, us=us, floor_us=floor, x_floor=us / floor)


def time_add_rms_norm(cx: Ctx, t: int, bw: float, pdl: bool) -> dict:
    sets = [(cx.randn(t, cx.hidden), cx.randn(t, cx.hidden), cx.randn(cx.hidden),
             torch.empty(t, cx.hidden, device=cx.dev, dtype=torch.bfloat16)) for _ in range(N_SETS)]
    us = graph_us(cx, [lambda s=s: norm.fused_add_rms_norm(s[0], s[1], s[2], EPS, out=s[3], pdl=pdl) for s in sets])
    floor = (4 * t * cx.hidden * 2 + cx.hidden * 2) / bw * 1e6
    return dict(op="add_rms_norm", t=t, staged=False, pdl=pdl, us=us, floor_us=floor, x_floor=us / floor)


# ---------------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON results path")
    ap.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): checks only, small sizes")
    args = ap.parse_args()
    if args.smoke:
        cx = Ctx("cpu", h=2, d=32, hidden=96, layers=3)
        sweep, rounds = [dict(block_v=8, num_warps=4)], 6
    else:
        if not torch.cuda.is_available():
            print("no GPU: run with TRITON_INTERPRET=1 ... --smoke for the checks alone")
            return 2
        cx = Ctx("cuda", h=8, d=128, hidden=2560, layers=35)
        sweep = [dict(block_v=bv, num_warps=nw)
                 for bv, nw in ((8, 2), (8, 4), (16, 2), (16, 4), (16, 8), (32, 4), (32, 8), (64, 4))]
        rounds = 200

    print("checks")
    for kw in sweep:  # the variants timed below, with PDL as timed
        check_step(cx, 1, staged=False, pdl=True, **kw)
        check_step(cx, 9, staged=True, pdl=True, **kw)
    check_step(cx, 16, staged=True)
    check_step(cx, 9, staged=False)
    for pdl in (False, True):
        check_verify_commit_graph(cx, 9, pdl)
    check_race(cx, 1, staged=False, rounds=rounds)
    check_race(cx, 9, staged=True, rounds=rounds, pdl=True)
    check_pdl_chain(cx, in_graph=False)
    check_pdl_chain(cx, in_graph=True)
    check_commit_layers(cx, 9)
    for t in (1, 9):
        check_add_rms_norm(cx, t)
    result = dict(device=cx.dev, checks=cx.checks, rows=[])

    if not args.smoke:
        from lingls.bench.step import copy_bandwidth  # the project's one definition of the copy rate

        bw = copy_bandwidth()
        rows = []
        for kw in sweep:
            rows.append(time_kda(cx, 1, False, bw, pdl=True, **kw))
            rows.append(time_kda(cx, 9, True, bw, pdl=True, **kw))
        best = {t: min((r for r in rows if r["t"] == t), key=lambda r: r["us"]) for t in (1, 9)}
        for t, staged in ((1, False), (9, True)):
            kw = dict(block_v=best[t]["block_v"], num_warps=best[t]["num_warps"])
            rows.append(time_kda(cx, t, staged, bw, pdl=False, **kw))
        kw9 = dict(block_v=best[9]["block_v"], num_warps=best[9]["num_warps"])
        rows.append(time_kda(cx, 9, False, bw, pdl=True, **kw9))
        rows.append(time_kda(cx, 16, True, bw, pdl=True, **kw9))
        rows += [time_reference(cx, t, bw) for t in (1, 9)]
        rows += [time_commit(cx, t, bw, pdl) for t in (9, 16) for pdl in (False, True)]
        rows += [time_add_rms_norm(cx, t, bw, pdl) for t in (1, 9) for pdl in (False, True)]
        result.update(rows=rows, copy_tbs=bw / 1e12, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                      triton=__import__("triton").__version__, host=platform.node(), n_sets=N_SETS,
                      shapes=dict(heads=cx.h, head_dim=cx.d, hidden=cx.hidden, layers=cx.layers))
        print(f"\ncopy {bw / 1e12:.2f} TB/s; each time is the median graph replay over {N_SETS} distinct buffer sets")
        print(f"{'op':<36} {'T':>3} {'staged':>6} {'block_v':>7} {'warps':>5} {'pdl':>5} {'us':>8} {'floor us':>8} "
              f"{'x floor':>7}")
        for r in rows:
            print(f"{r['op']:<36} {r['t']:>3} {str(r['staged']):>6} {r.get('block_v', '-'):>7} "
                  f"{r.get('num_warps', '-'):>5} {str(r.get('pdl', '-')):>5} {r['us']:>8.2f} {r['floor_us']:>8.2f} "
                  f"{r['x_floor']:>7.2f}")
        print(f"best T=1: block_v={best[1]['block_v']} warps={best[1]['num_warps']}; "
              f"best T=9: block_v={best[9]['block_v']} warps={best[9]['num_warps']}")

    write_result(args.out, result)
    failed = [c["name"] for c in cx.checks if not c["ok"]]
    print(f"\n{len(cx.checks) - len(failed)}/{len(cx.checks)} checks passed"
          + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
