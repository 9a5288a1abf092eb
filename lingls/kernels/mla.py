"""MLA decode over the latent cache with absorbed weights, split over the sequence (batch 1, T <= 16 queries).

Each cache row is [c (rank) | k_rope (rope)]. A query t of head h scores row j as
    s = scale * (q_lat[t, h] . c_j + q_rope[t, h] . k_rope_j),   visible iff j <= positions[t],
and returns sum_j softmax(s)_j c_j (the latent output), or, in the step's form (`mla_attend`), the gated value
output sigmoid(g[t, h]) * (o_lat[t, h] @ W_v[h]^T) that the output projection reads.

The kernel splits the rows into NUM_SPLITS ranges, one program per (range, group of heads): a program puts its
heads' queries into one MMA tile (all 8 heads of a TP=4 rank at T=1), and the programs of a range read the
same rows, so the cache crosses HBM about once and the other head groups hit L2. The number of rows to
read comes from `positions` on the device (the last query's position + 1), so a CUDA graph captured once
serves every length up to the cache's capacity without the host ever learning the length. A second small
kernel merges the ranges' partial softmaxes, one program per (query, head, 64 latent columns); in the step's
form it also applies W_v and the gate (the last of a row's programs sums the column blocks' shares), which
replaces a cuBLAS product, a cast and three elementwise launches per layer.

Before it, `mla_prologue` turns a step's projections into the cache rows and the rotated queries in one launch
per step (one program per token): the RMSNorm of the latent, rope on the shared key and on every head's query
(the angles from the token's position, in the kernel), and the write of [c | k_rope] at that position; programs
beside them (one per head and 64 latent columns) absorb W_k into the queries, q_lat = q_nope @ W_k. In torch
ops that is ~25 small kernels and a cuBLAS product per MLA layer.
"""

from __future__ import annotations

import torch

from lingls.kernels import by_width, by_width_and_tokens, jit, tl, triton, tuned
from lingls.kernels import reference as ref

QUERY_BLOCK = 512  # queries per pass of the reference: a 2048-token prefill chunk at a 32k context and 16 heads
                  # (TP=2) would hold 4.3 GB of fp32 scores at once, several times over; 512 holds ~1 GB


def mla_decode_reference(q_lat, q_rope, cache, positions, scale: float):
    """q_lat [T, H, R], q_rope [T, H, P], cache [N, R + P], positions [T] -> latent output [T, H, R] (fp32).
    A long prefill's queries go QUERY_BLOCK at a time (each query's softmax is its own), to bound memory."""
    if q_lat.shape[0] > QUERY_BLOCK:
        return torch.cat([mla_decode_reference(q_lat[i:i + QUERY_BLOCK], q_rope[i:i + QUERY_BLOCK], cache,
                                               positions[i:i + QUERY_BLOCK], scale)
                          for i in range(0, q_lat.shape[0], QUERY_BLOCK)])
    r = q_lat.shape[-1]
    keys = cache.float()
    scores = (torch.einsum("thr,jr->thj", q_lat.float(), keys[:, :r])
              + torch.einsum("thp,jp->thj", q_rope.float(), keys[:, r:])) * scale
    visible = torch.arange(cache.shape[0], device=cache.device)[None, :] <= positions[:, None]
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("thj,jr->thr", probs, keys[:, :r])


# (num_splits, block_n, num_warps[, heads per program]) by heads per rank (8: TP=4, 16: TP=2), then by the step's
# query count (the smallest key >= T applies; without the fourth entry `heads_per_program` decides): tuned.json.
CONFIGS = by_width(tuned("mla"))


def config_for(t: int, heads: int = 8) -> tuple[int, ...]:
    return by_width_and_tokens(CONFIGS, heads, t)


def heads_per_program(t: int, h: int) -> int:
    """Heads one program serves: as many as fit with the T queries in one 16-row MMA tile (a power of two
    dividing H). At T=1 all 8 heads of a TP=4 rank share a program, so the cache crosses HBM once per split
    and no MMA row is wasted on padding; at T=9 each head has its own program, and the rows of a split cross
    L2 once per head (a `heads` knob of `mla_decode_triton` puts more heads in a larger tile, for the tuner)."""
    g = 1
    while g * 2 <= h and h % (g * 2) == 0 and t * g * 2 <= 16:
        g *= 2
    return g


if triton is not None:
    from lingls.kernels.pdl import mode as pdl_mode
    from lingls.kernels.pdl import wait_previous
    from lingls.kernels.shared import INTERPRET, counters, mma

    @jit
    def _rotate(ptr, i, m, HALF: tl.constexpr, INTERLEAVE: tl.constexpr, cos, sin):
        """Load one rope vector at ptr (pairs (2i, 2i+1) or halves (i, i + HALF)) and rotate it in fp32."""
        if INTERLEAVE:
            x1 = tl.load(ptr + 2 * i, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(ptr + 2 * i + 1, mask=m, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(ptr + i, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(ptr + i + HALF, mask=m, other=0.0).to(tl.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    @jit
    def _mla_prologue_kernel(q_ptr, kv_ptr, w_ptr, freq_ptr, pos_ptr, cache_ptr, qr_ptr, wk_ptr, ql_ptr,
                             T, sq, skv, sc, swk_h, swk_n, eps,
                             H: tl.constexpr, H_PAD: tl.constexpr, NOPE: tl.constexpr, NOPE_PAD: tl.constexpr,
                             R: tl.constexpr, R_PAD: tl.constexpr, RBLK: tl.constexpr, HALF: tl.constexpr,
                             HALF_PAD: tl.constexpr, INTERLEAVE: tl.constexpr, USE_PDL: tl.constexpr,
                             F32_DOT: tl.constexpr):
        """Programs 0..T-1: token t's cache row and rotated queries. Programs T..: (head, block of R) of the
        absorbed queries q_lat[:, h] = q_nope[:, h] @ W_k[h] for all T tokens in one MMA tile."""
        pid = tl.program_id(0)
        absorb = pid >= T
        j = tl.maximum(pid - T, 0)
        head = j // (R_PAD // RBLK)
        rr = (j % (R_PAD // RBLK)) * RBLK + tl.arange(0, RBLK)
        rn = tl.arange(0, NOPE_PAD)
        # W_k's tile is requested before waiting for the previous kernel (PDL): weights never depend on it
        wk = tl.load(wk_ptr + head * swk_h + rn[:, None] * swk_n + rr[None, :],
                     mask=absorb & (rn[:, None] < NOPE) & (rr[None, :] < R), other=0.0)
        wait_previous(USE_PDL)
        if absorb:
            rt = tl.arange(0, 16)
            qn = tl.load(q_ptr + rt[:, None] * sq + head * (NOPE + 2 * HALF) + rn[None, :],
                         mask=(rt[:, None] < T) & (rn[None, :] < NOPE), other=0.0)
            ql = mma(tl.zeros((16, RBLK), tl.float32), qn, wk, F32_DOT)
            tl.store(ql_ptr + (rt[:, None] * H + head) * R + rr[None, :], ql.to(ql_ptr.dtype.element_ty),
                     mask=(rt[:, None] < T) & (rr[None, :] < R))
        else:
            t = pid
            pos = tl.load(pos_ptr + t)
            row = cache_ptr + pos.to(tl.int64) * sc
            r = tl.arange(0, R_PAD)
            rm = r < R
            c = tl.load(kv_ptr + t * skv + r, mask=rm, other=0.0)
            cf = c.to(tl.float32)
            y = (cf * tl.rsqrt(tl.sum(cf * cf, 0) / R + eps)).to(c.dtype).to(tl.float32)  # as norm.py rounds
            tl.store(row + r,
                     (tl.load(w_ptr + r, mask=rm, other=0.0).to(tl.float32) * y).to(cache_ptr.dtype.element_ty),
                     mask=rm)
            i = tl.arange(0, HALF_PAD)
            im = i < HALF
            angle = pos.to(tl.float32) * tl.load(freq_ptr + i, mask=im, other=0.0)  # as reference.rope_cos_sin
            cos = tl.cos(angle)
            sin = tl.sin(angle)
            a, b = _rotate(kv_ptr + t * skv + R, i, im, HALF, INTERLEAVE, cos, sin)
            tl.store(row + R + i, a.to(cache_ptr.dtype.element_ty), mask=im)
            tl.store(row + R + HALF + i, b.to(cache_ptr.dtype.element_ty), mask=im)
            h = tl.arange(0, H_PAD)
            hm = (h[:, None] < H) & im[None, :]
            a, b = _rotate(q_ptr + t * sq + h[:, None] * (NOPE + 2 * HALF) + NOPE, i[None, :], hm, HALF, INTERLEAVE,
                           cos[None, :], sin[None, :])
            out = qr_ptr + (t * H + h[:, None]) * (2 * HALF) + i[None, :]
            tl.store(out, a.to(qr_ptr.dtype.element_ty), mask=hm)
            tl.store(out + HALF, b.to(qr_ptr.dtype.element_ty), mask=hm)

    @jit
    def _attend_block(ql, qr, cache, b, n_rows, pos, m, wsum, acc, r, p, scale, R: tl.constexpr, P: tl.constexpr,
                      BN: tl.constexpr, F32_DOT: tl.constexpr):
        """The online softmax over cache rows [b*BN, (b+1)*BN): the tile's running max m, weight sum wsum and
        output acc."""
        j = b * BN + tl.arange(0, BN)
        j_ok = j < n_rows
        c = tl.load(cache + j[:, None] * (R + P) + r[None, :], mask=j_ok[:, None], other=0.0)
        kr = tl.load(cache + j[:, None] * (R + P) + R + p[None, :], mask=j_ok[:, None], other=0.0)
        s = mma(mma(tl.zeros((ql.shape[0], BN), tl.float32), ql, tl.trans(c), F32_DOT), qr, tl.trans(kr), F32_DOT)
        s = s * scale
        s = tl.where(j[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(s - m_safe[:, None])
        wsum = wsum * alpha + tl.sum(w, axis=1)
        acc = mma(acc * alpha[:, None], w.to(c.dtype), c, F32_DOT)
        return m_new, wsum, acc

    @jit
    def _mla_split_kernel(q_lat, q_rope, cache, positions, row_ptr, part_acc, part_ml, scale, T, H: tl.constexpr,
                          G: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, HAS_ROW: tl.constexpr, USE_PDL: tl.constexpr,
                          F32_DOT: tl.constexpr, COUNTED: tl.constexpr):
        """Program (split, head group): rows i < T*G of its tile are (query i // G, head group*G + i % G).
        HAS_ROW: the T queries are the inputs' rows from row_ptr[0] on (read on the device), not from 0.

        COUNTED (on a GPU): the blocks are walked by a for loop over a run-time count, which Triton's pipeliner
        prefetches (the next blocks' rows stream into shared memory while one is multiplied); Triton's
        interpreter cannot run such a loop (NumPy >= 2.4), so under it a while loop walks the same blocks."""
        wait_previous(USE_PDL)
        split = tl.program_id(0)
        i = tl.arange(0, BT)
        t = i // G
        head = tl.program_id(1) * G + i % G
        ok = i < T * G
        first_query = tl.load(row_ptr).to(tl.int32) if HAS_ROW else 0
        pos = tl.load(positions + first_query + t, mask=ok, other=-1)
        n_rows = tl.load(positions + first_query + T - 1) + 1  # rows to read: the last query sees the most
        n_blocks = tl.cdiv(n_rows, BN)
        per_split = tl.cdiv(n_blocks, NUM_SPLITS)
        r = tl.arange(0, R)
        p = tl.arange(0, P)
        row = t * H + head
        src = (first_query + t) * H + head
        ql = tl.load(q_lat + src[:, None] * R + r[None, :], mask=ok[:, None], other=0.0)
        qr = tl.load(q_rope + src[:, None] * P + p[None, :], mask=ok[:, None], other=0.0)
        m = tl.full([BT], float("-inf"), tl.float32)
        wsum = tl.zeros([BT], tl.float32)
        acc = tl.zeros([BT, R], tl.float32)
        first = split * per_split
        end = tl.minimum((split + 1) * per_split, n_blocks)
        if COUNTED:
            for b in range(first, end):
                m, wsum, acc = _attend_block(ql, qr, cache, b, n_rows, pos, m, wsum, acc, r, p, scale, R, P, BN,
                                             F32_DOT)
        else:
            b = first
            while b < end:
                m, wsum, acc = _attend_block(ql, qr, cache, b, n_rows, pos, m, wsum, acc, r, p, scale, R, P, BN,
                                             F32_DOT)
                b += 1
        base = split * T * H + row  # partials [split, T, H]: only the tile's real rows are written
        tl.store(part_acc + base[:, None] * R + r[None, :], acc, mask=ok[:, None])
        tl.store(part_ml + base * 2, m, mask=ok)
        tl.store(part_ml + base * 2 + 1, wsum, mask=ok)

    @jit
    def _mla_merge_kernel(part_acc, part_ml, out, wv_ptr, g_ptr, row_ptr, part_o, cnt_ptr, T, swv_h, swv_v, sg,
                          H: tl.constexpr, R: tl.constexpr, RBLK: tl.constexpr, V: tl.constexpr,
                          V_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, ABSORB: tl.constexpr,
                          HAS_ROW: tl.constexpr, USE_PDL: tl.constexpr):
        """Program (row = t * H + head, block of R): merges the splits' partial softmaxes over its block of the
        latent output. With ABSORB it goes on to the gated value output: its block's share of
        o_lat @ W_v[head]^T, published as an fp32 partial, and the last of the row's programs to arrive sums
        the shares in a fixed order, rounds, and multiplies by sigmoid(g[t, head]) (the model's bf16 roundings)."""
        row = tl.program_id(0)
        rb = tl.program_id(1)
        r = rb * RBLK + tl.arange(0, RBLK)
        v = tl.arange(0, V_PAD)
        head = row % H
        if ABSORB:  # W_v's tile is requested before waiting for the previous kernel (PDL)
            wv = tl.load(wv_ptr + head * swv_h + v[:, None] * swv_v + r[None, :], mask=v[:, None] < V, other=0.0)
        wait_previous(USE_PDL)
        s = tl.arange(0, NUM_SPLITS)
        base = s * T * H + row
        m = tl.load(part_ml + base * 2)
        wsum = tl.load(part_ml + base * 2 + 1)
        m_all = tl.max(m, axis=0)
        wgt = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
        denom = tl.sum(wsum * wgt, axis=0)
        acc = tl.load(part_acc + base[:, None] * R + r[None, :])
        o = tl.sum(acc * wgt[:, None], axis=0) / denom
        if ABSORB:
            o = o.to(wv_ptr.dtype.element_ty).to(tl.float32)  # the latent output in the activation dtype
            share = tl.sum(wv.to(tl.float32) * o[None, :], axis=1)
            tl.store(part_o + (rb * T * H + row) * V_PAD + v, share)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
            if arrived == R // RBLK - 1:
                y = tl.zeros((V_PAD,), tl.float32)
                for b in tl.static_range(R // RBLK):
                    y += tl.load(part_o + (b * T * H + row) * V_PAD + v, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + row, 0)
                dt = out.dtype.element_ty
                first_query = tl.load(row_ptr) if HAS_ROW else 0
                gate = tl.load(g_ptr + (first_query + row // H) * sg + head).to(tl.float32)
                gate = tl.sigmoid(gate).to(dt).to(tl.float32)
                tl.store(out + row * V + v, (y.to(dt).to(tl.float32) * gate).to(dt), mask=v < V)
        else:
            tl.store(out + row * R + r, o)


def mla_decode_triton(q_lat, q_rope, cache, positions, scale: float, w_v=None, gate=None,
                      num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                      heads: int | None = None, pdl: bool = False, row: torch.Tensor | None = None):
    """The kernel form of `mla_decode_reference` (fp32 output), or with w_v [H, V, R] and gate [T, H] (the gate
    projection's logits) that of `mla_attend_reference` ([T, H*V] in w_v's dtype). positions must be ascending
    (the last is the furthest), as the queries of one decode or verify step are. Unset knobs come from
    `CONFIGS`; `heads` (per program, a power of two dividing H) from `heads_per_program` unless set there.
    row: a device index [1]: the output is query row's alone ([1, ...]), read from the inputs' rows on the device
    (where `index_select` of each input cost a launch apiece)."""
    rows, h, r = q_lat.shape
    t = rows if row is None else 1  # the queries computed
    p = q_rope.shape[-1]
    splits, bn, warps, *tuned_heads = config_for(t, h)
    num_splits, block_n, num_warps = num_splits or splits, block_n or bn, num_warps or warps
    assert num_splits & (num_splits - 1) == 0, f"num_splits must be a power of two, got {num_splits}"
    g = heads or (tuned_heads[0] if tuned_heads else heads_per_program(t, h))
    assert g & (g - 1) == 0 and h % g == 0, f"heads per program must be a power of two dividing {h}, got {g}"
    bt = max(16, triton.next_power_of_2(t * g))  # tl.dot needs at least 16 rows
    dev = q_lat.device
    part_acc = torch.empty(num_splits, t, h, r, device=dev, dtype=torch.float32)
    part_ml = torch.empty(num_splits, t, h, 2, device=dev, dtype=torch.float32)
    q_lat, q_rope = q_lat.to(cache.dtype).contiguous(), q_rope.to(cache.dtype).contiguous()
    pdl = pdl and cache.is_cuda
    launch = {"launch_pdl": True} if pdl else {}
    has_row = row is not None
    row = row if has_row else positions  # unread without HAS_ROW
    _mla_split_kernel[(num_splits, h // g)](q_lat, q_rope, cache, positions, row, part_acc, part_ml, scale, t, H=h,
                                            G=g, R=r, P=p, BT=bt, BN=block_n, NUM_SPLITS=num_splits, HAS_ROW=has_row,
                                            USE_PDL=pdl_mode(pdl, "mla", t), F32_DOT=INTERPRET, COUNTED=not INTERPRET,
                                            num_warps=num_warps, **launch)
    rblk = min(MERGE_BLOCK, r)
    absorb = w_v is not None
    if absorb:
        v = w_v.shape[1]
        assert w_v.shape == (h, v, r) and w_v.stride(2) == 1 and gate.shape == (rows, h) and gate.stride(1) == 1
        v_pad = triton.next_power_of_2(v)
        out = torch.empty(t, h * v, device=dev, dtype=w_v.dtype)
        part_o = torch.empty(r // rblk, t, h, v_pad, device=dev, dtype=torch.float32)
        strides = (w_v.stride(0), w_v.stride(1), gate.stride(0))
    else:
        v = v_pad = 1
        out = torch.empty(t, h, r, device=dev, dtype=torch.float32)
        w_v = gate = part_o = out  # unused
        strides = (0, 0, 0)
    _mla_merge_kernel[(t * h, r // rblk)](part_acc, part_ml, out, w_v, gate, row, part_o, counters(dev, t * h), t,
                                          *strides, H=h, R=r, RBLK=rblk, V=v, V_PAD=v_pad, NUM_SPLITS=num_splits,
                                          ABSORB=absorb, HAS_ROW=has_row, USE_PDL=pdl_mode(pdl, "mla", t), **launch)
    return out


MAX_QUERIES = 16  # the kernel keeps a step's queries in registers: decode and verify steps, not prefills
MERGE_BLOCK = 64  # latent columns per merge program (R / 64 programs per query and head)


def _kernel_serves(q_lat, q_rope, cache) -> bool:
    """CUDA decode/verify steps whose latent and rope widths fit an MMA (K >= 16; tiny test models do not)."""
    return (triton is not None and cache.is_cuda and q_lat.shape[0] <= MAX_QUERIES and q_lat.shape[-1] >= 16
            and q_rope.shape[-1] >= 16)


def mla_decode(q_lat, q_rope, cache, positions, scale: float, pdl: bool = False):
    """Latent attention output [T, H, R] fp32: the kernel for CUDA decode/verify steps, the reference otherwise."""
    if _kernel_serves(q_lat, q_rope, cache):
        return mla_decode_triton(q_lat, q_rope, cache, positions, scale, pdl=pdl)
    return mla_decode_reference(q_lat, q_rope, cache, positions, scale)


def mla_attend_reference(q_lat, q_rope, cache, positions, scale: float, w_v, gate, row=None):
    """The gated value output [T, H*V] of the absorbed attention, with the model's roundings: the latent output
    in w_v's dtype, its product with W_v [H, V, R] (fp32 sums, one rounding), times sigmoid(gate [T, H]).
    row: a device index [1]: that query's output alone [1, H*V]."""
    if row is not None:
        q_lat, q_rope, positions, gate = (x.index_select(0, row) for x in (q_lat, q_rope, positions, gate))
    dt = w_v.dtype
    o_lat = mla_decode_reference(q_lat, q_rope, cache, positions, scale).to(dt)
    o = torch.einsum("thr,hvr->thv", o_lat.float(), w_v.float()).to(dt)
    return (o * torch.sigmoid(gate.float()).to(dt).unsqueeze(-1)).reshape(o.shape[0], -1)


def mla_attend(q_lat, q_rope, cache, positions, scale: float, w_v, gate, pdl: bool = False, row=None):
    """`mla_attend_reference`: the kernels (split, then merge with W_v and the gate) for CUDA decode/verify steps,
    the reference otherwise."""
    if _kernel_serves(q_lat, q_rope, cache):
        return mla_decode_triton(q_lat, q_rope, cache, positions, scale, w_v, gate, pdl=pdl, row=row)
    return mla_attend_reference(q_lat, q_rope, cache, positions, scale, w_v, gate, row)


def mla_prologue_reference(q, kv, norm_w, eps: float, inv_freq, cache, positions, heads: int, nope: int,
                           interleave: bool, w_k):
    """q [T, H*(nope+rope)], kv [T, rank+rope] (this step's projections), inv_freq [rope/2] fp32 (the rope
    frequencies, `reference.rope_inv_freq`), w_k [H, nope, rank]: writes [rms_norm(c) | rope(k_rope)] into
    cache[positions] and returns the absorbed queries q_lat = q_nope @ W_k [T, H, rank] and the rotated ones
    q_rope [T, H, rope], in the cache's dtype. Rope in fp32, one rounding (the model's eager form rotates in the
    activation dtype)."""
    t, rank = kv.shape[0], norm_w.shape[0]
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    c = ref.rms_norm(kv[:, :rank], norm_w, eps)
    k_rope = ref.apply_rope(kv[:, rank:].float(), cos, sin, interleave)
    cache.index_copy_(0, positions, torch.cat([c.to(cache.dtype), k_rope.to(cache.dtype)], dim=-1))
    q = q.reshape(t, heads, -1)
    q_lat = torch.einsum("thn,hnr->thr", q[..., :nope].float(), w_k.float()).to(cache.dtype)
    return q_lat, ref.apply_rope(q[..., nope:].float(), cos, sin, interleave, heads=True).to(cache.dtype)


def mla_prologue(q, kv, norm_w, eps: float, inv_freq, cache, positions, heads: int, nope: int, interleave: bool,
                 w_k, pdl: bool = False):
    """The one-launch form of `mla_prologue_reference` (CUDA tensors, or CPU under TRITON_INTERPRET=1): one
    program per token for its cache row and rotated queries (the rope angles computed from its position,
    which saves the step four elementwise launches), one per (head, 64 latent columns) for q_lat.
    pdl: programmatic dependent launch."""
    t, rank = kv.shape[0], norm_w.shape[0]
    rope = kv.shape[1] - rank
    assert q.stride(1) == 1 and kv.stride(1) == 1 and cache.stride(1) == 1 and rope % 2 == 0 and t <= MAX_QUERIES
    assert w_k.shape == (heads, nope, rank) and w_k.stride(2) == 1
    q_rope = torch.empty(t, heads, rope, device=kv.device, dtype=cache.dtype)
    q_lat = torch.empty(t, heads, rank, device=kv.device, dtype=cache.dtype)
    r_pad = triton.next_power_of_2(rank)
    rblk = max(16, min(MERGE_BLOCK, r_pad))  # tl.dot needs at least 16 columns
    _mla_prologue_kernel[(t + heads * triton.cdiv(r_pad, rblk),)](
        q, kv, norm_w, inv_freq, positions, cache, q_rope, w_k, q_lat,
        t, q.stride(0), kv.stride(0), cache.stride(0), w_k.stride(0), w_k.stride(1), float(eps), H=heads,
        H_PAD=triton.next_power_of_2(heads), NOPE=nope, NOPE_PAD=max(16, triton.next_power_of_2(nope)), R=rank,
        R_PAD=max(r_pad, rblk), RBLK=rblk, HALF=rope // 2, HALF_PAD=triton.next_power_of_2(rope // 2),
        INTERLEAVE=interleave, USE_PDL=pdl_mode(pdl and kv.is_cuda, "mla", t), F32_DOT=INTERPRET, num_warps=4,
        **({"launch_pdl": True} if pdl and kv.is_cuda else {}))
    return q_lat, q_rope
