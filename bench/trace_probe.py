"""Why does a CUPTI trace of the 9-token step span ~3.0 ms when its graph replays in ~4.0? (a probe)

Times the fused T=9 (and T=1) graph with CUDA events with and without a torch.profiler CUDA session active,
and compares the step's output after a replay from the same state in both conditions.

    python bench/trace_probe.py OUT.json [LAYERS]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from fused_step_gpu import CONTEXT, graphed, random_state  # noqa: E402

from lingls.bench.step import build_flash, median_ms  # noqa: E402
from lingls.runtime.fused_step import FusedStep  # noqa: E402


def main(out: str, layers: int) -> int:
    torch.manual_seed(0)
    model = build_flash(layers, tp=4, rank=0)
    vocab = model.config.vocab_size
    state = random_state(model)
    res = dict(rows=[])
    for pdl in (True, False):
        fused = FusedStep(model, kernels=True, pdl=pdl)
        for t in (1, 9):
            ids = torch.randint(0, vocab, (t,), device="cuda")
            pos = torch.arange(CONTEXT - t, CONTEXT, device="cuda")
            work = state.clone()
            captured = {}  # the step's output as captured: the graph's output buffer

            def step(ids=ids, pos=pos, work=work, fused=fused):
                captured["y"] = fused.step(ids, work, pos)
            with torch.inference_mode():
                replay = graphed(step)

                def once():
                    work.kda.copy_(state.kda)
                    work.conv.copy_(state.conv)
                    replay()
                    torch.cuda.synchronize()
                    return captured["y"].clone()
                plain_ms = median_ms(replay, reps=30)
                y_plain = once()
                with profile(activities=[ProfilerActivity.CUDA]):
                    traced_ms = median_ms(replay, reps=30)
                    y_traced = once()
                again_ms = median_ms(replay, reps=30)
            r = dict(pdl=pdl, T=t, plain_ms=plain_ms, under_profiler_ms=traced_ms, after_profiler_ms=again_ms,
                     same_output=bool(torch.equal(y_plain, y_traced)))
            res["rows"].append(r)
            print(r)
    Path(out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "trace_probe.json",
                  int(sys.argv[2]) if len(sys.argv) > 2 else 42))
