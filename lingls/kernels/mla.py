"""MLA decode over the latent cache with absorbed weights, split over the sequence (batch 1, T <= 16 queries).

Each cache row is [c (rank) | k_rope (rope)]. A query t of head h scores row j as
    s = scale * (q_lat[t, h] . c_j + q_rope[t, h] . k_rope_j),   visible iff j <= positions[t],
and returns sum_j softmax(s)_j c_j (the latent output; W_v is applied after, by the caller).

The kernel splits the rows into NUM_SPLITS ranges, one program per (range, head): every program of a range
reads the same rows, so the cache crosses HBM about once and the other heads hit L2. The number of rows to
read comes from `positions` on the device (the last query's position + 1), so a CUDA graph captured once
serves every length up to the cache's capacity without the host ever learning the length. A second small
kernel merges the ranges' partial softmaxes.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves
    triton = None


def mla_decode_reference(q_lat, q_rope, cache, positions, scale: float):
    """q_lat [T, H, R], q_rope [T, H, P], cache [N, R + P], positions [T] -> latent output [T, H, R] (fp32)."""
    r = q_lat.shape[-1]
    keys = cache.float()
    scores = (torch.einsum("thr,jr->thj", q_lat.float(), keys[:, :r])
              + torch.einsum("thp,jp->thj", q_rope.float(), keys[:, r:])) * scale
    visible = torch.arange(cache.shape[0], device=cache.device)[None, :] <= positions[:, None]
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("thj,jr->thr", probs, keys[:, :r])


if triton is not None:

    @triton.jit
    def _mla_split_kernel(q_lat, q_rope, cache, positions, part_acc, part_ml, scale, T, H: tl.constexpr,
                          R: tl.constexpr, P: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                          NUM_SPLITS: tl.constexpr):
        split = tl.program_id(0)
        head = tl.program_id(1)
        t = tl.arange(0, BT)
        t_ok = t < T
        pos = tl.load(positions + t, mask=t_ok, other=-1)
        n_rows = tl.load(positions + T - 1) + 1  # rows to read: the last query sees the most
        n_blocks = tl.cdiv(n_rows, BN)
        per_split = tl.cdiv(n_blocks, NUM_SPLITS)
        r = tl.arange(0, R)
        p = tl.arange(0, P)
        ql = tl.load(q_lat + (t[:, None] * H + head) * R + r[None, :], mask=t_ok[:, None], other=0.0)
        qr = tl.load(q_rope + (t[:, None] * H + head) * P + p[None, :], mask=t_ok[:, None], other=0.0)
        m = tl.full([BT], float("-inf"), tl.float32)
        l = tl.zeros([BT], tl.float32)
        acc = tl.zeros([BT, R], tl.float32)
        b = split * per_split
        end = tl.minimum((split + 1) * per_split, n_blocks)
        while b < end:  # a while loop: its bound is a device value (Triton's interpreter rejects it in range())
            j = b * BN + tl.arange(0, BN)
            j_ok = j < n_rows
            c = tl.load(cache + j[:, None] * (R + P) + r[None, :], mask=j_ok[:, None], other=0.0)
            kr = tl.load(cache + j[:, None] * (R + P) + R + p[None, :], mask=j_ok[:, None], other=0.0)
            s = tl.dot(ql, tl.trans(c)) + tl.dot(qr, tl.trans(kr))
            s = s * scale
            s = tl.where(j[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            w = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(w, axis=1)
            acc = acc * alpha[:, None] + tl.dot(w.to(c.dtype), c)
            m = m_new
            b += 1
        base = (split * H + head) * BT + t
        tl.store(part_acc + base[:, None] * R + r[None, :], acc)
        tl.store(part_ml + base * 2, m)
        tl.store(part_ml + base * 2 + 1, l)

    @triton.jit
    def _mla_merge_kernel(part_acc, part_ml, out, H: tl.constexpr, R: tl.constexpr, BT: tl.constexpr,
                          NUM_SPLITS: tl.constexpr):
        t = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, NUM_SPLITS)
        base = (s * H + head) * BT + t
        m = tl.load(part_ml + base * 2)
        l = tl.load(part_ml + base * 2 + 1)
        m_all = tl.max(m, axis=0)
        wgt = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
        denom = tl.sum(l * wgt, axis=0)
        r = tl.arange(0, R)
        acc = tl.load(part_acc + base[:, None] * R + r[None, :])
        o = tl.sum(acc * wgt[:, None], axis=0) / denom
        tl.store(out + (t * H + head) * R + r, o)


def mla_decode_triton(q_lat, q_rope, cache, positions, scale: float, num_splits: int = 16, block_n: int = 32):
    """The kernel form of `mla_decode_reference` (fp32 output). positions must be ascending (the last is the
    furthest), as the queries of one decode or verify step are."""
    t, h, r = q_lat.shape
    p = q_rope.shape[-1]
    bt = max(16, triton.next_power_of_2(t))  # tl.dot needs at least 16 rows
    dev = q_lat.device
    part_acc = torch.empty(num_splits, h, bt, r, device=dev, dtype=torch.float32)
    part_ml = torch.empty(num_splits, h, bt, 2, device=dev, dtype=torch.float32)
    out = torch.empty(t, h, r, device=dev, dtype=torch.float32)
    q_lat, q_rope = q_lat.to(cache.dtype).contiguous(), q_rope.to(cache.dtype).contiguous()
    _mla_split_kernel[(num_splits, h)](q_lat, q_rope, cache, positions, part_acc, part_ml, scale, t, H=h, R=r, P=p,
                                       BT=bt, BN=block_n, NUM_SPLITS=num_splits)
    _mla_merge_kernel[(t, h)](part_acc, part_ml, out, H=h, R=r, BT=bt, NUM_SPLITS=num_splits)
    return out


MAX_QUERIES = 16  # the kernel keeps a step's queries in registers: decode and verify steps, not prefills


def mla_decode(q_lat, q_rope, cache, positions, scale: float):
    """Latent attention output [T, H, R] fp32: the kernel for CUDA decode/verify steps, the reference otherwise."""
    if triton is not None and cache.is_cuda and q_lat.shape[0] <= MAX_QUERIES:
        return mla_decode_triton(q_lat, q_rope, cache, positions, scale)
    return mla_decode_reference(q_lat, q_rope, cache, positions, scale)
