"""Routed experts of a long step (a prefill): two grouped GEMMs over the (token, expert) pairs sorted by expert.

The pairs are laid out by expert, each expert's run padded to a multiple of BLOCK_M rows, in a buffer whose size
is an upper bound known on the host (N*k + E*(BLOCK_M - 1) rows): the launch grids are fixed by that bound (or
by the expert count) and no count is read back.
- `_grouped_gate_up_whole_kernel`: a program takes one block of an expert's run and all of its act columns
  (`"whole_block"`): act = swiglu(x Wg^T, x Wu^T) of its rows, the x rows gathered by token, gate and up of a column
  in the same program (the checkpoint's [gate; up] stacking), Ling's optional clamp in the epilogue;
- `_grouped_down_whole_kernel`: a program takes one block and all of H (`"whole_block"`): it loads the block's act
  rows once and keeps them while it streams its expert's down weight BLOCK_N rows at a time in one pipelined loop,
  y = act Wd^T written to each pair's own row (token-major, [N*k, H]), so the weighted sum over a token's k experts
  is a plain reduction afterwards, in a fixed order;
(named apart from the fused decode step's `_gate_up_kernel` and `_down_kernel`, so a profile tells them apart);
- `_combine_kernel`: that reduction, sum_j w_j * y_j in fp32 rounded once, in one pass over y (torch's upcast,
  multiply and sum wrote and read fp32 copies of y: ~2 GB a layer at 8,192 tokens).
Before them, two steps that were a few dozen small torch ops per layer (each a launch and a pass over memory):
- `route`: the router's grouped top-k (`reference.route_grouped_topk`) as one program per token;
- `sort_pairs_triton`: the pairs laid out by expert in four launches (counts by atomics, the padded offsets, the
  scatter, each block's expert), where `sort_pairs` (the torch form) sorts them. A pair's place inside its
  expert's run differs between the two, which changes nothing a pair computes: each output row of a block's
  product is its own row's dot products, in the same order.
Products round to bf16 where torch's grouped GEMM rounds them (gate and up before the activation, y before the
routing weight), so the kernels compute what `moe_prefill_reference` computes.

Where a short prompt touches every expert (1,536 tokens x 8 of 512), the whole expert shard crosses HBM once per
layer: ~1.5 GB at a TP=4 rank of Ling-3.0-flash, which bounds a layer at ~0.37 ms whatever the arithmetic.

The forms (`FORM` for gate/up, `DOWN_FORM` for down; each a setting `lingls bench prefix --variants` times in place).
At a TP=4 rank (H 2,560, INTER 192, 512 experts) an 8,192-token prefill gives each expert ~128 pairs, 2-3 blocks of
64 rows, and its expert weights are 1.5 GB a layer: the kernels are bound by bytes, so what matters is that each
weight and each gathered x row crosses HBM once, with enough loads in flight.
- gate/up by whole blocks (runs): a block's 3 column tiles of gate and of up in one K loop (6 accumulators of 64 x
  64 fp32), so its gathered x rows are read once; the block form (`"by_block"`, `_grouped_gate_up_kernel`: a
  program per block and column tile) read them once per tile, the tiles ~1,500 programs apart in launch order,
  after ~1 GB of weights had passed through the 50 MB L2. The same K steps in the same order: the same bits.
  Alone (one H100, 8,192 tokens; the weights' byte time 342 us at 2.94 TB/s): the block form 588 us, whole blocks
  at (BLOCK_K, warps, stages) (64, 8, 3) 536, (64, 8, 2) 508, **(64, 4, 2) 491** (two programs an SM), (32, 8, 4)
  747, (128, 8, 2) 636; a program per expert and column tile walking the expert's run (the by-expert gate/up
  form, since removed) 685. In place, bit-identical, the whole cold prefill at 512 / 1,536 / 4,096 / 8,192 tokens:
  33.6 / 39.5 / 57.7 / 90.5 ms against the block form's 33.3 / 39.7 / 59.1 / 93.7.
- down by whole blocks: a program streams its expert's down weight over all of H (40 tiles of 64 at a TP=4 rank)
  with the next tiles' loads in flight, its act rows loaded once. The form before it, a program per (column tile,
  expert) holding that tile of the weight and walking the expert's 2-3 blocks (`"by_expert"`, since removed), read
  the weights once too, with fewer loads in flight; the block form (`_grouped_down_kernel`, `"by_block"`) takes a
  program per block and column tile. All three give the same bits (the
  same K chunks in the same order). Alone (one H100, 8,192 tokens): by expert 435 us (1.52x its bytes: weights and
  the pairs' rows it writes). In place, the whole cold prefill at 512 / 1,536 / 4,096 / 8,192 tokens (one H100,
  bit-identical): whole blocks at (BLOCK_N, warps, stages) **(64, 4, 3)** 32.1 / 37.9 / 55.7 / 87.4 ms, (128, 4, 2)
  32.9 / 38.8 / 57.6 / 92.9, by expert 33.6 / 39.6 / 57.8 / 90.7; by expert against the block form 16.3 against
  20.6 ms of down kernels at 8,192 tokens (the session before).
  The block form's kernels remain for wider experts (down: INTER > 256, gate/up: INTER > 4 x 64).
"""

from __future__ import annotations

import torch

from lingls.kernels import jit, tl, triton
from lingls.kernels import reference as ref

BLOCK_M = 64  # rows of one expert per program: the pairs of an expert are padded to a multiple of this
GATE_UP_FORMS = ("whole_block", "by_block")  # the module note says what each is
DOWN_FORMS = ("whole_block", "by_block")
# the kernels' forms (module note): gate/up's and down's; the prefill graphs bake in the forms they were captured with
FORM = "whole_block"
DOWN_FORM = "whole_block"
# warps of a token's routing program (`route`): one keeps its eight argmax reductions inside a warp (no shared
# memory, no barrier); a cold 8,192-token prefill of a TP=4 rank on an H100 took 96.1 / 96.5 / 97.1 ms with 1 / 2 / 4,
# bit-identical (`lingls bench prefix --variants`)
ROUTE_WARPS = 1
# both kernels' forms before the whole-block forms (`lingls bench prefix --previous` times them on a runner of its own)
PREVIOUS = {"FORM": "by_block", "DOWN_FORM": "by_block"}


def moe_prefill_reference(x, weights, idx, gate_up, down, inter: int, limit: float = 0.0):
    """The definition: sum over each token's chosen experts of weight * down(swiglu(gate x, up x)), every
    product summed in fp32 and rounded to x's dtype (as a GPU's GEMM does). x [N, H]; weights, idx [N, k];
    gate_up [E, 2I, H]; down [E, H, I]."""
    gu = torch.einsum("nh,nkoh->nko", x.float(), gate_up[idx].float()).to(x.dtype)
    act = ref.swiglu(gu[..., :inter], gu[..., inter:], limit)
    y = torch.einsum("nki,nkhi->nkh", act.float(), down[idx].float()).to(x.dtype)
    return (y.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def sort_pairs(idx: torch.Tensor, n_experts: int, block_m: int = BLOCK_M):
    """The (token, slot) pairs grouped by expert, each expert's run padded to whole blocks, on the device only.

    Returns (rows [R] int32: the pair index t*k + slot at each padded row, -1 in padding; block_expert [R / block_m]
    int32: the expert of each block, n_experts past the last run), R = N*k + E*(block_m - 1) rounded up to blocks."""
    flat = idx.flatten()
    pairs = flat.numel()
    blocks = -(-(pairs + n_experts * (block_m - 1)) // block_m)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=idx.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # not bincount: CUDA's reads the max back to the host
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # each expert's first pair in the sorted order
    order = flat.argsort(stable=True)
    expert = flat[order]
    dest = (padded_end - padded)[expert] + torch.arange(pairs, device=idx.device) - first[expert]
    rows = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=idx.device)
    rows[dest] = order.to(torch.int32)
    starts = torch.arange(blocks, device=idx.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return rows, block_expert


def route(logits, bias, top_k: int, n_group: int, topk_group: int, normalize: bool, scale: float):
    """`reference.route_grouped_topk` of [N, E] fp32 logits: one Triton program per token on CUDA (or under the
    interpreter) where E and the group size are powers of two, the torch form otherwise. The choice is the
    reference's (ties aside: exact ties of sigmoid scores do not occur in practice); the weights agree to fp32
    rounding."""
    n, e = logits.shape
    epg = e // n_group
    if triton is None or (not logits.is_cuda and not _interpreting()) or e & (e - 1) or epg & (epg - 1):
        return ref.route_grouped_topk(logits, bias, top_k, n_group, topk_group, normalize, scale)
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    _route_kernel[(n,)](logits.contiguous(), bias.float().contiguous(), weights, idx, float(scale), E=e, G=n_group,
                        TOPK_GROUP=topk_group, TOP_K=top_k, TOPK_PAD=triton.next_power_of_2(top_k),
                        NORMALIZE=normalize, num_warps=ROUTE_WARPS)
    return weights, idx


def sort_pairs_triton(idx: torch.Tensor, n_experts: int, block_m: int = BLOCK_M):
    """`sort_pairs` in four launches (Triton): the counts by atomics, the padded offsets, the scatter, each block's
    expert. The same block layout and block experts; each expert's pairs in its run in the order their atomic
    increments landed (see the module note: that order changes no result)."""
    flat = idx.flatten()
    pairs = flat.numel()
    blocks = -(-(pairs + n_experts * (block_m - 1)) // block_m)
    counts = torch.zeros(n_experts, dtype=torch.int32, device=idx.device)
    slot = torch.empty(pairs, dtype=torch.int32, device=idx.device)
    _count_kernel[(triton.cdiv(pairs, 1024),)](flat, counts, slot, pairs, BLOCK=1024, num_warps=4)
    start = torch.empty(n_experts, dtype=torch.int32, device=idx.device)
    padded_end = torch.empty(n_experts, dtype=torch.int32, device=idx.device)
    e_pad = triton.next_power_of_2(n_experts)
    _offsets_kernel[(1,)](counts, start, padded_end, E=n_experts, E_PAD=e_pad, BLOCK_M=block_m, num_warps=4)
    rows = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=idx.device)
    _scatter_kernel[(triton.cdiv(pairs, 1024),)](flat, slot, start, rows, pairs, BLOCK=1024, num_warps=4)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=idx.device)
    _block_expert_kernel[(triton.cdiv(blocks, 32),)](padded_end, block_expert, blocks, E=n_experts, E_PAD=e_pad,
                                                     BLOCK_M=block_m, BLOCK_B=32, num_warps=4)
    return rows, block_expert


def _interpreting() -> bool:
    from lingls.kernels.shared import INTERPRET

    return INTERPRET


if triton is not None:
    @jit
    def _route_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, scale, E: tl.constexpr, G: tl.constexpr,
                      TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr,
                      NORMALIZE: tl.constexpr):
        """One token: sigmoid scores, + bias to choose; each group scored by its two best; the TOPK_GROUP best
        groups kept (ties to the lower group); the TOP_K best experts among them, best first (ties to the lower
        index); weights = the unbiased scores, normalised, scaled."""
        t = tl.program_id(0)
        EPG: tl.constexpr = E // G
        offs = tl.arange(0, E)
        s = tl.sigmoid(tl.load(logits_ptr + t.to(tl.int64) * E + offs))
        c = tl.reshape(s + tl.load(bias_ptr + offs), (G, EPG))
        col = tl.arange(0, EPG)[None, :]
        first = tl.argmax(c, axis=1)
        second = tl.max(tl.where(col == first[:, None], float("-inf"), c), axis=1)
        group_score = tl.max(c, axis=1) + second
        gi = tl.arange(0, G)
        above = (group_score[None, :] > group_score[:, None]) | \
            ((group_score[None, :] == group_score[:, None]) & (gi[None, :] < gi[:, None]))
        keep = tl.sum(above.to(tl.int32), axis=1) < TOPK_GROUP
        c = tl.reshape(tl.where(keep[:, None], c, float("-inf")), (E,))
        k = tl.arange(0, TOPK_PAD)
        chosen = tl.zeros((TOPK_PAD,), tl.float32)
        total = 0.0
        for j in tl.static_range(TOP_K):
            best = tl.argmax(c, axis=0)
            w = tl.sum(tl.where(offs == best, s, 0.0), axis=0)
            total += w
            chosen = tl.where(k == j, w, chosen)
            tl.store(idx_ptr + t * TOP_K + j, best.to(tl.int64))
            c = tl.where(offs == best, float("-inf"), c)
        if NORMALIZE:
            chosen = chosen / (total + 1e-20)
        tl.store(w_ptr + t * TOP_K + k, chosen * scale, mask=k < TOP_K)

    @jit
    def _count_kernel(expert_ptr, counts_ptr, slot_ptr, P, BLOCK: tl.constexpr):
        """Each pair's place in its expert's run: the expert's count before this pair's increment."""
        p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = p < P
        e = tl.load(expert_ptr + p, mask=m, other=0)
        slot = tl.atomic_add(counts_ptr + e, tl.full((BLOCK,), 1, tl.int32), mask=m)
        tl.store(slot_ptr + p, slot, mask=m)

    @jit
    def _offsets_kernel(counts_ptr, start_ptr, padded_end_ptr, E: tl.constexpr, E_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr):
        """Each expert's run padded to whole blocks: where it starts and where it ends."""
        e = tl.arange(0, E_PAD)
        m = e < E
        padded = (tl.load(counts_ptr + e, mask=m, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        end = tl.cumsum(padded, axis=0)
        tl.store(start_ptr + e, end - padded, mask=m)
        tl.store(padded_end_ptr + e, end, mask=m)

    @jit
    def _scatter_kernel(expert_ptr, slot_ptr, start_ptr, rows_ptr, P, BLOCK: tl.constexpr):
        p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = p < P
        e = tl.load(expert_ptr + p, mask=m, other=0)
        dest = tl.load(start_ptr + e, mask=m, other=0) + tl.load(slot_ptr + p, mask=m, other=0)
        tl.store(rows_ptr + dest, p.to(tl.int32), mask=m)

    @jit
    def _block_expert_kernel(padded_end_ptr, block_expert_ptr, B, E: tl.constexpr, E_PAD: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
        """A block's expert: how many runs end at or before its first row (E past the last run)."""
        b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        e = tl.arange(0, E_PAD)
        end = tl.load(padded_end_ptr + e, mask=e < E, other=2**30)
        expert = tl.sum((end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, expert, mask=b < B)

    @jit
    def _dot(acc, a, b, F32_DOT: tl.constexpr):
        """acc + a @ b; under the interpreter in fp32 (its bf16 dot is wrong in Triton 3.6): the same exact products."""
        if F32_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        return tl.dot(a, b, acc)

    @jit
    def _gate_up_rows(x_ptr, w_e, rows_ptr, act_ptr, m, live, n, TOP_K: tl.constexpr, H: tl.constexpr,
                      INTER: tl.constexpr, LIMIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      F32_DOT: tl.constexpr):
        """act rows m (`live`: inside the expert's run; padding pairs are -1) = swiglu of the gathered x rows times
        one column tile of the expert's gate and up weights (w_e), K = H in BLOCK_K steps; live None: every row."""
        if live is None:
            pair = tl.load(rows_ptr + m)
        else:
            pair = tl.load(rows_ptr + m, mask=live, other=-1)
        valid = pair >= 0
        token = tl.where(valid, pair, 0) // TOP_K
        nmask = n < INTER
        kk = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros((m.shape[0], BLOCK_N), tl.float32)
        acc_u = tl.zeros((m.shape[0], BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kmask = (k0 + kk) < H
            xt = tl.load(x_ptr + token[:, None].to(tl.int64) * H + k0 + kk[None, :],
                         mask=valid[:, None] & kmask[None, :], other=0.0)
            wg = tl.load(w_e + n[:, None] * H + k0 + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            wu = tl.load(w_e + (INTER + n[:, None]) * H + k0 + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                         other=0.0)
            acc_g = _dot(acc_g, xt, tl.trans(wg), F32_DOT)
            acc_u = _dot(acc_u, xt, tl.trans(wu), F32_DOT)
        _swiglu_store(act_ptr, m, valid, n, acc_g, acc_u, INTER, LIMIT)

    @jit
    def _swiglu_store(act_ptr, m, valid, n, acc_g, acc_u, INTER: tl.constexpr, LIMIT: tl.constexpr):
        """act[m, n] = swiglu of one column tile's gate and up sums, rounded where torch rounds them."""
        g = acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference's GEMM output
        u = acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(act_ptr.dtype.element_ty).to(tl.float32)  # silu, rounded as torch's
        if LIMIT > 0:
            s = tl.minimum(s, LIMIT)
            u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        tl.store(act_ptr + m[:, None].to(tl.int64) * INTER + n[None, :], (s * u).to(act_ptr.dtype.element_ty),
                 mask=valid[:, None] & (n < INTER)[None, :])

    @jit
    def _weight_tile(w_e, n, k, H: tl.constexpr, INTER: tl.constexpr):
        """Rows n (< INTER) of gate (or of up: w_e offset by INTER rows) at columns k, transposed: [BLOCK_K,
        BLOCK_N]."""
        return tl.trans(tl.load(w_e + n[:, None] * H + k[None, :], mask=(n < INTER)[:, None] & (k < H)[None, :],
                                other=0.0))

    @jit
    def _grouped_gate_up_whole_kernel(x_ptr, w_ptr, rows_ptr, bexp_ptr, act_ptr, TOP_K: tl.constexpr,
                                      E: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, LIMIT: tl.constexpr,
                                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                      TILES: tl.constexpr, F32_DOT: tl.constexpr):
        """A block's whole act rows: every column tile of gate and up (TILES of BLOCK_N, up to 4) in one K loop,
        so the block's gathered x rows are read once (the block form reads them once per column tile, the
        programs of one block ~1,500 apart in launch order). Each tile sums the same K steps in the same order as
        the block form's, so the two give the same bits."""
        b = tl.program_id(0)
        e = tl.load(bexp_ptr + b)
        if e < E:
            m = b * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(rows_ptr + m)
            valid = pair >= 0
            token = tl.where(valid, pair, 0) // TOP_K
            n = tl.arange(0, BLOCK_N)
            kk = tl.arange(0, BLOCK_K)
            w_g = w_ptr + e.to(tl.int64) * (2 * INTER * H)
            w_u = w_g + INTER * H
            g0 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            u0 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            g1 = g0
            u1 = g0
            g2 = g0
            u2 = g0
            g3 = g0
            u3 = g0
            for k0 in range(0, H, BLOCK_K):
                k = k0 + kk
                xt = tl.load(x_ptr + token[:, None].to(tl.int64) * H + k[None, :],
                             mask=valid[:, None] & (k < H)[None, :], other=0.0)
                g0 = _dot(g0, xt, _weight_tile(w_g, n, k, H, INTER), F32_DOT)
                u0 = _dot(u0, xt, _weight_tile(w_u, n, k, H, INTER), F32_DOT)
                if TILES > 1:
                    g1 = _dot(g1, xt, _weight_tile(w_g, n + BLOCK_N, k, H, INTER), F32_DOT)
                    u1 = _dot(u1, xt, _weight_tile(w_u, n + BLOCK_N, k, H, INTER), F32_DOT)
                if TILES > 2:
                    g2 = _dot(g2, xt, _weight_tile(w_g, n + 2 * BLOCK_N, k, H, INTER), F32_DOT)
                    u2 = _dot(u2, xt, _weight_tile(w_u, n + 2 * BLOCK_N, k, H, INTER), F32_DOT)
                if TILES > 3:
                    g3 = _dot(g3, xt, _weight_tile(w_g, n + 3 * BLOCK_N, k, H, INTER), F32_DOT)
                    u3 = _dot(u3, xt, _weight_tile(w_u, n + 3 * BLOCK_N, k, H, INTER), F32_DOT)
            _swiglu_store(act_ptr, m, valid, n, g0, u0, INTER, LIMIT)
            if TILES > 1:
                _swiglu_store(act_ptr, m, valid, n + BLOCK_N, g1, u1, INTER, LIMIT)
            if TILES > 2:
                _swiglu_store(act_ptr, m, valid, n + 2 * BLOCK_N, g2, u2, INTER, LIMIT)
            if TILES > 3:
                _swiglu_store(act_ptr, m, valid, n + 3 * BLOCK_N, g3, u3, INTER, LIMIT)

    @jit
    def _grouped_gate_up_kernel(x_ptr, w_ptr, rows_ptr, bexp_ptr, act_ptr, TOP_K: tl.constexpr, E: tl.constexpr,
                        H: tl.constexpr, INTER: tl.constexpr, LIMIT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
        b = tl.program_id(0)
        nt = tl.program_id(1)
        e = tl.load(bexp_ptr + b)
        if e < E:
            m = b * BLOCK_M + tl.arange(0, BLOCK_M)
            _gate_up_rows(x_ptr, w_ptr + e.to(tl.int64) * (2 * INTER * H), rows_ptr, act_ptr, m, None,
                          nt * BLOCK_N + tl.arange(0, BLOCK_N), TOP_K, H, INTER, LIMIT, BLOCK_N, BLOCK_K, F32_DOT)

    @jit
    def _grouped_down_kernel(act_ptr, w_ptr, rows_ptr, bexp_ptr, y_ptr, E: tl.constexpr, H: tl.constexpr,
                     INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     F32_DOT: tl.constexpr):
        b = tl.program_id(0)
        nt = tl.program_id(1)
        e = tl.load(bexp_ptr + b)
        if e < E:
            m = b * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(rows_ptr + m)
            valid = pair >= 0
            n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < H
            kk = tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            w_e = w_ptr + e.to(tl.int64) * (H * INTER)
            for k0 in range(0, INTER, BLOCK_K):
                kmask = (k0 + kk) < INTER
                a = tl.load(act_ptr + m[:, None].to(tl.int64) * INTER + k0 + kk[None, :],
                            mask=valid[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_e + n[:, None] * INTER + k0 + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                            other=0.0)
                acc = _dot(acc, a, tl.trans(w), F32_DOT)
            tl.store(y_ptr + tl.where(valid, pair, 0)[:, None].to(tl.int64) * H + n[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])

    @jit
    def _down_weights(w_e, n, nmask, c: tl.constexpr, INTER: tl.constexpr, BLOCK_K: tl.constexpr):
        """Chunk c of K of an expert's down-weight column tile, transposed: [BLOCK_K, BLOCK_N]."""
        k = c * BLOCK_K + tl.arange(0, BLOCK_K)
        return tl.trans(tl.load(w_e + n[:, None] * INTER + k[None, :], mask=nmask[:, None] & (k < INTER)[None, :],
                                other=0.0))

    @jit
    def _down_act(act_ptr, m, valid, c: tl.constexpr, INTER: tl.constexpr, BLOCK_K: tl.constexpr):
        """Chunk c of K of act rows m (padding rows zero): [BLOCK_M, BLOCK_K]."""
        k = c * BLOCK_K + tl.arange(0, BLOCK_K)
        return tl.load(act_ptr + m[:, None].to(tl.int64) * INTER + k[None, :],
                       mask=valid[:, None] & (k < INTER)[None, :], other=0.0)

    @jit
    def _grouped_down_whole_kernel(act_ptr, w_ptr, rows_ptr, bexp_ptr, y_ptr, E: tl.constexpr, H: tl.constexpr,
                                   INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr, STAGES: tl.constexpr,
                                   F32_DOT: tl.constexpr):
        """A block's whole y rows: its act rows ([BLOCK_M, INTER] in K_CHUNKS chunks of BLOCK_K) loaded once and
        kept while the program streams its expert's down weight BLOCK_N rows at a time over all of H, the next
        tiles' loads in flight under the current product (STAGES): one long pipelined loop a program, where the
        by-expert form's programs each walk 2-3 blocks after loading their weight tile. The K chunks are summed
        in the by-expert form's order, so the two give the same bits."""
        b = tl.program_id(0)
        e = tl.load(bexp_ptr + b)
        if e < E:
            m = b * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(rows_ptr + m)
            valid = pair >= 0
            a0 = _down_act(act_ptr, m, valid, 0, INTER, BLOCK_K)
            a1 = a0  # chunks past K_CHUNKS are never read
            a2 = a0
            a3 = a0
            if K_CHUNKS > 1:
                a1 = _down_act(act_ptr, m, valid, 1, INTER, BLOCK_K)
            if K_CHUNKS > 2:
                a2 = _down_act(act_ptr, m, valid, 2, INTER, BLOCK_K)
            if K_CHUNKS > 3:
                a3 = _down_act(act_ptr, m, valid, 3, INTER, BLOCK_K)
            w_e = w_ptr + e.to(tl.int64) * (H * INTER)
            out = y_ptr + tl.where(valid, pair, 0)[:, None].to(tl.int64) * H
            for n0 in tl.range(0, H, BLOCK_N, num_stages=STAGES):
                n = n0 + tl.arange(0, BLOCK_N)
                nmask = n < H
                acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                acc = _dot(acc, a0, _down_weights(w_e, n, nmask, 0, INTER, BLOCK_K), F32_DOT)
                if K_CHUNKS > 1:
                    acc = _dot(acc, a1, _down_weights(w_e, n, nmask, 1, INTER, BLOCK_K), F32_DOT)
                if K_CHUNKS > 2:
                    acc = _dot(acc, a2, _down_weights(w_e, n, nmask, 2, INTER, BLOCK_K), F32_DOT)
                if K_CHUNKS > 3:
                    acc = _dot(acc, a3, _down_weights(w_e, n, nmask, 3, INTER, BLOCK_K), F32_DOT)
                tl.store(out + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])

    @jit
    def _combine_kernel(y_ptr, w_ptr, plus_ptr, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr, PLUS: tl.constexpr,
                        BLOCK: tl.constexpr):
        """out[t] = sum over j < TOP_K of w[t, j] * y[t * TOP_K + j], in fp32 in the order of j, rounded once;
        with PLUS, then + plus[t] rounded again (the bits of torch's `out + plus` in out's dtype)."""
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros((BLOCK,), tl.float32)
        for j in range(TOP_K):
            w = tl.load(w_ptr + t * TOP_K + j)
            y = tl.load(y_ptr + (t * TOP_K + j).to(tl.int64) * H + cols, mask=mask, other=0.0)
            acc += w * y.to(tl.float32)
        out = acc.to(out_ptr.dtype.element_ty)
        if PLUS:
            out = (out.to(tl.float32) + tl.load(plus_ptr + t.to(tl.int64) * H + cols, mask=mask, other=0.0).to(
                tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t.to(tl.int64) * H + cols, out, mask=mask)


# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the block form's two kernels
GATE_UP_CONFIG = (64, 64, 4, 3)
DOWN_CONFIG = (128, 64, 4, 3)
# the whole-block gate/up kernel (BLOCK_N, BLOCK_K, num_warps, num_stages): up to 4 column tiles of gate and of up
# in one program (INTER <= 4 * BLOCK_N; a wider INTER takes the block form's kernel); at a TP=4 rank's INTER 192,
# 6 accumulators of 64 x 64 fp32 over 4 warps, sm_90: 255 registers a thread without spills and 112 KB of shared
# memory (2 stages of 56 KB), so two programs an SM (the module note has the settings measured)
GATE_UP_WHOLE = (64, 64, 4, 2)
# the whole-block down kernel (BLOCK_N, num_warps, num_stages over the column tiles; sm_90 at INTER 192, BLOCK_M
# 64: 62 registers, ~104 KB of shared memory) and the widest INTER it takes (its act rows in up to 4 chunks of at
# most 64); a wider INTER takes the block form's kernel
DOWN_WHOLE = (64, 4, 3)
DOWN_WHOLE_MAX_INTER = 256
COMBINE_BLOCK = 1024  # columns of one token's weighted sum per program


def down_chunks(inter: int) -> tuple[int, int]:
    """(BLOCK_K, K_CHUNKS) of the whole-block down kernel: INTER in at most 4 chunks of a power of two >= 16."""
    block_k = max(16, triton.next_power_of_2(-(-inter // 4)))
    return block_k, -(-inter // block_k)


def moe_prefill_triton(x, weights, idx, gate_up, down, inter: int, limit: float = 0.0, block_m: int | None = None,
                       form: str | None = None, down_form: str | None = None, plus: torch.Tensor | None = None):
    """`moe_prefill_reference` by the grouped kernels (any device Triton runs on; the interpreter on a CPU), in
    `form` for gate/up and `down_form` for down (default `FORM`, `DOWN_FORM`; the module note says what each
    is). plus: [N, H] in x's dtype added to the result in the weighted sum's pass (the shared expert's output: one
    pass over [N, H] fewer than torch's add after), with the bits of `result + plus`."""
    from lingls.kernels.shared import INTERPRET

    form, down_form, block_m = form or FORM, down_form or DOWN_FORM, block_m or BLOCK_M
    if form not in GATE_UP_FORMS:
        raise ValueError(f"unknown gate/up kernel's form {form!r}: one of {GATE_UP_FORMS}")
    if down_form not in DOWN_FORMS:
        raise ValueError(f"unknown down kernel's form {down_form!r}: one of {DOWN_FORMS}")
    n, k = idx.shape
    n_exp, _, hidden = gate_up.shape
    rows, block_expert = sort_pairs_triton(idx, n_exp, block_m)
    blocks = block_expert.shape[0]
    act = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    if form == "whole_block" and inter <= 4 * GATE_UP_WHOLE[0]:
        bn, bk, warps, stages = GATE_UP_WHOLE
        _grouped_gate_up_whole_kernel[(blocks,)](
            x.contiguous(), gate_up, rows, block_expert, act, TOP_K=k, E=n_exp, H=hidden, INTER=inter,
            LIMIT=float(limit), BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, TILES=triton.cdiv(inter, bn),
            F32_DOT=INTERPRET, num_warps=warps, num_stages=stages)
    else:
        bn, bk, warps, stages = GATE_UP_CONFIG
        _grouped_gate_up_kernel[(blocks, triton.cdiv(inter, bn))](
            x.contiguous(), gate_up, rows, block_expert, act, TOP_K=k, E=n_exp, H=hidden, INTER=inter,
            LIMIT=float(limit), BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, F32_DOT=INTERPRET, num_warps=warps,
            num_stages=stages)
    y = torch.empty(n * k, hidden, dtype=x.dtype, device=x.device)
    if down_form == "whole_block" and inter <= DOWN_WHOLE_MAX_INTER:
        bn, warps, stages = DOWN_WHOLE
        bk, chunks = down_chunks(inter)
        _grouped_down_whole_kernel[(blocks,)](
            act, down, rows, block_expert, y, E=n_exp, H=hidden, INTER=inter, BLOCK_M=block_m, BLOCK_N=bn,
            BLOCK_K=bk, K_CHUNKS=chunks, STAGES=stages, F32_DOT=INTERPRET, num_warps=warps)
    else:
        bn, bk, warps, stages = DOWN_CONFIG
        _grouped_down_kernel[(blocks, triton.cdiv(hidden, bn))](
            act, down, rows, block_expert, y, E=n_exp, H=hidden, INTER=inter, BLOCK_M=block_m, BLOCK_N=bn,
            BLOCK_K=bk, F32_DOT=INTERPRET, num_warps=warps, num_stages=stages)
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    if plus is not None and (plus.shape != out.shape or plus.dtype != out.dtype):
        raise ValueError(f"plus must be [{n}, {hidden}] in {out.dtype}, not {list(plus.shape)} in {plus.dtype}")
    _combine_kernel[(n, triton.cdiv(hidden, COMBINE_BLOCK))](
        y, weights.float().contiguous(), plus.contiguous() if plus is not None else out, out, H=hidden, TOP_K=k,
        PLUS=plus is not None, BLOCK=COMBINE_BLOCK, num_warps=4)
    return out


def moe_prefill(x, weights, idx, gate_up, down, inter: int, limit: float = 0.0):
    """The routed experts of many tokens: the grouped kernels on CUDA with Triton, the reference elsewhere."""
    if triton is not None and x.is_cuda:
        return moe_prefill_triton(x, weights, idx, gate_up, down, inter, limit)
    return moe_prefill_reference(x, weights, idx, gate_up, down, inter, limit)
