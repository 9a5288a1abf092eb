"""The end of a speculative round in one launch: the accepted count, the round's tokens, the next round's inputs.

After a verify the round decides n (greedy: how many leading drafts equal the target's choices; with sampling,
`rejection_sample` decides it beforehand), takes tokens[:n+1] as its output, and moves on: the last of them
becomes the next input token, the position advances by n + 1, and [n, tokens] goes to the buffer the host reads
a round later. In torch ops that is ~10 launches between the target's argmax and the KDA commit (compare,
cumprod, sum, index_select, adds, copies), each a kernel outside the PDL chain with a gap before it; here it is
one program of one warp. `settle_round_reference` is the same in torch ops, for CPUs and as the tests' oracle.

A plain decode step ends the same way, as a round with no drafts (K = 0, n = 0): its token becomes the next input
and the step's output, and the position advances; there it replaces three torch launches.
"""

from __future__ import annotations

import torch

from lingls.kernels import jit, tl, triton


def settle_round_reference(choice, drafts, next_ids, pos, result=None, n=None, force=None):
    """choice [K+1]: the target's token at each verified position (greedy: its argmax; sampling: the tokens of
    `rejection_sample`, with its n [1]); drafts [K] (K may be 0). force [1] (benchmarks at random weights, where
    no draft is ever accepted): claim min(max(force, 0), K) drafts instead. Writes the next input token into
    each of `next_ids` ([1] buffers), advances pos [1] by n + 1 and, given result [K+2], writes [n, tokens...]
    there and returns its views (n [1], tokens [K+1]). All int64."""
    k = drafts.shape[0]
    if n is None:
        n = (drafts == choice[:-1]).long().cumprod(0).sum().view(1)
    tokens = choice
    if force is not None:
        n = force.view(1).clamp(0, k)
        tokens = torch.where(torch.arange(k + 1, device=choice.device) < n, torch.cat([drafts, choice[-1:]]), choice)
    for buf in next_ids:
        buf.copy_(tokens.index_select(0, n.view(1)))
    pos.add_(n.view(1) + 1)
    if result is None:
        return None
    result[:1].copy_(n.view(1))
    result[1:].copy_(tokens)
    return result[:1], result[1:]


if triton is not None:

    @jit
    def _settle_kernel(choice_ptr, drafts_ptr, n_ptr, force_ptr, next_a_ptr, next_b_ptr, pos_ptr, result_ptr, K,
                       K1_PAD: tl.constexpr, GIVEN_N: tl.constexpr, FORCED: tl.constexpr, TWO_NEXT: tl.constexpr,
                       HAS_RESULT: tl.constexpr):
        i = tl.arange(0, K1_PAD)
        live = i <= K
        choice = tl.load(choice_ptr + i, mask=live, other=0)
        drafts = tl.load(drafts_ptr + i, mask=i < K, other=0)
        if FORCED:
            n = tl.minimum(tl.maximum(tl.load(force_ptr), 0), K)
        elif GIVEN_N:
            n = tl.load(n_ptr)
        else:  # the first draft that differs from the target's choice (K when none does)
            n = tl.min(tl.where((i < K) & (drafts != choice), i, K), axis=0).to(tl.int64)
        tokens = choice
        if FORCED:
            tokens = tl.where(i < n, drafts, choice)
        nxt = tl.sum(tl.where(i == n, tokens, 0), axis=0)
        if HAS_RESULT:
            tl.store(result_ptr, n)
            tl.store(result_ptr + 1 + i, tokens, mask=live)
        tl.store(next_a_ptr, nxt)
        if TWO_NEXT:
            tl.store(next_b_ptr, nxt)
        tl.store(pos_ptr, tl.load(pos_ptr) + n + 1)


def settle_round(choice, drafts, next_ids, pos, result=None, n=None, force=None):
    """`settle_round_reference` in one launch (one or two `next_ids` buffers)."""
    k = drafts.shape[0]
    assert choice.shape == (k + 1,) and (result is None or result.shape == (k + 2,)) and 1 <= len(next_ids) <= 2
    assert all(x.dtype == torch.int64 for x in (choice, drafts, pos, *next_ids, *([] if result is None else [result])))
    unread = pos  # the pointer of an input or output the call leaves out (never read or written)
    _settle_kernel[(1,)](choice, drafts, unread if n is None else n, unread if force is None else force,
                         next_ids[0], next_ids[-1], pos, unread if result is None else result, k,
                         K1_PAD=max(2, triton.next_power_of_2(k + 1)), GIVEN_N=n is not None, FORCED=force is not None,
                         TWO_NEXT=len(next_ids) == 2, HAS_RESULT=result is not None, num_warps=1)
    return None if result is None else (result[:1], result[1:])


def settle(choice, drafts, next_ids, pos, result=None, n=None, force=None):
    """`settle_round_reference`'s contract: the kernel on CUDA tensors, the reference otherwise."""
    fn = settle_round if triton is not None and choice.is_cuda else settle_round_reference
    return fn(choice, drafts, next_ids, pos, result, n=n, force=force)
