"""Programmatic dependent launch (PDL): where a kernel waits for the one before it, and when it lets the next
one launch.

A kernel launched with PDL may start while the kernel before it still runs: its programs request what no kernel
writes (weights) and then wait (`gdc_wait`) until that kernel has finished and its writes are visible. The other
half is when the next kernel may launch: once every program of this one has called `gdc_launch_dependents`
(or exited). The kernels' `USE_PDL` constexpr says where that call sits:

- `LATE` (after the wait): the next kernel launches only when this one's wait is over, so a kernel's weights are
  requested at most one kernel ahead. On the H200 the kernel after a small one (an RMSNorm) started only ~1 us
  before that one ended, and streamed most of its weights after it (bench/step_timeline.py).
- `EARLY` (before the wait): the next kernel launches as soon as every program of this one has started, so a
  chain of kernels requests weights several kernels ahead, as far as the SMs have room for the waiting programs.

Measured on one H200, TP=4 rank shard, 42 layers (bench/results/step_timeline.json,
fused_step_shard42_late.json, fused_step_shard42_early_all.json):
EARLY at one token moves the KDA input projection's share of a layer from ~10 to ~7 us (it now starts ~6 us
before the norm ahead of it ends; the MoE down kernel's share grows by ~2.7 us) and the decode step from ~1.557
to ~1.521 ms; at 9 tokens (verify) it made the step slower (4.43 -> 4.76 ms; not analysed, likely the programs
launched early holding SM room the wide expert kernels need), hence `EARLY_MAX_TOKENS`. At TP=2 it changed
nothing measurable (bench/results/step_timeline_tp2.json).

What runs after a wait stays ordered as before (a wait ends only after the previous kernel completed, and that one
had waited for the one before it). What changes is the part before the wait: under EARLY the kernels two or more
launches back may still be running, so that part may read only weights, the step's inputs, and state no kernel of
the step writes before it (the KDA step's recurrent and conv states, last written by the layer's previous step, or
by the commit or prefill in another graph). Kernels whose successors read something else before their wait keep
LATE: the routing (the shared expert's gate-up programs read x before waiting) and the gate-up kernel (the down
kernel reads the routing's slots before its wait). No program ever waits on a later kernel, and a kernel launches
only once all programs of the one before it are resident, so waiting programs cannot starve the kernel they wait
for.
"""

from __future__ import annotations

from lingls.kernels import jit, tl

OFF, LATE, EARLY = 0, 1, 2
# The launches that trigger EARLY (by kernel kind) and up to how many tokens: the policy measured best on the
# H200 (bench/step_timeline.py); benchmarks change it. Never EARLY, whatever the policy: see the module note.
EARLY_KINDS = {"gemv", "norm", "kda", "mla", "router", "down"}
EARLY_MAX_TOKENS = 1
_NEVER_EARLY = frozenset({"route", "gate_up"})


def mode(pdl: bool, kind: str, tokens: int) -> int:
    """The `USE_PDL` constexpr of a launch of `kind` over `tokens` tokens: OFF without PDL, else EARLY where
    the policy says so and the kind allows it, else LATE."""
    if not pdl:
        return OFF
    early = kind in EARLY_KINDS and kind not in _NEVER_EARLY and tokens <= EARLY_MAX_TOKENS
    return EARLY if early else LATE


@jit
def wait_previous(USE_PDL: tl.constexpr):
    """Wait for the previous kernel and let the next one launch, in the order `USE_PDL` says (2: EARLY,
    1 or True: LATE, 0: no PDL)."""
    if USE_PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
