"""lm_head fused with the token choice: bf16 GEMV over the vocab shard + greedy argmax or temperature sampling.

The lm_head is the largest single matrix of a step (39296 x 2560 bf16 per TP=4 rank, 0.2 GB) and its output
is only ever reduced to one token per row, so the logits need not round-trip through memory: each program
computes a block of the vocab for all T rows, reduces it to a (best score, index) per row, and the last program
to finish (atomic counter, same launch) reduces the blocks. One launch, no host read.

Scores: greedy uses the fp32 logit (argmax over fp32 logits, first index on ties). Sampling uses the
exponential race of `lingls.runtime.sampling`: argmax_i p_i / E_i with E_i = -log u_i and u_i the counter hash
of (seed, position, token id); in logit space that is logit_i / temperature - log(E_i) (the softmax normaliser
is the same for every i, so it drops out), which is why it fuses: no softmax, no sort. It draws exactly the
token `runtime.sampling.sample` draws with top_p = 1, up to near-ties in fp32. Nucleus (top-p < 1) sampling
needs the whole distribution: pass `logits_out` to get the logits from the same pass and sample them there.

`argmax_rows` is the greedy choice alone, for logits already in memory: one launch over [T, V] (the runtime's
`sampling.argmax` on CUDA), with the same packed keys as the MoE routing (`kernels.shared`). Across vocab shards
it writes each rank's (score, token) into a message that one all-reduce gathers and `pick_rows` decides
(`runtime.sampling.argmax_shards`).

Tensor parallelism: with `vocab_offset` = this rank's first token id, a rank returns its local best (score,
global id); all-gather the [T] pairs and take `combine_ranks`: every rank agrees on the same token, and the
hash keyed by global id makes the sampled token independent of the number of ranks.
"""

from __future__ import annotations

import torch

from lingls.kernels import jit, tl, triton
from lingls.kernels.gemv import MAX_T
from lingls.kernels.reference import uniform_hash
from lingls.kernels.shared import INTERPRET, NO_KEY, counters, key_index, key_value, make_key, mma

ARGMAX_BLOCK = 4096  # logits per program of `argmax_rows` (39 programs per row for Ling's 157,184 tokens)


@jit
def _uniform(seed, pos, ids):
    """`uniform_hash` on int64 tensors (all constants int64, so the arithmetic wraps as torch's does)."""
    m32 = tl.full((), 0xFFFFFFFF, tl.int64)
    c1 = tl.full((), 0x9E3779B1, tl.int64)
    c2 = tl.full((), 0x85EBCA77, tl.int64)
    c3 = tl.full((), 0xC2B2AE3D, tl.int64)
    c4 = tl.full((), 0x045D9F3B, tl.int64)
    x = (ids * c1 + pos * c2 + seed * c3) & m32
    x = (((x >> 16) ^ x) * c4) & m32
    x = (((x >> 16) ^ x) * c4) & m32
    x = (x >> 16) ^ x
    return ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@jit
def _lm_head_kernel(x_ptr, w_ptr, logits_ptr, pv_ptr, pi_ptr, cnt_ptr, val_ptr, idx_ptr,
                    pos_ptr, temp_ptr, seed_ptr, T, V, K, vocab_offset,
                    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, NB: tl.constexpr,
                    R_CHUNK: tl.constexpr, R_ITERS: tl.constexpr, TT: tl.constexpr, SAMPLE: tl.constexpr,
                    WRITE_LOGITS: tl.constexpr, F32_DOT: tl.constexpr):
    pid = tl.program_id(0)
    rt = tl.arange(0, 16)
    rv = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((16, BLOCK_V), tl.float32)
    for i in range(0, K_ITERS):
        kk = i * BLOCK_K + rk
        xt = tl.load(x_ptr + rt[:, None] * K + kk[None, :], mask=(rt[:, None] < T) & (kk[None, :] < K), other=0.0)
        wt = tl.load(w_ptr + rv[:, None] * K + kk[None, :], mask=(rv[:, None] < V) & (kk[None, :] < K), other=0.0)
        acc = mma(acc, xt, tl.trans(wt), F32_DOT)
    valid = (rt[:, None] < T) & (rv[None, :] < V)
    if WRITE_LOGITS:
        tl.store(logits_ptr + rt[:, None] * V + rv[None, :], acc.to(logits_ptr.dtype.element_ty), mask=valid)
    score = acc
    if SAMPLE:
        temp = tl.maximum(tl.load(temp_ptr), 1e-5)
        seed = tl.load(seed_ptr)
        pos = tl.load(pos_ptr + rt, mask=rt < T, other=0)
        u = _uniform(seed, pos[:, None], (vocab_offset + rv)[None, :].to(tl.int64))
        score = acc / temp - tl.log(-tl.log(u))
    score = tl.where(valid, score, float("-inf"))
    tl.store(pv_ptr + pid * 16 + rt, tl.max(score, axis=1))
    tl.store(pi_ptr + pid * 16 + rt, pid * BLOCK_V + tl.argmax(score, axis=1))
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if arrived == NB - 1:
        tr = tl.arange(0, TT)
        rb = tl.arange(0, R_CHUNK)
        best = tl.zeros((TT,), tl.float32) + float("-inf")
        best_i = tl.zeros((TT,), tl.int32)
        for c in range(0, R_ITERS):
            b = c * R_CHUNK + rb
            m = (b[None, :] < NB) & (tr[:, None] < T)
            v = tl.load(pv_ptr + b[None, :] * 16 + tr[:, None], mask=m, other=float("-inf"), cache_modifier=".cg")
            ix = tl.load(pi_ptr + b[None, :] * 16 + tr[:, None], mask=m, other=0, cache_modifier=".cg")
            cm = tl.max(v, axis=1)
            ca = tl.argmax(v, axis=1)  # first block on ties: the lowest token id
            ci = tl.sum(tl.where(rb[None, :] == ca[:, None], ix, 0), axis=1)
            better = cm > best  # strict: an earlier chunk keeps a tie
            best_i = tl.where(better, ci, best_i)
            best = tl.where(better, cm, best)
        tl.store(val_ptr + tr, best, mask=tr < T)
        tl.store(idx_ptr + tr, best_i.to(tl.int64) + vocab_offset, mask=tr < T)
        tl.atomic_xchg(cnt_ptr, 0)


def lm_head_choose(x: torch.Tensor, w: torch.Tensor, sample: bool = False, positions: torch.Tensor | None = None,
                   temperature: torch.Tensor | None = None, seed: torch.Tensor | None = None, vocab_offset: int = 0,
                   logits_out: torch.Tensor | None = None, block_v: int = 64, block_k: int = 256,
                   num_warps: int = 4, num_stages: int = 3):
    """One launch: logits = x @ w^T for this vocab shard, reduced to the best (score, global id) per row.

    x: [T, K] bf16 (T <= 16); w: [V_local, K] bf16. Greedy (sample=False): score = fp32 logit. Sampling:
    positions [T] int64 (the positions the chosen tokens will take), temperature [1] float, seed [1] int64,
    all device tensors (one captured graph serves any values). logits_out: optional [T, V_local] tensor the
    logits are also written to (fp32 or bf16). Returns (score [T] fp32, token id [T] int64).
    """
    t, k = x.shape
    v = w.shape[0]
    assert 1 <= t <= MAX_T and x.is_contiguous() and w.is_contiguous() and w.shape[1] == k
    nb = triton.cdiv(v, block_v)
    dev = x.device
    pv = torch.empty(nb, 16, dtype=torch.float32, device=dev)
    pi = torch.empty(nb, 16, dtype=torch.int32, device=dev)
    val = torch.empty(t, dtype=torch.float32, device=dev)
    idx = torch.empty(t, dtype=torch.int64, device=dev)
    if sample:
        assert positions is not None and temperature is not None and seed is not None
    else:
        positions = temperature = seed = val  # unread
    r_chunk = min(triton.next_power_of_2(nb), 256)
    _lm_head_kernel[(nb,)](
        x, w, logits_out if logits_out is not None else val, pv, pi, counters(dev, 1), val, idx,
        positions, temperature, seed, t, v, k, vocab_offset,
        BLOCK_V=block_v, BLOCK_K=block_k, K_ITERS=triton.cdiv(k, block_k), NB=nb, R_CHUNK=r_chunk,
        R_ITERS=triton.cdiv(nb, r_chunk), TT=max(triton.next_power_of_2(t), 2), SAMPLE=sample,
        WRITE_LOGITS=logits_out is not None, F32_DOT=INTERPRET, num_warps=num_warps, num_stages=num_stages)
    return val, idx


def lm_head_choose_reference(x, w, sample: bool = False, positions=None, temperature=None, seed=None,
                             vocab_offset: int = 0):
    """The definition: fp32 logits of the bf16 inputs; the first maximum of the logit (greedy) or of
    logit / temperature - log(-log u) with u keyed by (seed, position, global token id)."""
    logits = x.float() @ w.float().t()
    if sample:
        ids = vocab_offset + torch.arange(w.shape[0], device=x.device)
        u = uniform_hash(seed, positions[:, None], ids[None, :])
        logits = logits / temperature.float().clamp_min(1e-5) - torch.log(-torch.log(u))
    idx = logits.argmax(-1)
    return logits.gather(-1, idx[:, None]).squeeze(-1), idx + vocab_offset


def combine_ranks(vals: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gathered per-rank bests [R, T] -> the token [T]: the highest score, the lowest rank (= id) on ties."""
    return ids.gather(0, vals.argmax(0, keepdim=True)).squeeze(0)


def choose(x, w, sample: bool = False, positions=None, temperature=None, seed=None, vocab_offset: int = 0):
    """Dispatcher: the fused kernel for CUDA tensors with at most 16 rows, the reference otherwise."""
    if x.is_cuda and x.shape[0] <= MAX_T:
        return lm_head_choose(x, w, sample, positions, temperature, seed, vocab_offset)
    return lm_head_choose_reference(x, w, sample, positions, temperature, seed, vocab_offset)


@jit
def _argmax_kernel(x_ptr, part_ptr, cnt_ptr, out_ptr, ids_ptr, msg_ptr, V, stride, offset, T, rank,
                   NB: tl.constexpr, NB_PAD: tl.constexpr, BLOCK: tl.constexpr, IDS: tl.constexpr,
                   RANKS: tl.constexpr):
    """Program (row, block): the block's best packed key into part; the row's last program to arrive (its
    arrival counter) reduces the row's NB keys to its token: ids[index] with IDS, else index + offset. With
    RANKS == 1 it writes the token to out; otherwise it writes the row's column of the exchange message
    msg [2, RANKS, T] fp32 (`exchange`): its score and token in its rank's slots, zeros in the others."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < V
    x = tl.load(x_ptr + row * stride + offs, mask=m, other=0.0).to(tl.float32)
    best = tl.max(tl.where(m, make_key(x, offs, 2 ** 31), NO_KEY), axis=0)
    tl.store(part_ptr + row * NB + blk, best)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
    if arrived == NB - 1:
        r = tl.arange(0, NB_PAD)
        keys = tl.load(part_ptr + row * NB + r, mask=r < NB, other=NO_KEY, cache_modifier=".cg")
        key = tl.max(keys, axis=0)
        index = key_index(key, 2 ** 31)
        token = tl.load(ids_ptr + index).to(tl.int64) if IDS else index.to(tl.int64) + offset
        if RANKS == 1:
            tl.store(out_ptr + row, token)
        else:
            slot = tl.arange(0, RANKS)
            mine = slot == rank
            tl.store(msg_ptr + slot * T + row, tl.where(mine, key_value(key), 0.0))
            tl.store(msg_ptr + (RANKS + slot) * T + row, tl.where(mine, token.to(tl.float32), 0.0))
        tl.atomic_xchg(cnt_ptr + row, 0)


@jit
def picked(msg_ptr, row, T, RANKS: tl.constexpr):
    """Row `row`'s token (int64) of a summed exchange message [2, RANKS, T]: the best score among the ranks'
    slots, the first rank among equal scores."""
    slot = tl.arange(0, RANKS)
    scores = tl.load(msg_ptr + slot * T + row)
    best = key_index(tl.max(make_key(scores, slot, RANKS), axis=0), RANKS)
    return tl.sum(tl.where(slot == best, tl.load(msg_ptr + (RANKS + slot) * T + row), 0.0), axis=0).to(tl.int64)


@jit
def _pick_kernel(msg_ptr, out_ptr, T, RANKS: tl.constexpr):
    """Program row: `picked`."""
    row = tl.program_id(0)
    tl.store(out_ptr + row, picked(msg_ptr, row, T, RANKS))


def argmax_rows(logits: torch.Tensor, block: int = ARGMAX_BLOCK, ids: torch.Tensor | None = None,
                offset: int = 0, exchange: tuple[int, int] | None = None) -> torch.Tensor:
    """logits [T, V] (last dim contiguous, any float dtype) -> the first index of each row's maximum [T]
    int64, as `logits.argmax(-1)`: one launch of T x cdiv(V, block) programs (torch's reduction of one long
    row runs ~13 us on an H200 for Ling's vocabulary, most of it in too few threads).

    ids [V] int64: return ids[index] instead (a reduced vocabulary's tokens); offset: return index + offset
    (this rank's first token of a vocab shard). exchange = (rank, ranks): return instead the message
    [2, ranks, T] fp32 that `runtime.sampling.argmax_shards` all-reduces (each row's best score and token in
    the rank's slots, zeros elsewhere: the sum over ranks gathers them; `pick_rows` then chooses)."""
    t, v = logits.shape
    assert logits.stride(1) == 1 and v < 2 ** 31
    nb = triton.cdiv(v, block)
    rank, ranks = exchange or (0, 1)
    assert ranks & (ranks - 1) == 0, "the exchange needs a power-of-two number of ranks"
    out = torch.empty((2, ranks, t) if ranks > 1 else (t,), dtype=torch.float32 if ranks > 1 else torch.int64,
                      device=logits.device)
    part = torch.empty(t * nb, dtype=torch.int64, device=logits.device)
    _argmax_kernel[(t, nb)](logits, part, counters(logits.device, t), out, ids if ids is not None else out, out, v,
                            logits.stride(0), offset, t, rank, NB=nb, NB_PAD=triton.next_power_of_2(nb), BLOCK=block,
                            IDS=ids is not None, RANKS=ranks, num_warps=4)
    return out


def pick_rows(msg: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A summed exchange message [2, ranks, T] -> the tokens [T] int64: per row the token of the best score, the
    first rank on ties (`argmax_rows(..., exchange=...)`). out: [T] int64 to write them into."""
    _, ranks, t = msg.shape
    out = torch.empty(t, dtype=torch.int64, device=msg.device) if out is None else out
    _pick_kernel[(t,)](msg, out, t, RANKS=ranks, num_warps=1)
    return out
