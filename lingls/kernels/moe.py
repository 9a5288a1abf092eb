"""Fused MoE for T <= 16 tokens (decode and verify): router + grouped top-k, expert gate-up + SwiGLU, down.

At batch 1 an MoE layer is a walk over the weights of the experts the tokens chose (8 routed + 1 shared per
token at Ling-3.0, 2.95 MB each per TP=4 rank) plus the router (2.6 MB); the arithmetic is negligible. Issued
as torch ops it is dozens of small kernels that each reach a fraction of the bandwidth (one expert-sized
torch.mm reaches ~0.9 TB/s on an H200). Here it is four launches, the last two streaming many experts at once:

1. `_router_kernel`: bf16 router matvec, fp32 partial logits per range of H (split over E and H, so the
   2.6 MB of router weights stream from every SM).
2. `_route_token_kernel`: one program per token sums the partials in a fixed order and routes on chip:
   sigmoid, group scores (sum of the top-2 of score + bias per group), the best `topk_group` groups, the top-k
   experts, weights from the unbiased scores (renormalised, scaled). It writes each token's weight per expert
   wt[token, expert] (0 where the token did not choose it; the shared expert always weighs 1) and the *slots*
   the expert kernels walk: the shared expert (id E) in slot 0, then a row of k slots per token holding its
   experts in ascending id order. Routing in the router's last program instead (an atomic arrival counter, no
   launch of its own) was slower at every width on an H200: under PDL a launch boundary costs less than the
   counter's fences (bench/results/tune_t1_moe_tp4_solo.json).
3. `_gate_up_kernel`: programs over (slot, block of I). Each streams its expert's gate and up rows once for all
   T tokens and writes SwiGLU(gate, up) (with the clamp) for the tokens that chose it. An expert several
   tokens chose sits in several rows: only the lowest token's slot streams it (for every token that chose
   it); the others exit at once, and the kernel writes the slots with them marked -1 for the down kernel
   (`_lowest_holder`). The grid is sized for the worst case, so nothing is read back to the host, and a
   program's first dependent reads are its own slot and the rows below it, side by side.
4. `_down_kernel`: programs over blocks of the hidden dim; each walks the slots, multiplies their
   activations with its rows of the expert's down projection and accumulates wt[token, expert] * result in
   fp32, so the weighted sum over the k experts and the shared expert happens in registers, without atomics,
   and the output (optionally plus a residual) is written once.

Why a row of slots per token, not one list of the distinct experts: that list needs every token's choice,
so the tokens' programs had to meet (each marking a presence table, the last to arrive, after a release fence,
reading it back and ranking it): ~3 us of every verify step's MoE layer on an H200, where the duplicate check
in the gate-up kernel costs a comparison (its reads go out together with the slot's own).

Why not fewer launches: the down projection needs a whole expert's activation (all of I), which no single
program of the gate-up launch holds; splitting down over I instead (atomics into the output) costs
T*k*(I/BLOCK_I)*H fp32 atomics, ~2.5M at T=9, slower than the launch it saves. Programmatic dependent launch
(`pdl=True`) hides the launch boundaries instead.

Weights: the checkpoint's stacking is already what the kernels want, so the 512 experts are not copied at load.
Routed gate_up [E, 2I, H] (I gate rows, then I up rows) and down [E, H, I]; the shared expert is passed beside
them as gate_up [2I_s, H] (gate rows, then up rows: `prepare_moe_weights` concatenates the checkpoint's
gate_proj and up_proj once) and down [H, I_s], and the kernels pick its pointers when they meet id E, so I_s
may differ from I. All bf16, contiguous; expert_bias fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lingls.kernels import by_width, by_width_and_tokens, jit, tl, triton, tuned
from lingls.kernels import reference as ref
from lingls.kernels.gemv import MAX_T, accumulate, fma_rows, load_tiles, load_w, rows_after_wait, swiglu_act
from lingls.kernels.pdl import mode as pdl_mode
from lingls.kernels.pdl import wait_previous
from lingls.kernels.shared import INTERPRET, NO_KEY, counters, key_index, key_value, make_key, mma


class MoEWeights(NamedTuple):
    """One MoE layer's tensors in the layout `fused_moe` reads (see the module docstring)."""
    router_w: torch.Tensor  # [E, H] bf16
    expert_bias: torch.Tensor  # [E] fp32
    gate_up: torch.Tensor  # [E, 2I, H] bf16
    down: torch.Tensor  # [E, H, I] bf16
    shared_gate_up: torch.Tensor | None  # [2I_s, H] bf16
    shared_down: torch.Tensor | None  # [H, I_s] bf16


def prepare_moe_weights(router_w, expert_bias, gate_up, down, shared_gate=None, shared_up=None, shared_down=None):
    """Checkpoint tensors -> MoEWeights. Only the shared expert's gate and up (2 x [I_s, H]) are copied."""
    shared_gate_up = None
    if shared_gate is not None:
        shared_gate_up = torch.cat([shared_gate, shared_up], dim=0).contiguous()
        shared_down = shared_down.contiguous()
    return MoEWeights(router_w.contiguous(), expert_bias.float().contiguous(), gate_up.contiguous(),
                      down.contiguous(), shared_gate_up, shared_down)


@jit
def _router_kernel(x_ptr, w_ptr, part_ptr, T, E, H, K_PER,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, FMA: tl.constexpr,
                   USE_PDL: tl.constexpr, F32_DOT: tl.constexpr):
    """Router matvec partials over (block of experts, range of H), as gemv's programs (FMA path at one token):
    part[range, token, expert] in fp32, summed in a fixed order by `_route_token_kernel`."""
    pid_e = tl.program_id(0)
    pid_k = tl.program_id(1)
    rt = tl.arange(0, 16)
    re = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    k_lo = pid_k * K_PER
    acc, _ = rows_after_wait(x_ptr, w_ptr, re, k_lo, T, E, H, H, H, BLOCK_E, BLOCK_K, K_ITERS, False, FMA, USE_PDL,
                              F32_DOT)
    tl.store(part_ptr + pid_k * 16 * E + rt[:, None] * E + re[None, :], acc, mask=(rt[:, None] < T) & (re[None, :] < E))


@jit
def _route_token_kernel(part_ptr, bias_ptr, topk_w_ptr, topk_i_ptr, experts_ptr, wt_ptr, E, scale,
                        SPLIT: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, G: tl.constexpr,
                        G_PAD: tl.constexpr, EPG: tl.constexpr, EPG_PAD: tl.constexpr, E_PAD: tl.constexpr,
                        TOPK_GROUP: tl.constexpr, NORMALIZE: tl.constexpr, HAS_SHARED: tl.constexpr,
                        WRITE_TOPK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program t routes token t alone (a verify step's tokens side by side, not one after another in one
    program) and writes its row of slots; the programs never meet (see the module note)."""
    t = tl.program_id(0)
    gbias, bias = load_bias(bias_ptr, E, G, G_PAD, EPG, EPG_PAD, E_PAD)  # a weight: loaded before waiting
    wait_previous(USE_PDL)
    mine = route_token(part_ptr, gbias, bias, topk_w_ptr, topk_i_ptr, wt_ptr, t, E, scale, SPLIT, TOP_K, K_PAD, G,
                        G_PAD, EPG, EPG_PAD, E_PAD, TOPK_GROUP, NORMALIZE, WRITE_TOPK).to(tl.int32)
    _token_slots(mine, experts_ptr, t, E, TOP_K, E_PAD, HAS_SHARED)


@jit
def _logits(part_ptr, t, e, mask, E, SPLIT: tl.constexpr):
    """Token t's router logits at experts e: the H ranges' partials summed in a fixed order."""
    logits = tl.zeros(e.shape, tl.float32)
    for s in tl.static_range(SPLIT):
        logits += tl.load(part_ptr + s * 16 * E + t * E + e, mask=mask, other=0.0, cache_modifier=".cg")
    return logits


@jit
def load_bias(bias_ptr, E, G: tl.constexpr, G_PAD: tl.constexpr, EPG: tl.constexpr, EPG_PAD: tl.constexpr,
               E_PAD: tl.constexpr):
    """The expert bias in the two layouts `route_token` reads it: [group, expert in group] and flat [E]."""
    rg = tl.arange(0, G_PAD)
    rc = tl.arange(0, EPG_PAD)
    gvalid = (rg[:, None] < G) & (rc[None, :] < EPG)
    re = tl.arange(0, E_PAD)
    return (tl.load(bias_ptr + rg[:, None] * EPG + rc[None, :], mask=gvalid, other=0.0),
            tl.load(bias_ptr + re, mask=re < E, other=0.0))


@jit
def route_token(part_ptr, gbias, bias, topk_w_ptr, topk_i_ptr, wt_ptr, t, E, scale,
                 SPLIT: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                 EPG: tl.constexpr, EPG_PAD: tl.constexpr, E_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 NORMALIZE: tl.constexpr, WRITE_TOPK: tl.constexpr):
    """Grouped top-k routing of token t: sigmoid, group scores (sum of the top-2 of score + bias per group), the
    best TOPK_GROUP groups, the top-k experts of those, weights from the unbiased scores (renormalised,
    scaled). Writes the token's row of the weight table wt[t, e] (0 where not chosen) and, with WRITE_TOPK,
    topk_w/topk_i in selection order. Returns chosen [E_PAD].

    Why this shape: the time is the number of reductions, each a synchronisation of the program's threads.
    The groups are ranked on a [group, expert in group] tile, where a group's scores sit in one row: its best
    two are two row reductions for all groups at once, the ranking one reduction over a [G, G] comparison.
    The k picks run on the flat [E] row, one fp32 max each; when a pick meets two equal values or a NaN (the
    count of chosen experts shows it) they are redone on packed keys (value and lowest index at once), so ties
    go to the lower id either way. Without a tie the program runs ~70% of the instructions it ran with packed
    keys alone (1,016 against 1,424 SASS at flash's shapes, the fallback not counted), and the fp32 picks took
    ~7 us off the 1.44 ms TP=4 step (docs/kernel-log.md). No reshape: one reshaped tile chose experts outside
    the top-k on the H200 (Triton 3.6; its interpreter was right)."""
    rg = tl.arange(0, G_PAD)
    rc = tl.arange(0, EPG_PAD)
    gvalid = (rg[:, None] < G) & (rc[None, :] < EPG)
    gid = rg[:, None] * EPG + rc[None, :]
    re = tl.arange(0, E_PAD)
    valid = re < E
    score = tl.sigmoid(_logits(part_ptr, t, re, valid, E, SPLIT))  # both layouts requested at once
    gchoice = tl.sigmoid(_logits(part_ptr, t, gid, gvalid, E, SPLIT)) + gbias
    gkey = tl.where(gvalid, make_key(gchoice, rc[None, :], EPG_PAD), NO_KEY)
    best1 = tl.max(gkey, axis=1)
    best2 = tl.max(tl.where(gkey == best1[:, None], NO_KEY, gkey), axis=1)  # the best again if it occurs twice
    gscore = tl.where(rg < G, key_value(best1) + key_value(best2), float("-inf"))
    # a group is kept when fewer than TOPK_GROUP groups beat it (ties: the lower group first)
    gcol = tl.max(tl.where(rg[:, None] == rg[None, :], gscore[:, None], float("-inf")), axis=0)  # along columns
    beaten = (gcol[None, :] > gscore[:, None]) | ((gcol[None, :] == gscore[:, None]) & (rg[None, :] < rg[:, None]))
    kept = tl.sum(beaten.to(tl.int32), axis=1) < TOPK_GROUP
    kept_bits = tl.sum(tl.where(kept, 1 << rg, 0), axis=0)  # the kept groups as bits: a G-wide reduction, not E x G
    kept_e = ((kept_bits >> (re // EPG)) & 1) != 0
    choice = score + bias
    live = valid & kept_e
    kc = tl.arange(0, K_PAD)
    # the k picks on fp32 values, half the work of packed keys per reduction; exact unless a pick hits two equal
    # values or a NaN is among the candidates (NaNs are counted as chosen here), which the count shows: then
    # they are redone on (value, index) keys, ties to the lower id, NaN above every number
    vals = tl.where(live, choice, float("-inf"))
    chosen = vals != vals
    for k in tl.static_range(TOP_K):
        top = tl.max(vals, axis=0)
        hit = vals == top
        chosen = chosen | hit
        vals = tl.where(hit, float("-inf"), vals)
    ids = tl.zeros((K_PAD,), tl.int32)
    if tl.sum(chosen.to(tl.int32), axis=0) != TOP_K:
        chosen, ids = _pick_keys(tl.where(live, make_key(choice, re, E_PAD), NO_KEY), ids, kc, TOP_K, E_PAD)
    elif WRITE_TOPK:  # selection order, for callers that ask: the chosen keys picked again
        _, ids = _pick_keys(tl.where(chosen, make_key(choice, re, E_PAD), NO_KEY), ids, kc, TOP_K, E_PAD)
    weights = tl.where(chosen, score, 0.0)
    mult = scale / (tl.sum(weights, axis=0) + 1e-20) if NORMALIZE else scale
    tl.store(wt_ptr + t * E + re, weights * mult, mask=valid)
    if WRITE_TOPK:  # selection order, for callers that ask (tests, benchmarks); the expert kernels read wt
        kmask = kc < TOP_K
        vals = tl.sum(tl.where((ids[:, None] == re[None, :]) & kmask[:, None], score[None, :], 0.0), axis=1)
        tl.store(topk_w_ptr + t * TOP_K + kc, vals * mult, mask=kmask)
        tl.store(topk_i_ptr + t * TOP_K + kc, ids, mask=kmask)
    return chosen


@jit
def _pick_keys(left, ids, kc, TOP_K: tl.constexpr, E_PAD: tl.constexpr):
    """The TOP_K largest packed keys of `left`, one max each: (chosen [E_PAD], their ids in selection order)."""
    chosen = left != left  # all false
    for k in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        hit = left == best
        chosen = chosen | hit
        left = tl.where(hit, NO_KEY, left)
        ids = tl.where(kc == k, key_index(best, E_PAD), ids)
    return chosen, ids


@jit
def _token_slots(chosen, experts_ptr, t, E, TOP_K: tl.constexpr, E_PAD: tl.constexpr, HAS_SHARED: tl.constexpr):
    """Token t's row of slots: the TOP_K experts it chose (chosen [E_PAD], 0 or 1; `route_token` always
    chooses exactly TOP_K) in ascending id order, at slots HAS_SHARED + t * TOP_K + j; the shared expert
    (id E) in slot 0."""
    re = tl.arange(0, E_PAD)
    chosen = tl.where(re < E, chosen, 0)
    j = tl.cumsum(chosen, axis=0) - chosen
    tl.store(experts_ptr + HAS_SHARED + t * TOP_K + j, re, mask=chosen > 0)
    if HAS_SHARED:
        if t == 0:
            tl.store(experts_ptr, E)


@jit
def _lowest_holder(experts_ptr, d, e, SLOT0: tl.constexpr, TOP_K: tl.constexpr, D_PAD: tl.constexpr):
    """Slot d's expert e, or -1 where a lower token's row of slots (SLOT0 is the first row's first slot) holds
    e too: each distinct expert is streamed once, by the lowest token that chose it. The rows below are read
    with no dependence on e, so their load goes out with the slot's own."""
    rd = tl.arange(0, D_PAD)
    below = tl.load(experts_ptr + SLOT0 + rd, mask=rd < ((d - SLOT0) // TOP_K) * TOP_K, other=-1,
                    cache_modifier=".cg")
    return tl.where(tl.max((below == e).to(tl.int32), axis=0) > 0, -1, e)


@jit
def _gate_up_kernel(x_ptr, gu_ptr, sgu_ptr, experts_ptr, owned_ptr, wt_ptr, act_ptr, part_ptr, cnt_ptr,
                    T, H, E, INTER, I_S, K_PER, limit, shared_limit,
                    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, I_PAD: tl.constexpr,
                    SPLIT_K: tl.constexpr, FMA: tl.constexpr, USE_PDL: tl.constexpr, F32_DOT: tl.constexpr,
                    EARLY_SHARED: tl.constexpr, DEDUP: tl.constexpr, TOP_K: tl.constexpr, D_PAD: tl.constexpr):
    """Program (slot, block of I, range of H), gemv's loop over [gate; up] rows (FMA path at one token). With
    SPLIT_K > 1 the H ranges of a (slot, block) publish fp32 partials of gate and up and the last to arrive sums
    them in a fixed order before the SwiGLU: a decode step's 9 experts x (I / BLOCK_I) blocks are too few
    programs to keep every SM streaming otherwise.

    EARLY_SHARED (under PDL, with a shared expert in slot 0): slot 0's programs need no routing, and x was
    written three launches back (complete once the router passed its own wait: the routing lets this kernel
    launch only after its own wait, `pdl.LATE`), so they run while the tokens are routed and wait only at the
    end. The programs let the down kernel launch only after their wait (LATE whatever USE_PDL says): it reads
    the routing's slots before its own wait.

    DEDUP (several tokens): a slot whose expert a lower token's row holds exits (`_lowest_holder`), and the
    slot's first program writes what the slot became (its expert or -1) to owned_ptr, for the down kernel."""
    d = tl.program_id(0)
    ib = tl.program_id(1)
    ks = tl.program_id(2)
    if USE_PDL:
        if not EARLY_SHARED or d != 0:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
    if EARLY_SHARED:
        e = tl.load(experts_ptr + d, mask=d != 0, other=E)
    else:
        e = tl.load(experts_ptr + d)
    if DEDUP:  # the rows start past slot 0 when the shared expert holds it (EARLY_SHARED says it does)
        e = _lowest_holder(experts_ptr, d, e, 1 if EARLY_SHARED else 0, TOP_K, D_PAD)
        if (ib == 0) & (ks == 0):
            tl.store(owned_ptr + d, e)
    if e >= 0:
        shared = e == E
        inter = tl.where(shared, I_S, INTER)
        if ib * BLOCK_I < inter:
            base = tl.where(shared, sgu_ptr, gu_ptr + e.to(tl.int64) * (2 * INTER * H))
            rt = tl.arange(0, 16)
            ri = ib * BLOCK_I + tl.arange(0, BLOCK_I)
            rk = tl.arange(0, BLOCK_K)
            k_lo = ks * K_PER
            if FMA:  # one token: the program's rows over its whole H range requested at once
                tiles = load_tiles(base, ri, k_lo, inter, H, H, BLOCK_K, K_ITERS, True)
                acc_g, acc_u = fma_rows(x_ptr, tiles, ri, k_lo, H, BLOCK_I, BLOCK_K, K_ITERS, True)
            else:
                acc_g = tl.zeros((16, BLOCK_I), tl.float32)
                acc_u = tl.zeros((16, BLOCK_I), tl.float32)
                # gemv's `_dot_rows` loop, but loading every tile inside it: the expert is known only after the
                # wait, so no first tile can be requested early, and the peeled form holds 44 registers more
                for i in range(0, K_ITERS):
                    kk = k_lo + i * BLOCK_K + rk
                    wg, wu = load_w(base, ri, kk, inter, H, H, True)
                    acc_g, acc_u = accumulate(acc_g, acc_u, x_ptr, wg, wu, rt, kk, T, H, H, True, F32_DOT)
            lim = tl.where(shared, shared_limit, limit)
            if SPLIT_K > 1:
                pofs = rt[:, None] * I_PAD + ri[None, :]
                pmask = (rt[:, None] < T) & (ri[None, :] < inter)
                part = part_ptr + (ks * tl.num_programs(0) + d) * (2 * 16 * I_PAD)
                tl.store(part + pofs, acc_g, mask=pmask)
                tl.store(part + 16 * I_PAD + pofs, acc_u, mask=pmask)
                tl.debug_barrier()
                block = d * tl.num_programs(1) + ib
                arrived = tl.atomic_add(cnt_ptr + block, 1, sem="acq_rel")
                if arrived == SPLIT_K - 1:
                    acc_g = tl.zeros((16, BLOCK_I), tl.float32)
                    acc_u = tl.zeros((16, BLOCK_I), tl.float32)
                    for s in tl.static_range(SPLIT_K):
                        part = part_ptr + (s * tl.num_programs(0) + d) * (2 * 16 * I_PAD)
                        acc_g += tl.load(part + pofs, mask=pmask, other=0.0, cache_modifier=".cg")
                        acc_u += tl.load(part + 16 * I_PAD + pofs, mask=pmask, other=0.0, cache_modifier=".cg")
                    tl.atomic_xchg(cnt_ptr + block, 0)
                    _gate_up_epilogue(acc_g, acc_u, lim, wt_ptr, act_ptr, d, e, shared, inter, rt, ri, T, E, I_PAD)
            else:
                _gate_up_epilogue(acc_g, acc_u, lim, wt_ptr, act_ptr, d, e, shared, inter, rt, ri, T, E, I_PAD)
    if USE_PDL and EARLY_SHARED:
        if d == 0:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


@jit
def _gate_up_epilogue(acc_g, acc_u, limit, wt_ptr, act_ptr, d, e, shared, inter, rt, ri, T, E, I_PAD: tl.constexpr):
    act = swiglu_act(acc_g, acc_u, limit)
    w = tl.load(wt_ptr + rt * E + e, mask=(rt < T) & (e < E), other=0.0)
    w = tl.where(shared & (rt < T), 1.0, w)
    act = tl.where(w[:, None] != 0.0, act, 0.0)  # tokens that did not choose this expert contribute 0
    tl.store(act_ptr + d * (16 * I_PAD) + rt[:, None] * I_PAD + ri[None, :], act.to(act_ptr.dtype.element_ty),
             mask=(rt[:, None] < T) & (ri[None, :] < inter))


@jit
def _down_kernel(act_ptr, dn_ptr, sdn_ptr, experts_ptr, owned_ptr, wt_ptr, out_ptr, res_ptr, part_ptr, cnt_ptr,
                 T, H, E, INTER, I_S, D_MAX,
                 D_PER: tl.constexpr, D_PER_PAD: tl.constexpr, SPLIT_D: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_I: tl.constexpr, I_CHUNKS: tl.constexpr, I_PAD: tl.constexpr, HAS_RES: tl.constexpr,
                 FMA: tl.constexpr, AHEAD: tl.constexpr, DEDUP: tl.constexpr, USE_PDL: tl.constexpr,
                 F32_DOT: tl.constexpr):
    """Program (block of H, share of the slots): slots sd, sd + SPLIT_D, ... With SPLIT_D > 1 each program
    publishes an fp32 partial and the last to arrive for its block of H sums them in a fixed order (as gemv's
    split-K), so a verify step's ~70 experts are walked by SPLIT_D programs side by side, not one after another.

    The first slot's expert, routing weights and down rows are read before the wait: the routing that wrote
    the slots ran two launches back, and under PDL this kernel starts only after every gate-up program passed
    its own wait for it, so they are complete here (read past L1, which may hold an earlier layer's);
    only the activations come from the kernel just before. At one token that is all of a program's weights.
    The later slots load inside the loop, which Triton pipelines (requesting the next expert's rows by hand,
    two tiles in registers, was 20-40% slower at T=9 on an H200: bench/results/tune_t9_moe_tp4.json).
    An expert's I columns are read in I_CHUNKS chunks of BLOCK_I: one loop over (slot, chunk), so the tile in
    flight stays small and no padding past I is held (TP=2's I = 384 pads to 512 in one chunk).
    AHEAD (one token): every (slot, chunk) tile of the program is requested before the wait, none after it.
    DEDUP (several tokens): after the wait the slots are read from owned_ptr, where the gate-up kernel marked
    the duplicates -1 (the first slot's rows, requested early for the routing's expert, then count only if the
    slot kept it). All of a program's slot ids are read at once (D_PER_PAD lanes), so no weight load in the
    loop waits on an id load: Triton's pipeliner then gives the loop two buffers, where an id read inside
    it left one (the verify step's down kernel at TP=4 with 64-column chunks: ~1,048 -> ~1,031 us per step)."""
    hb = tl.program_id(0)
    sd = tl.program_id(1)
    rh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    ri = tl.arange(0, BLOCK_I)
    rt = tl.arange(0, 16)
    acc = tl.zeros((16, BLOCK_H), tl.float32)
    acc2 = tl.zeros((BLOCK_H, BLOCK_I), tl.float32)  # FMA path (one token): weighted products, reduced at the end
    if AHEAD:
        tiles = ()  # (slot, chunk) tiles in slot-major order, each with its slot's expert id
        for slot in tl.static_range(D_PER):
            d = sd + slot * SPLIT_D
            e = tl.load(experts_ptr + d, mask=d < D_MAX, other=-1, cache_modifier=".cg")
            for c in tl.static_range(I_CHUNKS):
                tiles = tiles + ((e,) + _down_rows(dn_ptr, sdn_ptr, wt_ptr, e, rh, c * BLOCK_I + ri, rt, T, H, E, INTER,
                                                   I_S),)
        wait_previous(USE_PDL)
        for it in tl.static_range(D_PER * I_CHUNKS):
            e, wt, w, inter = tiles[it]
            acc, acc2 = _down_accumulate(acc, acc2, act_ptr, sd + (it // I_CHUNKS) * SPLIT_D, e, wt, w, inter,
                                         (it % I_CHUNKS) * BLOCK_I + ri, rt, T, I_PAD, FMA, F32_DOT)
    else:
        e = tl.load(experts_ptr + sd, mask=sd < D_MAX, other=-1, cache_modifier=".cg")
        wt, w, inter = _down_rows(dn_ptr, sdn_ptr, wt_ptr, e, rh, ri, rt, T, H, E, INTER, I_S)
        wait_previous(USE_PDL)
        rs = tl.arange(0, D_PER_PAD)
        slots = sd + rs * SPLIT_D
        owned = tl.load(owned_ptr + slots, mask=(rs < D_PER) & (slots < D_MAX), other=-1)
        if DEDUP:
            e = tl.sum(tl.where(rs == 0, owned, 0))
        acc, acc2 = _down_accumulate(acc, acc2, act_ptr, sd, e, wt, w, inter, ri, rt, T, I_PAD, FMA, F32_DOT)
        for it in range(1, D_PER * I_CHUNKS):  # unused slots (-1, or past D_MAX) are masked off: no memory traffic
            d = sd + (it // I_CHUNKS) * SPLIT_D
            rc = (it % I_CHUNKS) * BLOCK_I + ri
            e = tl.sum(tl.where(rs == it // I_CHUNKS, owned, 0))
            wt, w, inter = _down_rows(dn_ptr, sdn_ptr, wt_ptr, e, rh, rc, rt, T, H, E, INTER, I_S)
            acc, acc2 = _down_accumulate(acc, acc2, act_ptr, d, e, wt, w, inter, rc, rt, T, I_PAD, FMA, F32_DOT)
    if FMA:
        acc = tl.zeros((16, BLOCK_H), tl.float32) + tl.sum(acc2, axis=1)[None, :]
    mask = (rt[:, None] < T) & (rh[None, :] < H)
    if SPLIT_D > 1:
        pofs = rt[:, None] * H + rh[None, :]
        tl.store(part_ptr + sd * 16 * H + pofs, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + hb, 1, sem="acq_rel")
        if arrived == SPLIT_D - 1:
            acc = tl.zeros((16, BLOCK_H), tl.float32)
            for s in tl.static_range(SPLIT_D):
                acc += tl.load(part_ptr + s * 16 * H + pofs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + hb, 0)
            _down_epilogue(acc, out_ptr, res_ptr, rt, rh, mask, H, HAS_RES)
    else:
        _down_epilogue(acc, out_ptr, res_ptr, rt, rh, mask, H, HAS_RES)


@jit
def _down_rows(dn_ptr, sdn_ptr, wt_ptr, e, rh, ri, rt, T, H, E, INTER, I_S):
    """Expert e's (-1: none) down rows rh at columns ri [BLOCK_H, BLOCK_I] and the tokens' weights for it [16]
    (the shared expert weighs 1), and its width."""
    live = e >= 0
    shared = e == E
    inter = tl.where(shared, I_S, INTER)
    base = tl.where(shared, sdn_ptr, dn_ptr + e.to(tl.int64) * (H * INTER))
    wt = tl.load(base + rh[:, None] * inter + ri[None, :], mask=live & (rh[:, None] < H) & (ri[None, :] < inter),
                 other=0.0)
    w = tl.load(wt_ptr + rt * E + e, mask=live & (rt < T) & (e < E), other=0.0, cache_modifier=".cg")
    return wt, tl.where(live & shared & (rt < T), 1.0, w), inter


@jit
def _down_accumulate(acc, acc2, act_ptr, d, e, wt, w, inter, ri, rt, T, I_PAD: tl.constexpr, FMA: tl.constexpr,
                     F32_DOT: tl.constexpr):
    """Slot d's share of the weighted sum: its tokens' activations through the rows wt, times their weights w."""
    live = e >= 0
    if FMA:
        a = tl.load(act_ptr + d * (16 * I_PAD) + ri, mask=live & (ri < inter), other=0.0).to(tl.float32)
        acc2 += wt * (a * tl.sum(w, axis=0))[None, :]  # one token: w's only nonzero entry
    else:
        a = tl.load(act_ptr + d * (16 * I_PAD) + rt[:, None] * I_PAD + ri[None, :],
                    mask=live & (rt[:, None] < T) & (ri[None, :] < inter), other=0.0)
        acc += mma(tl.zeros(acc.shape, tl.float32), a, tl.trans(wt), F32_DOT) * w[:, None]
    return acc, acc2


@jit
def _down_epilogue(acc, out_ptr, res_ptr, rt, rh, mask, H, HAS_RES: tl.constexpr):
    if HAS_RES:
        acc += tl.load(res_ptr + rt[:, None] * H + rh[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rt[:, None] * H + rh[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# Launch knobs by each expert's rows per rank (192: TP=4, 384: TP=2), then by the step's token count (the
# smallest key >= T applies), from tuned.json: router programs over experts and over H (each streaming
# router_block_k columns at a time) and its warps, the routing's warps, gate-up rows per program, H tile, H ranges
# (split-K) and FMA path, down rows per program, slot shares, FMA path, I columns per chunk (default all) and, at
# one token, whether a program requests all its (slot, chunk) tiles before the wait (dn_ahead).
CONFIGS = by_width(tuned("moe"))


def config_for(t: int, rows: int = 192) -> dict:
    return by_width_and_tokens(CONFIGS, rows, t)


def _h_ranges(h: int, split: int, block_k: int) -> tuple[int, int]:
    """(columns per range, ranges): `split` ranges of whole block_k tiles covering h columns."""
    k_per = triton.cdiv(triton.cdiv(h, split), block_k) * block_k
    return k_per, triton.cdiv(h, k_per)


def fused_moe(x, router_w, expert_bias, gate_up, down, shared_gate_up=None, shared_down=None, *, top_k: int,
              n_group: int, topk_group: int, normalize: bool, scale: float, limit: float = 0.0,
              shared_limit: float = 0.0, residual: torch.Tensor | None = None, return_routing: bool = False,
              pdl: bool = False, **knobs):
    """MoE of T <= 16 tokens in four launches, nothing read back to the host.

    x: [T, H] bf16; the weights as in `MoEWeights`; residual: [T, H] or None (added to the output).
    Returns out [T, H] in x's dtype (routed sum + shared expert, + residual), and with return_routing also
    (topk_w [T, top_k] fp32, topk_i [T, top_k] int32), the routing in selection order.
    knobs: launch settings overriding `CONFIGS` (router_block_e, router_block_k, router_split, router_warps,
    route_warps, block_i, gu_block_k, gu_split (H ranges per gate-up block), gu_warps, gu_fma, block_h, split_d,
    dn_warps, dn_fma, dn_block_i (down's I columns per chunk, 0 or absent: all), dn_ahead; the FMA paths apply at
    T=1 only),
    for the tuning benchmark.
    pdl: programmatic dependent launch (CUDA): every launch overlaps the previous kernel's tail (the router's
    first weight tile is requested before it waits).
    """
    t, h = x.shape
    k = {**config_for(t, down.shape[2]), **knobs}
    e = router_w.shape[0]
    i = down.shape[2]
    assert 1 <= t <= MAX_T and x.is_contiguous() and e % n_group == 0 and n_group <= 16  # groups as bits
    assert top_k <= topk_group * (e // n_group), "top_k must fit in the kept groups (each token fills its k slots)"
    has_shared = shared_gate_up is not None
    i_s = shared_down.shape[1] if has_shared else 0
    d_max = t * top_k + int(has_shared)  # slot 0: the shared expert; then a row of top_k slots per token
    i_pad = triton.next_power_of_2(max(i, i_s))
    dev = x.device
    out = torch.empty_like(x)
    topk_w = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    topk_i = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    experts = torch.empty(d_max, dtype=torch.int32, device=dev)  # the slots: expert ids, as routed
    dedup = t > 1  # one token's experts are distinct
    owned = torch.empty(d_max, dtype=torch.int32, device=dev) if dedup else experts  # duplicates marked -1
    wt = torch.empty(t, e, dtype=torch.float32, device=dev)  # each token's weight per expert (0: not chosen)
    act = torch.empty(d_max, 16, i_pad, dtype=x.dtype, device=dev)

    pdl = pdl and x.is_cuda  # programmatic dependent launch: each launch overlaps the previous kernel's tail
    launch = {"launch_pdl": True} if pdl else {}
    router_block_e, router_block_k = k["router_block_e"], k["router_block_k"]
    k_per, split = _h_ranges(h, k["router_split"], router_block_k)
    part = torch.empty(split, 16, e, dtype=torch.float32, device=dev)
    epg = e // n_group
    routing = dict(TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), G=n_group, G_PAD=triton.next_power_of_2(n_group),
                   EPG=epg, EPG_PAD=triton.next_power_of_2(epg), E_PAD=triton.next_power_of_2(e),
                   TOPK_GROUP=topk_group, NORMALIZE=normalize, HAS_SHARED=has_shared, WRITE_TOPK=return_routing)
    _router_kernel[(triton.cdiv(e, router_block_e), split)](
        x, router_w, part, t, e, h, k_per, BLOCK_E=router_block_e, BLOCK_K=router_block_k,
        K_ITERS=k_per // router_block_k, FMA=t == 1, USE_PDL=pdl_mode(pdl, "router", t), F32_DOT=INTERPRET,
        num_warps=k["router_warps"], **launch)
    _route_token_kernel[(t,)](part, expert_bias, topk_w, topk_i, experts, wt, e, float(scale), SPLIT=split,
                              USE_PDL=pdl_mode(pdl, "route", t), num_warps=k["route_warps"], **routing, **launch)
    sgu = shared_gate_up if has_shared else gate_up
    sdn = shared_down if has_shared else down
    gu_block_k = k["gu_block_k"]
    gu_k_per, gu_split = _h_ranges(h, k["gu_split"], gu_block_k)
    i_blocks = triton.cdiv(max(i, i_s), k["block_i"])
    gu_part = torch.empty(gu_split * d_max * 2 * 16 * i_pad if gu_split > 1 else 1, dtype=torch.float32, device=dev)
    block_h = k["block_h"]
    h_blocks = triton.cdiv(h, block_h)
    gu_cnt = counters(dev, h_blocks + d_max * i_blocks)[h_blocks:]  # past the down kernel's, which may overlap
    _gate_up_kernel[(d_max, i_blocks, gu_split)](
        x, gate_up, sgu, experts, owned, wt, act, gu_part, gu_cnt, t, h, e, i, i_s, gu_k_per,
        float(limit), float(shared_limit), BLOCK_I=k["block_i"], BLOCK_K=gu_block_k, K_ITERS=gu_k_per // gu_block_k,
        I_PAD=i_pad, SPLIT_K=gu_split, FMA=t == 1 and k["gu_fma"], USE_PDL=pdl_mode(pdl, "gate_up", t),
        F32_DOT=INTERPRET, EARLY_SHARED=has_shared, DEDUP=dedup, TOP_K=top_k, D_PAD=triton.next_power_of_2(d_max),
        num_warps=k["gu_warps"], num_stages=3, **launch)
    split_d = max(1, min(k["split_d"], d_max))
    dn_block_i = min(max(k.get("dn_block_i") or i_pad, 16), i_pad)  # I columns per chunk (0: all; tl.dot: >= 16)
    down_part = torch.empty(split_d * 16 * h if split_d > 1 else 1, dtype=torch.float32, device=dev)
    _down_kernel[(h_blocks, split_d)](
        act, down, sdn, experts, owned, wt, out, residual if residual is not None else out, down_part,
        counters(dev, h_blocks), t, h, e, i, i_s, d_max, D_PER=triton.cdiv(d_max, split_d),
        D_PER_PAD=triton.next_power_of_2(triton.cdiv(d_max, split_d)), SPLIT_D=split_d,
        BLOCK_H=block_h, BLOCK_I=dn_block_i, I_CHUNKS=triton.cdiv(max(i, i_s), dn_block_i), I_PAD=i_pad,
        HAS_RES=residual is not None, FMA=t == 1 and k["dn_fma"],
        AHEAD=t == 1 and k["dn_fma"] and k.get("dn_ahead", False), DEDUP=dedup,
        USE_PDL=pdl_mode(pdl, "down", t), F32_DOT=INTERPRET, num_warps=k["dn_warps"], num_stages=3, **launch)
    if return_routing:
        return out, topk_w, topk_i
    return out


def fused_moe_reference(x, router_w, expert_bias, gate_up, down, shared_gate_up=None, shared_down=None, *,
                        top_k: int, n_group: int, topk_group: int, normalize: bool, scale: float, limit: float = 0.0,
                        shared_limit: float = 0.0, residual: torch.Tensor | None = None, return_routing: bool = False,
                        routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                        compute_dtype: torch.dtype = torch.float32):
    """The definition, in plain torch: fp32 router logits, `reference.route_grouped_topk`, then per token the
    chosen experts' SwiGLU MLPs weighted and summed, plus the shared expert, one rounding at the end.

    `routing` = (weights, indices) replaces the router's choice (tests feed the kernel's routing here, so a
    near-tie decided differently by a different summation order does not hide the experts' arithmetic).
    `compute_dtype` bf16 gives the model's eager path (for benchmarks); fp32 is the definition.
    """
    n_in = x.shape[0]
    if routing is None:
        logits = x.float() @ router_w.float().t()
        routing = ref.route_grouped_topk(logits, expert_bias, top_k, n_group, topk_group, normalize, scale)
    w, idx = routing
    idx = idx.long()
    inter = down.shape[2]
    xc = x.to(compute_dtype)
    gu = torch.einsum("nh,nkoh->nko", xc, gate_up[idx].to(compute_dtype))
    a = ref.swiglu(gu[..., :inter], gu[..., inter:], limit)
    y = torch.einsum("nki,nkhi->nkh", a, down[idx].to(compute_dtype))
    out = (y.float() * w.float().unsqueeze(-1)).sum(1)
    if shared_gate_up is not None:
        i_s = shared_down.shape[1]
        sgu = xc @ shared_gate_up.to(compute_dtype).t()
        out = out + (ref.swiglu(sgu[:, :i_s], sgu[:, i_s:], shared_limit) @ shared_down.to(compute_dtype).t()).float()
    if residual is not None:
        out = out + residual.float()
    out = out.to(x.dtype).view(n_in, -1)
    if return_routing:
        return out, w, idx
    return out


def moe(x: torch.Tensor, weights: MoEWeights, **cfg) -> torch.Tensor:
    """Dispatcher: the fused kernels for CUDA tensors with at most 16 tokens, the reference otherwise.
    cfg: top_k, n_group, topk_group, normalize, scale, limit, shared_limit (and optionally residual)."""
    if x.is_cuda and x.shape[0] <= MAX_T:
        return fused_moe(x, *weights, **cfg)
    return fused_moe_reference(x, *weights, **cfg)
