"""Plain-torch references of every op in a Ling-3.0 step.

These are the definitions: the model uses them on CPU and whenever no fused kernel applies, and every fast
kernel in this package is tested against them. Shapes use B (batch), T (tokens), H (heads), D (head size).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, cast back before the weight multiply (as the checkpoint was trained)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: RMSNorm over each head's D channels, times sigmoid(gate), all in fp32."""
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (of * torch.sigmoid(gate.float())).to(o.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (eps inside the sqrt, as fla and the checkpoint use)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
             safe_gate: bool = True) -> torch.Tensor:
    """Per-channel log decay g in (lower_bound, 0), fp32. f: [..., H, D]; a_log: [H]; dt_bias: [H*D]."""
    h, d = f.shape[-2:]
    x = f.float() + dt_bias.float().view(h, d)
    rate = a_log.float().exp().view(h, 1)
    if safe_gate:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x)


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                     end: torch.Tensor | None = None):
    """Depthwise causal conv + SiLU over time.

    x: [B, T, C]; weight: [C, K]; state: [B, C, K-1] (the K-1 inputs before x) or None for zeros; end: a device
    scalar n <= T for inputs padded after their first n steps: the new state is then the K-1 inputs before step n.
    Returns (y [B, T, C], new_state [B, C, K-1]).
    """
    b, t, c = x.shape
    k = weight.shape[-1]
    ext = _conv_inputs(x, state, k)
    y = F.conv1d(ext.to(weight.dtype), weight.unsqueeze(1), groups=c)  # [B, C, T]
    if end is not None:
        return F.silu(y).to(x.dtype).transpose(1, 2), _conv_window(ext, end, k)
    return F.silu(y).to(x.dtype).transpose(1, 2), ext[..., ext.shape[-1] - (k - 1):]


def conv_state_after(x: torch.Tensor, state: torch.Tensor | None, end: torch.Tensor, kernel: int) -> torch.Tensor:
    """The conv state [B, C, K-1] after the first `end` (device scalar) of the inputs x [B, T, C], from `state`
    (the K-1 inputs before x, or None for zeros): `causal_conv_silu`'s new state without its convolution."""
    return _conv_window(_conv_inputs(x, state, kernel), end, kernel)


def _conv_inputs(x, state, k):
    """[state | x^T]: [B, C, K-1+T], the inputs a causal conv of K taps reads."""
    xt = x.transpose(1, 2)
    if state is None:
        state = xt.new_zeros(x.shape[0], x.shape[2], k - 1)
    return torch.cat([state.to(xt.dtype), xt], dim=-1)


def _conv_window(ext, end, k):
    """ext[..., n : n + K-1], n on the device (no host read)."""
    return ext.index_select(-1, end + torch.arange(k - 1, device=ext.device))


def kda_recurrent(q, k, v, g, beta, state):
    """The delta rule with per-channel decay, one token at a time (the definition).

    q, k: [B, T, H, Dk] already L2-normalised, q already scaled; v: [B, T, H, Dv]; g: [B, T, H, Dk] log decay;
    beta: [B, T, H]; state: [B, H, Dk, Dv] fp32. Returns (o [B, T, H, Dv] fp32, final state).
    """
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    s = state.float()
    out = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp().unsqueeze(-1)
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t])
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, t], err * beta[:, t].unsqueeze(-1))
        out.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    return torch.stack(out, dim=1), s


def kda_chunked(q, k, v, g, beta, state, chunk: int = 16, lower_bound: float | None = None,
                scan: bool | None = None):
    """The same function as `kda_recurrent`, computed a chunk at a time (for long prefills).

    Within a chunk, with G_t the cumulative log decay, the state's corrections u_t solve a unit lower-triangular
    system (I + A) U = beta * (V - (k e^G) S0), A[t, s] = beta_t <k_t e^G_t, k_s e^-G_s> for s < t, and the
    outputs are (q e^G) S0 + M U with M[t, s] = <q_t e^G_t, k_s e^-G_s> for s <= t. Splitting e^(G_t - G_s) into
    e^G_t e^-G_s turns both into matrix products; it stays finite in fp32 while a chunk's total decay is under
    ~80 nats, so the chunk is shortened when the gates are steep (16 steps at Ling's bound of -5). Everything
    that does not depend on the incoming state is computed for all chunks at once; only the state is carried
    from chunk to chunk, by a loop or a parallel scan (`scan`; default: the scan on CUDA, the loop elsewhere).
    """
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    b, t_len, h, dk = k.shape
    # the steepest step decay: known from the gate's bound when it has one, else read from g (a host sync)
    if lower_bound is not None:
        steepest = -lower_bound
    else:
        steepest = float(-g.detach().min()) if g.numel() else 0.0
    c = max(1, min(chunk, int(80.0 // steepest) if steepest > 0 else chunk))
    pad = -t_len % c
    if pad:  # padded steps: no decay (g = 0) and no write (beta = 0), so the state passes through unchanged
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (t_len + pad) // c
    q, k, v, g = (x.view(b, n, c, h, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))  # [B, H, N, C, D]
    beta = beta.view(b, n, c, h).permute(0, 3, 1, 2).unsqueeze(-1)  # [B, H, N, C, 1]
    cum = g.cumsum(dim=3)
    k_fwd, k_back, q_fwd = k * cum.exp(), k * (-cum).exp(), q * cum.exp()
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    a = (beta * (k_fwd @ k_back.transpose(-1, -2))).masked_fill(~lower.tril(-1), 0.0)
    m = (q_fwd @ k_back.transpose(-1, -2)).masked_fill(~lower, 0.0)
    eye = torch.eye(c, dtype=a.dtype, device=a.device)
    solve = torch.linalg.solve_triangular(eye + a, torch.cat([beta * v, beta * k_fwd], dim=-1), upper=False,
                                          unitriangular=True)
    u_free, u_state = solve.split([v.shape[-1], dk], dim=-1)  # U = u_free - u_state @ S0
    decay_to_end = (cum[:, :, :, -1:] - cum).exp()  # [B, H, N, C, Dk], every exponent <= 0
    carry = _carry_scan if (q.is_cuda if scan is None else scan) else _carry_loop
    o, s = carry(state.float(), q_fwd, m, u_free, u_state, (k * decay_to_end).transpose(-1, -2), cum[:, :, :, -1])
    return o.permute(0, 2, 3, 1, 4).reshape(b, n * c, h, -1)[:, :t_len], s


def _carry_loop(s, q_fwd, m, u_free, u_state, k_end, chunk_decay):
    """Chunk by chunk: N small steps; the cheapest on a CPU, where the work rather than launches counts."""
    outs = []
    for i in range(q_fwd.shape[2]):
        u = u_free[:, :, i] - u_state[:, :, i] @ s
        outs.append(q_fwd[:, :, i] @ s + m[:, :, i] @ u)
        s = s * chunk_decay[:, :, i].exp().unsqueeze(-1) + k_end[:, :, i] @ u
    return torch.stack(outs, dim=2), s


def _carry_scan(s0, q_fwd, m, u_free, u_state, k_end, chunk_decay):
    """All chunks at once: chunk i maps its incoming state affinely, S_{i+1} = P_i S_i + Q_i (with U_i = u_free
    - u_state S_i substituted), and a parallel scan composes the maps in log2(N) batched steps. More arithmetic
    than the loop but a few dozen launches instead of hundreds: the form for GPUs (training, long prefills)."""
    n, dk = q_fwd.shape[2], q_fwd.shape[-1]
    maps = torch.cat([torch.diag_embed(chunk_decay.exp()) - k_end @ u_state, k_end @ u_free], dim=-1)
    shift = 1
    while shift < n:  # Hillis-Steele: afterwards maps[i] is chunks max(0, i-2*shift+1) .. i composed
        later, earlier = maps[:, :, shift:], maps[:, :, :-shift]
        composed = later[..., :dk] @ earlier + F.pad(later[..., dk:], (dk, 0))
        maps = torch.cat([maps[:, :, :shift], composed], dim=2)
        shift *= 2
    s0 = s0.unsqueeze(2)  # [B, H, 1, Dk, Dv]
    after = maps[..., :dk] @ s0 + maps[..., dk:]  # the state after each chunk
    starts = torch.cat([s0, after[:, :, :-1]], dim=2)
    return q_fwd @ starts + m @ (u_free - u_state @ starts), after[:, :, -1]


@functools.lru_cache(maxsize=16)
def rope_inv_freq(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """Rope frequencies, computed once per (dim, theta, device): every MLA layer of every step reuses them."""
    with torch.inference_mode(False):
        return 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float):
    """cos, sin of each rotated pair's angle: [T, dim/2] fp32."""
    angles = positions.float()[:, None] * rope_inv_freq(dim, theta, positions.device)[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = True,
               heads: bool = False) -> torch.Tensor:
    """Rotate x [..., T, dim] (or [..., T, H, dim] with heads=True) by per-token angles cos/sin [T, dim/2].

    Interleaved pairs (x0, x1), (x2, x3), ... are rotated and written out as [evens | odds]: the layout is
    immaterial to q.k as long as queries and keys share it, and it matches the reference implementation.
    """
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    if heads:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def route_grouped_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                       normalize: bool, scale: float):
    """Ling's sigmoid router: choose with score + bias inside the best groups, weigh with the unbiased score.

    logits: [N, E] fp32. Returns (weights [N, top_k] fp32, indices [N, top_k]).
    """
    scores = logits.sigmoid()
    choice = scores + bias.float()
    n, e = choice.shape
    grouped = choice.view(n, n_group, e // n_group)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
    choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    idx = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if normalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, idx


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """silu(gate) * up, with Ling's optional clamp min(silu(gate), L) * clamp(up, -L, L) when limit > 0."""
    act = F.silu(gate)
    if limit > 0:
        act = act.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return act * up


def uniform_hash(seed: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniform floats in (0, 1) from int64 seed [1], positions [T, 1] and token ids [T, V] (or broadcastable):
    the counter-based random stream every sampler of the project draws from (torch and Triton alike)."""
    m32 = 0xFFFFFFFF
    x = (ids * 0x9E3779B1 + positions * 0x85EBCA77 + seed * 0xC2B2AE3D) & m32
    x = (((x >> 16) ^ x) * 0x045D9F3B) & m32
    x = (((x >> 16) ^ x) * 0x045D9F3B) & m32
    x = (x >> 16) ^ x
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))
