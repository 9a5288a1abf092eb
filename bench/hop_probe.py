"""What one dependent hop costs on this GPU: a chain of tiny kernels under programmatic dependent launch (what
the fused step is) against the same chain of phases inside one persistent kernel, its programs synchronised
through global-memory counters (what a persistent per-layer kernel would be).

    python bench/hop_probe.py OUT.json [HOPS]

Every hop moves one value per program from the previous hop's program p + 1 to program p, so each hop depends
on the one before it across programs, as a layer's kernels do. Chains of HOPS launches (or phases) are captured
in a CUDA graph and replayed; the figure is the median replay over HOPS. Variants:
- `pdl_late` / `pdl_early`: one launch per hop, with PDL (the next launch after / before the wait), as
  `lingls.kernels.pdl` LATE / EARLY; `no_pdl`: plain stream order.
- `grid_barrier`: one kernel; after each phase every program bumps a counter and spins until all have.
- `flags`: one kernel; each program waits only for the program whose value it reads (a flag per program and
  phase): the point-to-point latency a dataflow kernel would pay.
- `..._ld`: the same, every thread polling with volatile loads instead of one thread's acquire load and a
  shared-memory broadcast (one acquire read after the spin).
The persistent variants need every program resident at once: PROGRAMS is at most one per SM, and every spin
gives up after SPIN_LIMIT polls and marks the result invalid instead of hanging the GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from fused_step_gpu import graphed  # noqa: E402

from lingls.bench.step import median_ms  # noqa: E402
from lingls.kernels.pdl import EARLY, LATE, OFF, wait_previous  # noqa: E402

SPIN_LIMIT = 2_000_000


@triton.jit
def _hop_kernel(buf_ptr, hop, P: tl.constexpr, USE_PDL: tl.constexpr):
    p = tl.program_id(0)
    wait_previous(USE_PDL)
    v = tl.load(buf_ptr + hop * P + (p + 1) % P, cache_modifier=".cg")
    tl.store(buf_ptr + (hop + 1) * P + p, v + 1.0)


@triton.jit
def _poll(flag, ATOMIC: tl.constexpr):
    """The counter or flag as this program sees it: an atomic read (Triton 3.6 emits an add of 0 as one thread's
    `ld.acquire.gpu`, broadcast to the others through shared memory), or every thread's volatile load."""
    if ATOMIC:
        return tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
    return tl.load(flag, volatile=True)


@triton.jit
def _persistent_kernel(buf_ptr, sync_ptr, bad_ptr, HOPS: tl.constexpr, P: tl.constexpr, FLAGS: tl.constexpr,
                       ATOMIC: tl.constexpr, SPIN_LIMIT: tl.constexpr):
    p = tl.program_id(0)
    for hop in range(HOPS):
        v = tl.load(buf_ptr + hop * P + (p + 1) % P, cache_modifier=".cg")
        tl.store(buf_ptr + (hop + 1) * P + p, v + 1.0)
        tl.debug_barrier()
        if FLAGS:  # publish this program's value; wait for the producer of the next hop's read
            tl.atomic_xchg(sync_ptr + (hop + 1) * P + p, 1, sem="release", scope="gpu")
            flag = sync_ptr + (hop + 1) * P + (p + 1) % P
            target = 1
        else:  # everyone arrives, everyone waits for all
            tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
            flag = sync_ptr
            target = (hop + 1) * P
        seen = _poll(flag, ATOMIC)
        spins = 0
        while (seen < target) & (spins < SPIN_LIMIT):
            seen = _poll(flag, ATOMIC)
            spins += 1
        if not ATOMIC:  # the loads polled without ordering: one acquire read orders what follows
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        if (spins >= SPIN_LIMIT) | (seen < target):
            tl.atomic_xchg(bad_ptr, 1)


def main(out: str, hops: int) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for programs in (sms, sms // 2, 32):
        buf = torch.zeros((hops + 1) * programs, device="cuda")
        want = torch.full((programs,), float(hops), device="cuda")

        def chain(mode, programs=programs, buf=buf):
            launch = {"launch_pdl": True} if mode != OFF else {}
            for hop in range(hops):
                _hop_kernel[(programs,)](buf, hop, P=programs, USE_PDL=mode, num_warps=4, **launch)

        for name, mode in (("no_pdl", OFF), ("pdl_late", LATE), ("pdl_early", EARLY)):
            buf.zero_()
            replay = graphed(lambda mode=mode: chain(mode))
            us = median_ms(replay, reps=30) * 1e3 / hops
            buf.zero_()
            replay()
            torch.cuda.synchronize()
            rows.append(dict(variant=name, programs=programs, us_per_hop=us,
                             correct=bool(torch.equal(buf[hops * programs:], want))))
        for name, flags, atomic in (("grid_barrier", False, True), ("flags", True, True),
                                    ("grid_barrier_ld", False, False), ("flags_ld", True, False)):
            sync = torch.zeros((hops + 1) * programs if flags else 1, dtype=torch.int32, device="cuda")
            bad = torch.zeros(1, dtype=torch.int32, device="cuda")

            def persistent(flags=flags, atomic=atomic, sync=sync, bad=bad, programs=programs, buf=buf):
                sync.zero_()
                _persistent_kernel[(programs,)](buf, sync, bad, HOPS=hops, P=programs, FLAGS=flags, ATOMIC=atomic,
                                                SPIN_LIMIT=SPIN_LIMIT, num_warps=4)

            buf.zero_()
            replay = graphed(persistent)
            us = median_ms(replay, reps=30) * 1e3 / hops
            buf.zero_()
            bad.zero_()
            replay()
            torch.cuda.synchronize()
            rows.append(dict(variant=name, programs=programs, us_per_hop=us,
                             correct=bool(torch.equal(buf[hops * programs:], want)) and int(bad.item()) == 0))
    result = dict(what="cost of one dependent hop: launches under PDL against phases of one persistent kernel",
                  device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  sms=sms, hops=hops, rows=rows)
    Path(out).write_text(json.dumps(result, indent=2))
    print(f"{'variant':>14} {'programs':>8} {'us/hop':>8} correct")
    for r in rows:
        print(f"{r['variant']:>14} {r['programs']:>8} {r['us_per_hop']:>8.2f} {r['correct']}")
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "hop_probe.json",
                  int(sys.argv[2]) if len(sys.argv) > 2 else 390))
