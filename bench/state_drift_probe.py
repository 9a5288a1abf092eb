"""Does the timed state move the 9-token step's time? (a probe: the step's cost depends on its routing)

`fused_step_gpu.py` times a plain (unstaged) T-token step by replaying its graph on one state, which every
replay advances; before that the eager model's graph (whose MoE sums with float atomics, so its result differs
run to run) replayed on the same state. A different state routes the 9 tokens to a different number of distinct
experts, and each distinct expert is ~2.95 MB per MoE layer at TP=4. This replays the fused T=9 graph
(a) on a state advanced by the fused step only (deterministic), (b) after the eager model's graph advanced it,
twice from the same start, (c) with the state restored before every replay (outside the timed events), and
prints the time beside the distinct experts the state routes to.

    python bench/state_drift_probe.py OUT.json [LAYERS]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from fused_step_gpu import CONTEXT, graphed, random_state, routed_experts  # noqa: E402

from lingls.bench.step import build_flash, median_ms  # noqa: E402
from lingls.runtime.fused_step import FusedStep  # noqa: E402


def timed_restored(replay, restore, reps: int = 30) -> float:
    """Median ms of `replay`, the state restored (and the copy finished) before each timed replay."""
    times = []
    for i in range(reps + 3):
        restore()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(out: str, layers: int) -> int:
    torch.manual_seed(0)
    model = build_flash(layers, tp=4, rank=0)
    vocab = model.config.vocab_size
    state = random_state(model)
    fused = FusedStep(model, kernels=True)
    torch.randint(0, vocab, (1,), device="cuda")  # fused_step_gpu draws T=1's ids first
    ids = torch.randint(0, vocab, (9,), device="cuda")
    pos = torch.arange(CONTEXT - 9, CONTEXT, device="cuda")
    res = dict(what="fused T=9 step time against the state it is replayed on", layers=layers, rows=[])

    def row(name, ms, st):
        r = dict(case=name, ms=ms, distinct=routed_experts(model, ids, st, pos),
                 finite=bool(torch.isfinite(st.kda).all()), kda_norm=float(st.kda.norm()))
        res["rows"].append(r)
        print(f"{name:34} {ms:7.3f} ms  distinct {r['distinct']:3d}  finite {r['finite']}  |kda| {r['kda_norm']:.1f}")

    with torch.inference_mode():
        row("start state (no replay timed)", float("nan"), state)
        work = state.clone()
        fast = graphed(lambda: fused.step(ids, work, pos))
        for r in range(4):
            row(f"fused only, after block {r}", median_ms(fast, reps=30), work)
        eager_states = []
        for r in range(2):
            w = state.clone()
            plain = graphed(lambda w=w: model.step(ids, w, pos))
            median_ms(plain, reps=30)
            eager_states.append(w)
            f = graphed(lambda w=w: fused.step(ids, w, pos))
            row(f"after eager graph, run {r}", median_ms(f, reps=30), w)
        res["eager_runs_equal"] = bool(torch.equal(eager_states[0].kda, eager_states[1].kda))
        print("two eager evolutions from one start equal:", res["eager_runs_equal"])
        work = state.clone()
        fast = graphed(lambda: fused.step(ids, work, pos))

        def restore():
            work.kda.copy_(state.kda)
            work.conv.copy_(state.conv)
        for r in range(3):
            row(f"restored before each replay {r}", timed_restored(fast, restore), state)
    Path(out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "state_drift.json",
                  int(sys.argv[2]) if len(sys.argv) > 2 else 42))
