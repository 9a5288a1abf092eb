"""A prefill's KDA recurrence (fla-core's `chunk_kda`) with its sequential state pass split across the prompt.

fla's chunked KDA runs three stages: per-chunk work in parallel (gate cumsums, the intra-chunk triangular solve),
then one pass over the chunks in order that carries the [K, V] state (`chunk_gated_delta_rule_fwd_h`), then the
outputs per chunk in parallel. At a TP=4 rank of Ling-3.0-flash (8 heads of 128) the middle pass has 16-32
programs for 132 multiprocessors and walks 128 chunks one after another at 8,192 tokens: ~0.6 ms a layer, the
largest single kernel of a long prefill (docs/kernel-log.md, seventeenth session). Each chunk's step is affine
in the state (S -> M S + B), so the pass splits: the chunks are cut into `parts` runs; fla's context-parallel
pre-scan (`chunk_cp_fwd_h`) writes every run's summary [B | M] from a zero state, all runs at once; fla's merge
kernel (its intra-card form) chains the summaries from the initial state into each run's initial state; then the
state pass runs every run at once as a separate sequence (varlen) from its initial state. The sequential depth
is about 2 * chunks / parts + parts steps instead of chunks. The runs' boundaries, chunk indices and the merge's
offsets are built on the device from the length alone (no host read, no copy from the host: capturable).

The merge multiplies in fp32 (`tf32x3`), so the states differ from the unsplit pass by fp32 rounding: the
outputs are the same function, not the same bits (`tests/runtime/test_prefill.py` compares them). This module
follows fla-core 0.6.0's internals; `available()` is false for any other version (the unsplit `chunk_kda` then
serves).
"""

from __future__ import annotations

import os

import torch

from lingls.kernels import by_tokens

CHUNK = 64  # fla's KDA chunk size
# runs of the state pass by prompt tokens (`by_tokens`: the smallest key >= T); 1: fla's chunk_kda unsplit.
# Unsplit: the one GPU run so far (nineteenth session) timed the split only eagerly, where the host's launches hid
# the device time, and never inside a prefill graph (`lingls bench prefix --tune --previous` now times graph replays)
PARTS: dict[int, int] = {8192: 1}
PREVIOUS: dict[int, int] = {8192: 1}  # the unsplit pass everywhere (`lingls bench prefix --previous` times it)
_FLA: list = []


def _fla():
    """fla-core's pieces this module calls, or None (absent, or not the 0.6.0 whose internals it follows)."""
    if not _FLA:
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # as `ling.fla_chunk_kda`: fla's tuning kept on disk
        try:
            import fla
            from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
            from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h
            from fla.ops.cp.chunk_merge import chunk_cp_fwd_bwd_kernel_merge
            from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
            from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
            from fla.ops.utils import chunk_local_cumsum
            from fla.ops.utils.constant import RCP_LN2

            ok = getattr(fla, "__version__", "") == "0.6.0"
            _FLA.append(dict(fwd_h=chunk_gated_delta_rule_fwd_h, prescan=chunk_cp_fwd_h,
                             merge=chunk_cp_fwd_bwd_kernel_merge, fwd_o=chunk_gla_fwd_o_gk, intra=chunk_kda_fwd_intra,
                             cumsum=chunk_local_cumsum, rcp_ln2=RCP_LN2) if ok else None)
        except Exception:
            _FLA.append(None)
    return _FLA[0]


def available() -> bool:
    return _fla() is not None


def parts_for(t: int) -> int:
    """How many runs the state pass of a T-token prefill is split into (`PARTS`; at least 2 chunks a run)."""
    return max(1, min(by_tokens(PARTS, t), -(-t // CHUNK) // 2))


def chunk_kda(q, k, v, g, beta, initial_state, parts: int):
    """fla's `chunk_kda(q, k, v, g, beta, scale=1.0, initial_state, output_final_state=True)` of one sequence
    ([1, T, H, D] inputs, fp32 state [1, H, D, D]) with the state pass in `parts` runs (`state_pass`).
    Returns (o [1, T, H, D] in q's dtype, final state [1, H, D, D] fp32)."""
    f = _fla()
    g = f["cumsum"](g=g, scale=f["rcp_ln2"], chunk_size=CHUNK)
    w, u, _qg, kg, aqk, _akk = f["intra"](q=q, k=k, v=v, gk=g, beta=beta, scale=1.0, chunk_size=CHUNK)
    h, v_new, final = state_pass(kg, w, u, g, initial_state, parts)
    o = f["fwd_o"](q=q, v=v_new, g=g, A=aqk, h=h, scale=1.0, chunk_size=CHUNK)
    return o.to(q.dtype), final


def runs(t: int, parts: int, device) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The runs of a T-token state pass cut into `parts` of whole chunks (the last may be shorter), as fla's
    varlen kernels take them, built on the device: (runs (at most `parts`), token boundaries [runs + 1],
    each run's first chunk [runs + 1], each chunk's (run, chunk within it) [chunks, 2]; int32)."""
    chunks = -(-t // CHUNK)
    per = -(-chunks // parts)  # chunks per run
    parts = -(-chunks // per)
    run = torch.arange(parts + 1, device=device, dtype=torch.int32)
    c = torch.arange(chunks, device=device, dtype=torch.int32)
    return (parts, torch.clamp(run * (per * CHUNK), max=t), torch.clamp(run * per, max=chunks),
            torch.stack([c // per, c % per], 1))


def state_pass(kg, w, u, g, initial_state, parts: int):
    """fla's `chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g, initial_state, output_final_state=True)` of one
    sequence ([1, T, H, D]; g the chunk-local gate cumsums) in `parts` runs: (h per chunk [1, chunks, H, D, D],
    the new values [1, T, H, D], the final state [1, H, D, D] fp32)."""
    f = _fla()
    _, t, heads, d = kg.shape
    dv = u.shape[-1]
    parts, cu, chunk_offsets, chunk_indices = runs(t, parts, kg.device)
    # each run's summary [B | M] from a zero state, all runs at once
    summaries = kg.new_empty(parts, heads, d, dv + d, dtype=torch.float32)
    f["prescan"](k=kg, w=w, u=u, hm=summaries, gk=g, cu_seqlens=cu, chunk_size=CHUNK, multi_seqs=True)
    # the states entering runs 1.. (the intra-card merge of one sequence split into `parts`)
    entering = kg.new_empty(parts - 1, heads, d, dv, dtype=torch.float32)
    offsets = torch.arange(2, device=kg.device, dtype=torch.int32)
    f["merge"][lambda meta: (-(-dv // meta["BV"]), 1, heads)](
        h=entering, ag_hm=summaries, num_ranks=1, rank=0, seq_offsets=offsets * parts,
        init_offsets=offsets * (parts - 1), h0_seq_ids=offsets[:1] * 0, h0=initial_state, h_seq_idx=None, HV=heads,
        K=d, V=dv, BK=1 << (d - 1).bit_length(), FORWARD=True, IS_INTRACARD=True, N=1, STATE_V_FIRST=False)
    starts = torch.cat([initial_state.float(), entering])
    h, v_new, finals = f["fwd_h"](k=kg, w=w, u=u, gk=g, initial_state=starts, output_final_state=True,
                                  chunk_size=CHUNK, cu_seqlens=cu, chunk_indices=chunk_indices,
                                  chunk_offsets=chunk_offsets)
    return h, v_new, finals[parts - 1:]
