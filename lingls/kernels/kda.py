"""Fused batch-1 KDA layer step: short conv + SiLU, q/k L2 norm, gate, delta rule and gated output norm in one
Triton launch for T = 1..MAX_TOKENS tokens, plus the on-device commit of a staged (speculative) state.

Why one kernel: at batch 1 a KDA layer's step moves ~1 MiB (the fp32 state of 8 heads x 128 x 128 per TP=4
rank, read and written) and does almost no math, so the separate conv, norm, gate, recurrence and output-norm
launches of the torch form cost far more in launch gaps and round trips through memory than the work itself.

Parallel layout: the delta rule's value columns are independent (S's column j only ever mixes with v_j), so the
grid is (head, block of `block_v` value columns). Each program recomputes its head's conv, SiLU, q/k L2 norm and
gate over all D key channels (D-vectors: cheap) and keeps its [D, block_v] slice of the state in registers for
all T tokens; H=8, D=128, block_v=16 gives 64 programs instead of 8.

Two things need a whole head, which no single program owns:
- the q/k conv state: every program of a head reads it, so no program may overwrite it while another might
  still read it;
- the gated RMSNorm of the output, over all D value channels of a head.
Both are done by the *last arriving* program of the head: each program writes its fp32 slice of o to a
scratch buffer, passes a CTA barrier and increments the head's arrival counter (acq_rel, gpu scope); the one
that sees NV-1 knows every other program of its head has finished reading the conv state and writing o, so
it writes the new q/k conv state, normalises the head's o (RMSNorm_D(o) * w * sigmoid(z), fp32) and resets
the counter. There is no spinning, so it cannot deadlock and runs unchanged in Triton's interpreter. The norm
therefore lives inside this kernel (not in norm.py): a separate launch per layer would cost ~1-2 us x 35 layers
per step, more than the norm's work; pass `norm_weight=None` to get the raw fp32 o instead (e.g. to fold the
norm into the next GEMV's prologue).

Speculative verification: with `stage=(stage_state [>=T, H, 4, D] fp32, stage_conv [>=T, 3, C])` the live
state and conv state are only read; what the recurrence consumed at every position t (STAGE_ROWS: the
normalised key, the log decay, the value, beta) goes to stage_state[t] and the conv's input at t (the projected
q, k, v row) to stage_conv[t]. `commit(index, ...)` then replays the recurrence over positions 0..index from the
live state and rebuilds the conv windows after position index from the live windows and the staged inputs,
reading `index` on device, so the host never waits for the accepted count; it takes a leading layer dim, so one
launch commits all layers. Staging the inputs rather than the windows after every position stores a third of
the bytes, and lets each store take the layout its row was loaded in (a window's stride-3 slots needed a
shuffle of the row through shared memory per slot and position). Why inputs and a replay rather than the state
after every position: that state is H*D*D fp32 per position (9 MB per layer at TP=2 for a 9-token verify)
against 4*H*D here, and writing it cost ~0.19 ms of a 5 ms verify step on one H200 (TP=4 shard); the replay
reads the state once, as the copy did, and adds T dependent updates.

Programmatic dependent launch (pdl=True, CUDA only): a kernel loads its weights (conv taps, A_log, dt_bias)
and its layer's recurrent and conv states, then `gdc_wait`s for the previous kernel before touching what that
kernel may write (the projected inputs, the scratch and counters). The states are safe to read early: their
only writers are this layer's previous step, the commit and prefill, never the kernel just before (the layer's
input projection), and between any of them and this launch sit a graph boundary or MoE launches that let
their successor launch only after their own wait (`pdl` never makes the routing or gate-up EARLY), which
orders everything before them. With `pdl.EARLY` the next kernel may launch before this one's wait, so it can
load its own weights while this one runs.
"""

from __future__ import annotations

import torch

from lingls.kernels import by_width, by_width_and_tokens, jit, tl, triton, tuned
from lingls.kernels import reference as ref
from lingls.kernels.pdl import mode as pdl_mode
from lingls.kernels.pdl import wait_previous

MAX_TOKENS = 64  # one step's tokens; the model switches to the chunked form at 64
CONV_KERNEL = 4  # Ling's short_conv_kernel_size; the kernel keeps the last 3 inputs in registers


# ---------------------------------------------------------------------------------------------------------
# KDA step


@jit
def sigmoid(x):
    """1 / (1 + exp(-x)) with the approximate division (div.full, 2 ulp): the IEEE one Triton's tl.sigmoid emits
    costs a range check and a slow path per element, and the token loop is a chain of such instructions."""
    return tl.fdiv(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x))


@jit
def conv_silu(w0, w1, w2, w3, x0, x1, x2, x):
    """One causal-conv output (taps w0..w3 over inputs x0, x1, x2, x oldest first) then SiLU, fp32."""
    y = w0 * x0 + w1 * x1 + w2 * x2 + w3 * x
    return y * sigmoid(y)


STAGE_ROWS = 4  # per position and head: normalised key, log decay, value, beta (broadcast over D)
_ROWS = tl.constexpr(STAGE_ROWS) if tl is not None else STAGE_ROWS  # the same, as the kernels read it


@jit
def _stage_inputs(st, dk, dv, kt, gate, vt, beta, j, D: tl.constexpr):
    """One position's recurrence inputs for head h at st ([STAGE_ROWS, D]): the head's first program writes the
    key, the log decay and beta, every program its value columns."""
    first = (dk < D) & (j == 0)
    tl.store(st + dk, kt, mask=first)
    tl.store(st + D + dk, gate, mask=first)
    tl.store(st + 2 * D + dv, vt)
    tl.store(st + 3 * D + dk, tl.zeros_like(kt) + beta, mask=first)


@jit
def delta_rule(S, kt, decay, vt, beta):
    """One position's state update, the step kernel's and the commit's replay: S' = P + k (beta (v - P^T k))^T
    with P = diag(decay) S. Returns (P, the error beta (v - P^T k), S')."""
    P = S * decay[:, None]
    err = beta * (vt - tl.sum(P * kt[:, None], 0))
    return P, err, P + kt[:, None] * err[None, :]


@jit
def _token_rows(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, sq, sk, sv, sf, sb, t, ck, cv, h, live):
    """Token t's rows of q, k, f (the head's D channels), v (the program's columns) and its beta logit, as
    stored (nothing is read when not live)."""
    return (tl.load(q_ptr + t * sq + ck, mask=live, other=0.0), tl.load(k_ptr + t * sk + ck, mask=live, other=0.0),
            tl.load(v_ptr + t * sv + cv, mask=live, other=0.0), tl.load(f_ptr + t * sf + ck, mask=live, other=0.0),
            tl.load(b_ptr + t * sb + h, mask=live, other=0.0))


@jit
def _kda_step_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, z_ptr, sq, sk, sv, sf, sb, sz,
    conv_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr, state_ptr,
    out_ptr, s_out, o_acc_ptr, count_ptr, stage_state_ptr, stage_conv_ptr,
    q_scale, lower_bound, eps,
    T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    STAGE: tl.constexpr, NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    h = tl.program_id(0)
    j = tl.program_id(1)
    NV: tl.constexpr = D // BV
    C: tl.constexpr = H * D
    dk = tl.arange(0, D)
    dv = j * BV + tl.arange(0, BV)
    ck = h * D + dk  # this head's q/k/f/z channels
    cv = h * D + dv  # this program's v channels
    # conv taps [3, C, 4] and the gate's constants: weights, safe to load before the previous kernel ends
    wq0 = tl.load(conv_w_ptr + ck * 4 + 0).to(tl.float32)
    wq1 = tl.load(conv_w_ptr + ck * 4 + 1).to(tl.float32)
    wq2 = tl.load(conv_w_ptr + ck * 4 + 2).to(tl.float32)
    wq3 = tl.load(conv_w_ptr + ck * 4 + 3).to(tl.float32)
    wk0 = tl.load(conv_w_ptr + (C + ck) * 4 + 0).to(tl.float32)
    wk1 = tl.load(conv_w_ptr + (C + ck) * 4 + 1).to(tl.float32)
    wk2 = tl.load(conv_w_ptr + (C + ck) * 4 + 2).to(tl.float32)
    wk3 = tl.load(conv_w_ptr + (C + ck) * 4 + 3).to(tl.float32)
    wv0 = tl.load(conv_w_ptr + (2 * C + cv) * 4 + 0).to(tl.float32)
    wv1 = tl.load(conv_w_ptr + (2 * C + cv) * 4 + 1).to(tl.float32)
    wv2 = tl.load(conv_w_ptr + (2 * C + cv) * 4 + 2).to(tl.float32)
    wv3 = tl.load(conv_w_ptr + (2 * C + cv) * 4 + 3).to(tl.float32)
    rate = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + ck).to(tl.float32)
    # conv state [3, C, 3], oldest input first; kept as three sliding registers per stream
    xq0 = tl.load(conv_ptr + ck * 3 + 0).to(tl.float32)
    xq1 = tl.load(conv_ptr + ck * 3 + 1).to(tl.float32)
    xq2 = tl.load(conv_ptr + ck * 3 + 2).to(tl.float32)
    xk0 = tl.load(conv_ptr + (C + ck) * 3 + 0).to(tl.float32)
    xk1 = tl.load(conv_ptr + (C + ck) * 3 + 1).to(tl.float32)
    xk2 = tl.load(conv_ptr + (C + ck) * 3 + 2).to(tl.float32)
    xv0 = tl.load(conv_ptr + (2 * C + cv) * 3 + 0).to(tl.float32)
    xv1 = tl.load(conv_ptr + (2 * C + cv) * 3 + 1).to(tl.float32)
    xv2 = tl.load(conv_ptr + (2 * C + cv) * 3 + 2).to(tl.float32)
    s_off = h * D * D + dk[:, None] * D + dv[None, :]
    S = tl.load(state_ptr + s_off)  # [D, BV] fp32
    wait_previous(USE_PDL)

    # each token's input rows are requested one token ahead, so their latency overlaps the previous token's
    # reductions instead of starting every token's dependency chain
    nq, nk, nv, nf, nb = _token_rows(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, sq, sk, sv, sf, sb, 0, ck, cv, h, True)
    for t in range(T):
        xq, xk, xv, f, b = nq.to(tl.float32), nk.to(tl.float32), nv.to(tl.float32), nf.to(tl.float32), nb
        nq, nk, nv, nf, nb = _token_rows(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, sq, sk, sv, sf, sb, t + 1, ck, cv, h,
                                         t + 1 < T)
        qt = conv_silu(wq0, wq1, wq2, wq3, xq0, xq1, xq2, xq)
        kt = conv_silu(wk0, wk1, wk2, wk3, xk0, xk1, xk2, xk)
        vt = conv_silu(wv0, wv1, wv2, wv3, xv0, xv1, xv2, xv)
        xq0, xq1, xq2 = xq1, xq2, xq
        xk0, xk1, xk2 = xk1, xk2, xk
        xv0, xv1, xv2 = xv1, xv2, xv
        qt = qt * (tl.rsqrt(tl.sum(qt * qt, 0) + 1e-6) * q_scale)
        kt = kt * tl.rsqrt(tl.sum(kt * kt, 0) + 1e-6)
        gate = lower_bound * sigmoid(rate * (f + dt_bias))  # log decay
        decay = tl.exp(gate)
        beta = sigmoid(b.to(tl.float32))
        # o = S'^T q = P^T q + (k.q) err: its reduction reads the decayed state P, as the update's does, so the
        # two are independent and their latencies overlap
        P, err, S = delta_rule(S, kt, decay, vt, beta)
        o = tl.sum(P * qt[:, None], 0) + tl.sum(qt * kt, 0) * err
        if NORM:
            tl.store(o_acc_ptr + t * C + cv, o)
        else:
            tl.store(out_ptr + t * s_out + cv, o.to(out_ptr.dtype.element_ty))
        if STAGE:
            _stage_inputs(stage_state_ptr + (t * H + h) * _ROWS * D, dk, dv, kt, gate, vt, beta, j, D)
            sc = stage_conv_ptr + t * 3 * C
            sty = stage_conv_ptr.dtype.element_ty
            tl.store(sc + 2 * C + cv, xv.to(sty))
            first = (dk < D) & (j == 0)  # one program per head writes the q/k inputs
            tl.store(sc + ck, xq.to(sty), mask=first)
            tl.store(sc + C + ck, xk.to(sty), mask=first)

    ety = conv_ptr.dtype.element_ty
    if not STAGE:  # this program's own columns: nobody else reads them
        tl.store(state_ptr + s_off, S)
        tl.store(conv_ptr + (2 * C + cv) * 3 + 0, xv0.to(ety))
        tl.store(conv_ptr + (2 * C + cv) * 3 + 1, xv1.to(ety))
        tl.store(conv_ptr + (2 * C + cv) * 3 + 2, xv2.to(ety))
    if NORM or not STAGE:
        # last arriver of the head: all reads of the q/k conv state and all o writes of its peers are done
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + h, 1, sem="acq_rel", scope="gpu")
        if arrived == NV - 1:
            tl.atomic_xchg(count_ptr + h, 0, sem="relaxed", scope="gpu")
            if not STAGE:
                tl.store(conv_ptr + ck * 3 + 0, xq0.to(ety))
                tl.store(conv_ptr + ck * 3 + 1, xq1.to(ety))
                tl.store(conv_ptr + ck * 3 + 2, xq2.to(ety))
                tl.store(conv_ptr + (C + ck) * 3 + 0, xk0.to(ety))
                tl.store(conv_ptr + (C + ck) * 3 + 1, xk1.to(ety))
                tl.store(conv_ptr + (C + ck) * 3 + 2, xk2.to(ety))
            if NORM:
                rows = tl.arange(0, BT)
                m = (rows[:, None] < T) & (dk[None, :] < D)
                oh = tl.load(o_acc_ptr + rows[:, None] * C + ck[None, :], mask=m, other=0.0, cache_modifier=".cg")
                zh = tl.load(z_ptr + rows[:, None] * sz + ck[None, :], mask=m, other=0.0).to(tl.float32)
                w = tl.load(norm_w_ptr + dk).to(tl.float32)
                rms = tl.rsqrt(tl.sum(oh * oh, 1) / D + eps)
                y = oh * rms[:, None] * w[None, :] * tl.sigmoid(zh)
                tl.store(out_ptr + rows[:, None] * s_out + ck[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


_WORKSPACE: dict = {}


def _workspace(device: torch.device, heads: int, head_dim: int):
    """fp32 o scratch [MAX_TOKENS, C] and per-head arrival counters [H] (zero; each launch leaves them zero).

    One per (device, H, D), shared by all layers (their launches are stream-ordered) and allocated once, so a
    CUDA graph captured after the first call keeps valid addresses. Call once before capturing a graph."""
    key = (device, heads, head_dim)
    if key not in _WORKSPACE:
        _WORKSPACE[key] = (torch.empty(MAX_TOKENS, heads * head_dim, device=device, dtype=torch.float32),
                           torch.zeros(heads, device=device, dtype=torch.int32))
    return _WORKSPACE[key]


def _row_stride(x: torch.Tensor, name: str) -> int:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be [T, N] with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    return x.stride(0)


# (block_v, num_warps) by heads per rank, then by the step's token count (the smallest key >= T applies):
# tuned.json. Verify steps (T > 1) run one warp per program, so every reduction over D stays inside a warp.
CONFIGS = by_width(tuned("kda"))


def config_for(t: int, heads: int = 8) -> tuple[int, int]:
    return by_width_and_tokens(CONFIGS, heads, t)


def fused_kda_step(q, k, v, f, b, z, conv_state, conv_weight, a_log, dt_bias, norm_weight, state, *,
                   lower_bound: float, eps: float = 1e-6, stage=None, out=None, pdl: bool = False,
                   block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """The Triton KDA step (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). Arguments as `kda_step`;
    block_v (value columns per program) and num_warps override `CONFIGS`."""
    t, c = q.shape
    h, d = state.shape[0], state.shape[-1]
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"T={t} tokens: the fused step handles 1..{MAX_TOKENS}")
    for name, x, width in (("k", k, c), ("v", v, c), ("f", f, c), ("z", z, c), ("b", b, h)):
        if x is not None and x.shape != (t, width):
            raise ValueError(f"{name} must be [T, {width}] = [{t}, {width}], got {tuple(x.shape)}")
    if c != h * d or state.shape != (h, d, d) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be contiguous fp32 [H, D, D] with H*D = C = {c}, "
                         f"got {tuple(state.shape)} {state.dtype}")
    if conv_weight.shape != (3, c, CONV_KERNEL) or conv_state.shape != (3, c, CONV_KERNEL - 1):
        raise ValueError(f"conv_weight must be [3, C, 4] and conv_state [3, C, 3], "
                         f"got {tuple(conv_weight.shape)}, {tuple(conv_state.shape)}")
    if not (conv_weight.is_contiguous() and conv_state.is_contiguous()):
        raise ValueError("conv_weight and conv_state must be contiguous")
    if norm_weight is not None and z is None:
        raise ValueError("the gated output norm needs z (the g_proj output)")
    tuned_bv, tuned_warps = config_for(t, h)
    block_v, num_warps = block_v or min(tuned_bv, d), num_warps or tuned_warps
    if d & (d - 1) or d % block_v or block_v & (block_v - 1):
        raise ValueError(f"D={d} and block_v={block_v} must be powers of two with block_v dividing D")
    o_acc, count = _workspace(q.device, h, d)
    if out is None:
        out = torch.empty(t, c, device=q.device, dtype=q.dtype if norm_weight is not None else torch.float32)
    if stage is None:
        stage_state = stage_conv = state  # never touched: STAGE is off
    else:
        stage_state, stage_conv = stage
        if (stage_state.shape[0] < t or stage_state.shape[1:] != (h, STAGE_ROWS, d)
                or stage_state.dtype != torch.float32):
            raise ValueError(f"stage state must be fp32 [>=T, H, {STAGE_ROWS}, D], got {tuple(stage_state.shape)}")
        if stage_conv.shape[0] < t or stage_conv.shape[1:] != conv_state.shape[:2]:
            raise ValueError(f"stage conv must be [>=T, 3, C], got {tuple(stage_conv.shape)}")
        if not (stage_state.is_contiguous() and stage_conv.is_contiguous()):
            raise ValueError("stage buffers must be contiguous")
    kwargs = {"launch_pdl": True} if pdl and q.is_cuda else {}
    _kda_step_kernel[(h, d // block_v)](
        q, k, v, f, b, z if z is not None else q,
        _row_stride(q, "q"), _row_stride(k, "k"), _row_stride(v, "v"), _row_stride(f, "f"), _row_stride(b, "b"),
        _row_stride(z, "z") if z is not None else 0,
        conv_state, conv_weight, a_log, dt_bias, norm_weight if norm_weight is not None else a_log, state,
        out, _row_stride(out, "out"), o_acc, count, stage_state, stage_conv,
        d ** -0.5, float(lower_bound), float(eps),
        T=t, H=h, D=d, BV=block_v, BT=triton.next_power_of_2(t),
        STAGE=stage is not None, NORM=norm_weight is not None, USE_PDL=pdl_mode(bool(kwargs), "kda", t),
        num_warps=num_warps, **kwargs,
    )
    return out


def kda_step_reference(q, k, v, f, b, z, conv_state, conv_weight, a_log, dt_bias, norm_weight, state, *,
                       lower_bound: float, eps: float = 1e-6, stage=None, out=None) -> torch.Tensor:
    """The same step from lingls.kernels.reference (the model's own math), with the same in-place contract."""
    t, c = q.shape
    h, d = state.shape[0], state.shape[-1]
    ys, windows = [], []
    for i, x in enumerate((q, k, v)):
        y, window = ref.causal_conv_silu(x[None], conv_weight[i], conv_state[i][None])
        ys.append(y[0].view(t, h, d))
        windows.append(window[0])  # [C, 3]: the inputs after the last token
    qn = ref.l2_normalize(ys[0].float()) * d ** -0.5
    kn = ref.l2_normalize(ys[1].float())
    g = ref.kda_gate(f.view(t, h, d), a_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b.float())
    s, os_ = state.float()[None], []
    for i in range(t):
        o, s = ref.kda_recurrent(qn[None, i:i + 1], kn[None, i:i + 1], ys[2][None, i:i + 1], g[None, i:i + 1],
                                 beta[None, i:i + 1], s)
        os_.append(o[0, 0])
    o = torch.stack(os_)  # [T, H, D] fp32
    if norm_weight is not None:
        o = ref.gated_rms_norm(o, norm_weight, z.view(t, h, d), eps).to(q.dtype)
    o = o.reshape(t, c)
    if stage is None:
        state.copy_(s[0])
        conv_state.copy_(torch.stack(windows))
    else:
        stage[0][:t].copy_(torch.stack([kn, g, ys[2].float(), beta[..., None].expand(t, h, d)], dim=2))
        stage[1][:t].copy_(torch.stack([q, k, v], dim=1))  # [T, 3, C]: the conv's inputs
    if out is None:
        return o
    return out.copy_(o)


def kda_step(q, k, v, f, b, z, conv_state, conv_weight, a_log, dt_bias, norm_weight, state, *,
             lower_bound: float, eps: float = 1e-6, stage=None, out=None, pdl: bool = False,
             block_v: int | None = None) -> torch.Tensor:
    """One KDA layer step for batch 1 over T tokens: the Triton kernel on CUDA tensors, the reference otherwise.

    q, k, v, f, z: [T, C] projections (C = H*D; bf16 or fp32; rows may be strided views of one fused GEMV
    output, the last dim must be contiguous); b: [T, H] beta logits; z: the output gate (g_proj).
    conv_state: [3, C, 3] activation dtype, the last 3 projected q, k, v inputs (oldest first), updated in
    place unless staged; conv_weight: [3, C, 4] (q, k, v conv1d weights stacked, any float dtype).
    a_log: [H] fp32; dt_bias: [C] fp32; norm_weight: [D] (o_norm, shared by heads), or None for raw o.
    state: [H, D, D] fp32 (key rows, value columns), updated in place unless staged.
    lower_bound: the safe gate's bound (kda_lower_bound, -5.0); eps: o_norm's eps (rms_norm_eps).
    stage: None, or (stage_state [>=T, H, STAGE_ROWS, D] fp32, stage_conv [>=T, 3, C] conv_state's dtype) to
    receive the recurrence's and the conv's inputs of every token instead of updating the live states
    (speculative verify; then `commit`).
    Returns out [T, C]: RMSNorm_D(o) * norm_weight * sigmoid(z) per head in q's dtype, or o in fp32 when
    norm_weight is None. T = 1..MAX_TOKENS. pdl: launch with programmatic dependent launch (CUDA graphs too).
    """
    if q.is_cuda:
        return fused_kda_step(q, k, v, f, b, z, conv_state, conv_weight, a_log, dt_bias, norm_weight, state,
                              lower_bound=lower_bound, eps=eps, stage=stage, out=out, pdl=pdl, block_v=block_v)
    return kda_step_reference(q, k, v, f, b, z, conv_state, conv_weight, a_log, dt_bias, norm_weight, state,
                              lower_bound=lower_bound, eps=eps, stage=stage, out=out)


# ---------------------------------------------------------------------------------------------------------
# Commit a staged position


@jit
def _commit_kernel(index_ptr, state_ptr, stage_ptr, live_conv, staged_conv, NB, H: tl.constexpr, D: tl.constexpr,
                   BV: tl.constexpr, T_STAGE: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (layer, p): for p < H * D/BV, replays positions 0..index of head p // (D/BV) on its BV value
    columns of the live state (the step kernel's `delta_rule` on the staged inputs); the other programs each
    take BLOCK of the layer's NB = 3 * C conv channels and write their windows after position index: inputs
    index-2, index-1, index, from staged_conv [L, T, 3, C], or for positions before the step the live window's
    newer slots (each thread reads a channel's slots before it writes them)."""
    layer = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    NV: tl.constexpr = D // BV
    wait_previous(USE_PDL)
    idx = tl.load(index_ptr)
    if pid < H * NV:
        h = pid // NV
        dk = tl.arange(0, D)
        dv = (pid % NV) * BV + tl.arange(0, BV)
        s_ptr = state_ptr + (layer * H + h) * D * D + dk[:, None] * D + dv[None, :]
        S = tl.load(s_ptr)
        for t in tl.static_range(T_STAGE):  # positions past index were rejected: computed, then dropped
            st = stage_ptr + ((layer * T_STAGE + t) * H + h) * _ROWS * D
            kt = tl.load(st + dk)
            decay = tl.exp(tl.load(st + D + dk))
            vt = tl.load(st + 2 * D + dv)
            beta = tl.load(st + 3 * D)
            _, _, S_next = delta_rule(S, kt, decay, vt, beta)
            S = tl.where(t <= idx, S_next, S)
        tl.store(s_ptr, S)
    else:
        offs = (pid - H * NV) * BLOCK + tl.arange(0, BLOCK)
        m = offs < NB
        live = live_conv + (layer * NB + offs) * 3
        before = (tl.load(live + 1, mask=m), tl.load(live + 2, mask=m))  # inputs -2 and -1 of the step
        for s in tl.static_range(3):
            pos = idx - 2 + s  # >= -2, since idx >= 0
            staged = tl.load(staged_conv + (layer * T_STAGE + pos) * NB + offs, mask=m & (pos >= 0))
            tl.store(live + s, tl.where(pos >= 0, staged, tl.where(pos == -2, before[0], before[1])), mask=m)


def _check_staged(state, stage_state, conv_state, stage_conv):
    layers, heads, d = state.shape[0], state.shape[1], state.shape[-1]
    if state.shape != (layers, heads, d, d) or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 [L, H, D, D], got {tuple(state.shape)} {state.dtype}")
    if stage_state.dim() != 5 or stage_state.shape[0] != layers or stage_state.shape[2:] != (heads, STAGE_ROWS, d) \
            or stage_state.dtype != torch.float32:
        raise ValueError(f"stage_state must be fp32 [L, T, H, {STAGE_ROWS}, D] over the state {tuple(state.shape)}, "
                         f"got {tuple(stage_state.shape)}")
    if stage_conv.dim() != conv_state.dim() or layers != conv_state.shape[0] or layers != stage_conv.shape[0] \
            or stage_conv.shape[2:] != conv_state.shape[1:3] or stage_conv.shape[1] != stage_state.shape[1] \
            or stage_conv.dtype != conv_state.dtype:
        raise ValueError(f"stage_conv must be [L, T, 3, C] over the conv state {tuple(conv_state.shape)} with the "
                         f"stage's T, got {tuple(stage_conv.shape)}")
    if not all(x.is_contiguous() for x in (state, stage_state, conv_state, stage_conv)):
        raise ValueError("the states and the stage buffers must be contiguous")


def fused_commit(index, state, stage_state, conv_state, stage_conv, *, pdl: bool = False, block_v: int = 16) -> None:
    """The Triton commit: one launch replays every layer's accepted prefix and rebuilds its conv windows.
    Arguments as `commit`; block_v value columns per replaying program."""
    _check_staged(state, stage_state, conv_state, stage_conv)
    layers, heads, d = state.shape[0], state.shape[1], state.shape[-1]
    block_v = min(block_v, d)
    nb = conv_state[0].numel() // conv_state.shape[-1]  # the layer's conv channels, 3 * C
    block = 1024
    kwargs = {"launch_pdl": True} if pdl and state.is_cuda else {}
    _commit_kernel[(layers, heads * (d // block_v) + triton.cdiv(nb, block))](
        index, state, stage_state, conv_state, stage_conv, nb, H=heads, D=d, BV=block_v, T_STAGE=stage_state.shape[1],
        BLOCK=block, USE_PDL=pdl_mode(bool(kwargs), "kda", stage_state.shape[1]), num_warps=4, **kwargs)


def commit_reference(index, state, stage_state, conv_state, stage_conv) -> None:
    """The same in torch, with the step reference's own recurrence (`reference.kda_recurrent`, position by
    position, layer by layer, as the staged step ran it), so a commit gives exactly the state the accepted
    prefix would have left; index stays a tensor, so this does not sync either."""
    _check_staged(state, stage_state, conv_state, stage_conv)
    pick = index.reshape(1).long()
    for layer in range(state.shape[0]):
        k, g, v, beta = stage_state[layer].unbind(2)  # [T, H, D] each
        s, after = state[layer].float()[None], []
        for t in range(stage_state.shape[1]):
            _, s = ref.kda_recurrent(k[None, t:t + 1], k[None, t:t + 1], v[None, t:t + 1], g[None, t:t + 1],
                                     beta[None, t:t + 1, :, 0], s)
            after.append(s[0])
        state[layer].copy_(torch.stack(after).index_select(0, pick).squeeze(0))
    inputs = torch.cat([conv_state, stage_conv.permute(0, 2, 3, 1)], dim=-1)  # [L, 3, C, 3 + T]: -3 .. T-1
    conv_state.copy_(inputs.index_select(-1, pick + 1 + torch.arange(3, device=pick.device)))


def commit(index, state, stage_state, conv_state, stage_conv, *, pdl: bool = False) -> None:
    """Make the staged position `index` live: the state becomes the live state advanced through positions
    0..index with the staged inputs (the state the step would have left after them), and conv_state the windows
    after position index (its newer slots and the staged inputs up to index).

    index: int tensor with one element on the states' device, the accepted position in [0, T) (accepted tokens
    minus one); never read on the host. state: [L, H, D, D] fp32 with stage_state [L, T, H, STAGE_ROWS, D];
    conv_state: [L, 3, C, 3] with stage_conv [L, T, 3, C]; L is the number of layers (index one layer with
    [None]).
    """
    if state.is_cuda:
        return fused_commit(index, state, stage_state, conv_state, stage_conv, pdl=pdl)
    return commit_reference(index, state, stage_state, conv_state, stage_conv)
