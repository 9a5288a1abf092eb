"""Does where the experts' weights sit in memory move the step? (a probe: the same code's 9-token step measures
up to ~150 us apart in two processes, and the state it replays on does not explain it: state_drift_probe.py)

In one process: time the fused T=1 and T=9 steps, each graph replayed from a copy of the same state (so every
configuration routes the same tokens to the same experts); then move every MoE layer's expert weights to fresh
allocations (same values; the old ones freed and the allocator's cache emptied, so the driver maps memory
anew) and time again, several times; then, if it fits, all layers' experts in one allocation. Re-capturing
without a move gives the noise of the measurement itself. If the times move with the allocations, the spread
between processes is the weights' placement (pages, TLB reach), not the code.

    python bench/placement_probe.py OUT.json [LAYERS] [MOVES]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from fused_step_gpu import CONTEXT, graphed, random_state  # noqa: E402

from lingls.bench.step import build_flash, median_ms  # noqa: E402
from lingls.runtime.fused_step import FusedStep  # noqa: E402


def expert_entries(fused: FusedStep) -> list[dict]:
    return [e for e in fused.layers if "moe" in e]


def place(entries: list[dict], tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Point MoE layers (the kernels' weights and the model's parameters) at new (gate_up, down) tensors."""
    for entry, (gu, dn) in zip(entries, tensors):
        experts = entry["layer"].mlp.experts
        experts.gate_up_proj.data, experts.down_proj.data = gu, dn
        entry["moe"] = entry["moe"]._replace(gate_up=gu, down=dn)


def move_each(fused: FusedStep) -> None:
    """Each layer's experts to allocations of their own, one layer at a time (peak: one layer's extra)."""
    for entry in expert_entries(fused):
        place([entry], [(entry["moe"].gate_up.clone(), entry["moe"].down.clone())])
        torch.cuda.empty_cache()


def move_into_one(fused: FusedStep) -> bool:
    """All layers' experts into one allocation, in layer order; False (nothing moved) if it does not fit."""
    ws = [e["moe"] for e in expert_entries(fused)]
    total = sum(w.gate_up.numel() + w.down.numel() for w in ws)
    try:
        big = torch.empty(total, dtype=ws[0].gate_up.dtype, device=ws[0].gate_up.device)
    except torch.OutOfMemoryError:
        return False
    views, at = [], 0
    for w in ws:
        pair = []
        for t in (w.gate_up, w.down):
            v = big[at: at + t.numel()].view(t.shape)
            v.copy_(t)
            pair.append(v)
            at += t.numel()
        views.append(tuple(pair))
    del ws
    place(expert_entries(fused), views)
    torch.cuda.empty_cache()
    return True


def main(out: str, layers: int, moves: int) -> int:
    torch.manual_seed(0)
    model = build_flash(layers, tp=4, rank=0)
    vocab = model.config.vocab_size
    state = random_state(model)
    fused = FusedStep(model, kernels=True)
    inputs = {t: (torch.randint(0, vocab, (t,), device="cuda"), torch.arange(CONTEXT - t, CONTEXT, device="cuda"))
              for t in (1, 9)}

    def timed() -> dict:
        row = {}
        for t, (ids, pos) in inputs.items():
            work = state.clone()
            replay = graphed(lambda: fused.step(ids, work, pos))
            work.kda.copy_(state.kda)
            work.conv.copy_(state.conv)
            row[f"t{t}_ms"] = median_ms(replay, reps=60)
            del replay
        return row

    rows = []

    def record(case: str) -> None:
        r = dict(case=case, **timed())
        rows.append(r)
        print(f"{case:24s} T=1 {r['t1_ms']:.3f} ms   T=9 {r['t9_ms']:.3f} ms", flush=True)

    record("as built")
    record("re-captured, not moved")
    for i in range(moves):
        move_each(fused)
        record(f"moved {i + 1}")
    record("one allocation" if move_into_one(fused) else "one allocation: no room")
    record("re-captured, not moved")
    t9 = [r["t9_ms"] for r in rows]
    res = dict(what="fused step time as the experts' weights move to new allocations, one process", layers=layers,
               context=CONTEXT, device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows,
               t9_spread_ms=max(t9) - min(t9))
    Path(out).write_text(json.dumps(res, indent=1))
    print(f"T=9 spread over the placements: {res['t9_spread_ms'] * 1e3:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 42,
                  int(sys.argv[3]) if len(sys.argv) > 3 else 4))
