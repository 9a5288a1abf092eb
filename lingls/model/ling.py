"""Ling-3.0 (`bailing_hybrid`) in PyTorch: embedding, KDA and gated-MLA layers, dense and MoE MLPs, MTP, lm_head.

Two ways to run it:
- `hidden(input_ids[B, T])`: the full causal sequence, batched (training, parity tests).
- `step(input_ids[T], state, positions[T])`: batch 1 over an explicit `InferenceState` (KDA recurrent + conv
  state, MLA latent KV). Prefill P tokens, then steps of T >= 1; long inputs use the chunked KDA form.

Tensor parallelism: built with `Parallel(rank, size)`, a module holds rank r's slice (heads of KDA and MLA,
the intermediate dim of dense MLPs and experts, the vocab of lm_head) and its row-parallel outputs are partial
sums that `Parallel.all_reduce` completes (identity at size 1). Parameter names are the official checkpoint
names, except the routed experts, which are stacked per layer (`mlp.experts.gate_up_proj` [E, 2I, H] with gate
rows first, `mlp.experts.down_proj` [E, H, I]) so a step gathers the chosen experts without a host sync.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lingls.kernels import norm, prefill_kda, prefill_kda_state, prefill_moe
from lingls.kernels import reference as ref
from lingls.kernels.mla import mla_decode
from lingls.model.config import KDA, LingConfig

# torch's grouped GEMM (a CUTLASS kernel for bf16 on Hopper; elsewhere torch's own per-group fallback)
_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
CHUNKED_KDA_MIN_TOKENS = 64  # below this a step runs the recurrent form; above, the chunked form
GATHER_EXPERTS_MAX_TOKENS = 16  # up to this many tokens, experts are gathered by index (graph-capturable)
DENSE_EXPERTS_MAX = 32  # beyond GATHER_EXPERTS_MAX_TOKENS, this few experts are all computed densely
MLA_ABSORBED_MAX_TOKENS = 16  # up to this many queries, MLA attends in the absorbed form; beyond, expanded


@dataclass
class Parallel:
    rank: int = 0
    size: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    all_gather_last: Callable[[torch.Tensor], torch.Tensor] = lambda x: x  # concatenates shards on the last dim
    # (x, residual, weight, eps) -> (rms_norm(residual + all_reduce(x)), residual updated in place) in one
    # kernel, where the collective has one (the peer all-reduce); None: all_reduce, then the norm kernel
    all_reduce_add_norm: Callable | None = None

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {self.size}")
        return n // self.size


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return ref.rms_norm(x, self.weight, self.eps)


class ConvWeight(nn.Module):
    """Holds a depthwise conv's weight [C, 1, K] under the checkpoint's name `*_conv1d.weight`."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


# ---------------------------------------------------------------------------------------------------------
@dataclass
class InferenceState:
    """One sequence's state (batch 1). Stacked per layer kind so a snapshot is three tensor copies."""

    kda: torch.Tensor  # [n_kda, H, Dk, Dv] fp32 recurrent state
    conv: torch.Tensor  # [n_kda, 3, C, K-1] last K-1 projected q, k, v inputs
    latent: torch.Tensor  # [n_mla, capacity, kv_lora_rank + rope] MLA latent KV (rope already applied)

    @property
    def capacity(self) -> int:
        return self.latent.shape[1]

    def clone(self) -> "InferenceState":
        return InferenceState(self.kda.clone(), self.conv.clone(), self.latent.clone())

    def copy_(self, other: "InferenceState", kv_len: int | None = None) -> None:
        """Copy `other` into this state in place (CUDA-graph inputs keep their addresses)."""
        self.kda.copy_(other.kda)
        self.conv.copy_(other.conv)
        n = other.latent.shape[1] if kv_len is None else kv_len
        self.latent[:, :n].copy_(other.latent[:, :n])


@dataclass
class Snapshots:
    """The KDA states a prefill step also leaves after its first ends[s] tokens (a cold prompt's tail snapshots,
    taken inside its one piece instead of by a staged step of its last tokens): ends [S] int64 on the device,
    ascending (a graph's input), kda [n_kda, S, H, Dk, Dv] fp32 and conv [n_kda, S, 3, C, K-1], written by the step."""

    ends: torch.Tensor
    kda: torch.Tensor
    conv: torch.Tensor


def prefill_kernels(x: torch.Tensor) -> bool:
    """Whether a prefill's many tokens run the prefill kernels (`kernels.prefill_moe`, `kernels.prefill_kda`):
    on CUDA with Triton, unless LINGLS_KERNELS=0 (the torch ops everywhere, as for the fused step)."""
    return x.is_cuda and prefill_moe.triton is not None and os.environ.get("LINGLS_KERNELS", "1") != "0"


# ---------------------------------------------------------------------------------------------------------
class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: LingConfig, par: Parallel):
        super().__init__()
        self.heads = par.split(cfg.num_attention_heads, "num_attention_heads")
        self.d = cfg.head_dim
        c = self.heads * self.d
        hid = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj = _linear(hid, c), _linear(hid, c), _linear(hid, c)
        self.f_proj, self.g_proj = _linear(hid, c), _linear(hid, c)
        self.b_proj = _linear(hid, self.heads)
        k = cfg.short_conv_kernel_size
        self.q_conv1d, self.k_conv1d, self.v_conv1d = ConvWeight(c, k), ConvWeight(c, k), ConvWeight(c, k)
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(c, dtype=torch.float32))
        self.o_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.dense = _linear(c, hid)
        self.lower_bound, self.safe_gate, self.eps = cfg.kda_lower_bound, cfg.kda_safe_gate, cfg.rms_norm_eps
        self.par = par

    def forward(self, x, conv_state=None, state=None, valid=None, snapshots=None):
        """x: [B, T, hidden]. conv_state: [B, 3, C, K-1] or None; state: [B, H, D, D] fp32 or None; valid: [T]
        bool (device) for inputs padded after their first n steps: padded steps neither decay nor write the
        state, and the conv state is taken after step n, so the states are those of the n real steps.
        snapshots (B = 1, states given): (ends [S] on the device, kda [S, H, D, D], conv [S, 3, C, K-1]), into
        which the states after the first ends[s] steps are written (`Snapshots`, one layer's share).

        Returns (out [B, T, hidden] partial over TP ranks, new conv state, new recurrent state)."""
        b, t, _ = x.shape
        if (b == 1 and t > MLA_ABSORBED_MAX_TOKENS and state is not None and conv_state is not None
                and self.safe_gate and prefill_kernels(x)):
            return self._prefill(x[0], conv_state[0], state, valid, snapshots)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        qkv, new_conv, projected = [], [], []
        end = None if valid is None else valid.sum()
        for i, (proj, conv) in enumerate(zip((self.q_proj, self.k_proj, self.v_proj), convs)):
            projected.append(proj(x))
            y, cs = ref.causal_conv_silu(projected[-1], conv.weight.squeeze(1),
                                         None if conv_state is None else conv_state[:, i], end)
            qkv.append(y.view(b, t, self.heads, self.d))
            new_conv.append(cs)
        q, k, v = qkv
        q = ref.l2_normalize(q.float()) * self.d ** -0.5
        k = ref.l2_normalize(k.float())
        g = ref.kda_gate(self.f_proj(x).view(b, t, self.heads, self.d), self.A_log, self.dt_bias,
                         self.lower_bound, self.safe_gate)
        beta = torch.sigmoid(self.b_proj(x).float())
        if valid is not None:
            g = g * valid[:, None, None]
            beta = beta * valid[:, None]
        if state is None:
            state = x.new_zeros(b, self.heads, self.d, self.d, dtype=torch.float32)
        if snapshots is not None:
            ends, kda_out, conv_out = snapshots
            self._rerun_snapshots(q, k, v, g, beta, state, ends, kda_out, self.lower_bound if self.safe_gate else None)
            for j in range(ends.shape[0]):
                conv_out[j].copy_(torch.stack([ref.conv_state_after(p, conv_state[:, i], ends[j], c.weight.shape[-1])[0]
                                               for i, (p, c) in enumerate(zip(projected, convs))]))
        o, state = delta_rule(q, k, v, g, beta, state, self.lower_bound if self.safe_gate else None)
        o = ref.gated_rms_norm(o, self.o_norm.weight, self.g_proj(x).view(b, t, self.heads, self.d), self.eps)
        return self.dense(o.to(x.dtype).reshape(b, t, -1)), torch.stack(new_conv, 1), state

    @staticmethod
    def _rerun_snapshots(q, k, v, g, beta, state, ends, out, lower_bound):
        """The recurrent states after the first ends[j] steps into out[j], each by the recurrence rerun with the
        steps from ends[j] on padded (no decay, no write): the snapshots of the paths without the narrow state
        pass's (`prefill_kda_state.snapshots`), which a runner uses only where it must (`ModelRunner.tail_free`)."""
        steps = torch.arange(q.shape[1], device=q.device)
        for j in range(ends.shape[0]):
            keep = steps < ends[j]
            out[j].copy_(delta_rule(q, k, v, g * keep[:, None, None], beta * keep[:, None], state, lower_bound)[1][0])


    def _prefill(self, x, conv_state, state, valid, snapshots=None):
        """`forward` of one sequence's many tokens x [T, hidden] through the prefill kernels: the projections, one
        launch for the convolutions, norms, gate and beta (`prefill_kda.prologue`), one for the new conv state,
        the chunked recurrence, one for the gated output norm; the torch form's outputs, to the rounding of q, k
        and v to the activation dtype where the narrow state pass serves (`prefill_kda.FP32_INPUTS`)."""
        t = x.shape[0]
        q, k, v, f = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj, self.f_proj))
        conv_w = torch.stack([c.weight.squeeze(1) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])
        narrow = q.is_cuda and fla_chunk_kda() is not None and prefill_kda_state.available()
        dtype = prefill_kda.recurrence_dtype(x.dtype)
        columns, stages = prefill_kda_state.columns_for(t, self.d, dtype) if narrow else (0, 0)
        q_, k_, v_, g, beta = prefill_kda.prologue(q, k, v, f, self.b_proj(x), conv_state, conv_w, self.A_log,
                                                   self.dt_bias, valid, self.lower_bound,
                                                   dtype if columns else torch.float32)
        end = valid.sum() if valid is not None else torch.full((), t, dtype=torch.long, device=x.device)
        new_conv = prefill_kda.conv_states(q, k, v, conv_state, end)
        ends, kda_out, conv_out = snapshots if snapshots is not None else (None, None, None)
        if snapshots is not None:
            prefill_kda.conv_states(q, k, v, conv_state, ends, out=conv_out)
        if columns:  # fla's chunked recurrence with the state pass in narrow value columns (and the snapshots)
            o, state = prefill_kda_state.chunk_kda(q_[None], k_[None], v_[None], g[None], beta[None], state, columns,
                                                   stages, ends, kda_out)
        else:
            if snapshots is not None:
                self._rerun_snapshots(q_[None], k_[None], v_[None], g[None], beta[None], state, ends, kda_out,
                                      self.lower_bound)
            o, state = delta_rule(q_[None], k_[None], v_[None], g[None], beta[None], state, self.lower_bound)
        o = prefill_kda.gated_norm(o[0], self.g_proj(x), self.o_norm.weight, self.eps, x.dtype)
        return self.dense(o)[None], new_conv[None], state


def delta_rule(q, k, v, g, beta, state, lower_bound: float | None = None):
    """Dispatch the KDA recurrence: fla-core's chunk kernel on CUDA when installed, else the torch forms.
    `lower_bound`: the gate's bound when it is the safe (bounded) gate, so the chunked form needs no host read."""
    t = q.shape[1]
    fla = q.is_cuda and t > MLA_ABSORBED_MAX_TOKENS and fla_chunk_kda() is not None  # any piece a step of the
    if fla:  # fused kernels does not take: fla's kernel at every length, where the recurrent form is a loop per token
        o, s = fla_chunk_kda()(q=q, k=k, v=v.float(), g=g, beta=beta, scale=1.0, initial_state=state,
                                output_final_state=True, use_qk_l2norm_in_kernel=False)
        return o, s
    if t >= CHUNKED_KDA_MIN_TOKENS:
        return ref.kda_chunked(q, k, v, g, beta, state, lower_bound=lower_bound)
    return ref.kda_recurrent(q, k, v, g, beta, state)


_FLA = []


def fla_chunk_kda():
    if not _FLA:
        # fla's kernels autotune on first use (92 s for chunk_kda on an H200); keep the timings on disk so
        # that happens once per machine, not once per server start (Triton reads this when fla is imported)
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
        try:
            from fla.ops.kda import chunk_kda
        except Exception:  # fla-core absent or without a GPU toolchain: the torch forms serve
            chunk_kda = None
        _FLA.append(chunk_kda)
    return _FLA[0]


# ---------------------------------------------------------------------------------------------------------
class GatedMLA(nn.Module):
    """Multi-head latent attention with a sigmoid gate per head on its output."""

    def __init__(self, cfg: LingConfig, par: Parallel):
        super().__init__()
        self.heads = par.split(cfg.num_attention_heads, "num_attention_heads")
        hid = cfg.hidden_size
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.vdim, self.rank = cfg.v_head_dim, cfg.kv_lora_rank
        qdim = self.heads * cfg.qk_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = _linear(hid, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = _linear(cfg.q_lora_rank, qdim)
        else:
            self.q_proj = _linear(hid, qdim)
        self.kv_a_proj_with_mqa = _linear(hid, self.rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = _linear(self.rank, self.heads * (self.nope + self.vdim))
        self.g_proj = _linear(hid, self.heads)
        self.dense = _linear(self.heads * self.vdim, hid)
        self.scale = cfg.qk_head_dim ** -0.5
        self.theta, self.interleave = cfg.rope_theta, cfg.rope_interleave

    def _query(self, x):
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        return q.view(*x.shape[:-1], self.heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)

    def latent(self, x, positions):
        """The cache row of each token: [c = RMSNorm(kv_a[:rank]) | rope(k_rope)], shape [..., T, rank + rope]."""
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        cos, sin = ref.rope_cos_sin(positions, self.rope, self.theta)
        return torch.cat([self.kv_a_layernorm(c), ref.apply_rope(k_rope, cos, sin, self.interleave)], dim=-1)

    def forward(self, x, positions):
        """Full causal attention over x [B, T, hidden] with the expanded keys and values (the reference form)."""
        b, t, _ = x.shape
        q_nope, q_rope = self._query(x)
        cos, sin = ref.rope_cos_sin(positions, self.rope, self.theta)
        q_rope = ref.apply_rope(q_rope, cos, sin, self.interleave, heads=True)
        lat = self.latent(x, positions)
        kv = self.kv_b_proj(lat[..., : self.rank]).view(b, t, self.heads, self.nope + self.vdim)
        k_nope, v = kv.split([self.nope, self.vdim], dim=-1)
        k_rope = lat[..., self.rank:].unsqueeze(2).expand(b, t, self.heads, self.rope)
        q = torch.cat([q_nope, q_rope], -1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope], -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=self.scale)
        return self._out(x, o.transpose(1, 2))

    def attend_latent(self, x, positions, cache, kv_len: int, end_aligned: bool = False):
        """Absorbed-weight attention for batch 1 over the latent cache.

        x: [T, hidden]; positions: [T] (device); cache: [capacity, rank + rope], already holding these tokens'
        rows. Keys at cache rows j > position are masked, so rows past the sequence never contribute.
        More than MLA_ABSORBED_MAX_TOKENS queries run `attend_prefill` (`end_aligned`: see there).
        """
        t = x.shape[0]
        if t > MLA_ABSORBED_MAX_TOKENS:
            return self.attend_prefill(x, positions, cache, kv_len, end_aligned)
        q_nope, q_rope = self._query(x)  # [T, H, nope], [T, H, rope]
        cos, sin = ref.rope_cos_sin(positions, self.rope, self.theta)
        q_rope = ref.apply_rope(q_rope, cos, sin, self.interleave, heads=True)
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.vdim, self.rank)
        w_k, w_v = w[:, : self.nope], w[:, self.nope:]  # [H, nope, rank], [H, v, rank]
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_k)  # absorb W_k into the query
        o_lat = mla_decode(q_lat, q_rope, cache[:kv_len], positions, self.scale).to(x.dtype)
        o = torch.einsum("thr,hvr->thv", o_lat, w_v)  # absorb W_v into the output
        return self._out(x, o.reshape(t, self.heads, self.vdim))

    def attend_prefill(self, x, positions, cache, kv_len: int, end_aligned: bool = False):
        """Attention of many queries (a prefill) over the latent cache in the expanded form: the cache's first
        kv_len rows are up-projected to per-head keys and values (one GEMM) and a fused attention kernel
        (`scaled_dot_product_attention`: flash on a GPU) runs over them, where the absorbed form would put
        T x kv_len x rank fp32 products through plain matmuls. The same function as `attend_latent`.

        Keys at rows j > position are masked by an explicit mask; with `end_aligned` the caller promises that
        the queries are the last T of the kv_len rows (positions = kv_len - T .. kv_len - 1, a prompt's next
        tokens), and the mask is the causal one aligned to the end, which flash attention applies without a
        mask tensor."""
        t, kv = x.shape[0], cache[:kv_len]
        q_nope, q_rope = self._query(x)
        cos, sin = ref.rope_cos_sin(positions, self.rope, self.theta)
        q = torch.cat([q_nope, ref.apply_rope(q_rope, cos, sin, self.interleave, heads=True)], -1)
        k_nope, v = self.kv_b_proj(kv[:, : self.rank]).view(kv_len, self.heads, -1).split([self.nope, self.vdim], -1)
        k = torch.cat([k_nope, kv[:, None, self.rank:].expand(kv_len, self.heads, self.rope)], -1)
        width = q.shape[-1]
        if v.shape[-1] < width:  # flash kernels want one head size for q, k and v: zero columns, sliced off
            v = F.pad(v, (0, width - v.shape[-1]))
        if end_aligned:
            from torch.nn.attention.bias import causal_lower_right
            mask = causal_lower_right(t, kv_len)
        else:
            mask = torch.arange(kv_len, device=x.device)[None, :] <= positions[:, None]
        q, k, v = (y.transpose(0, 1)[None] for y in (q, k, v))  # [1, H, rows, width]: what the fused kernels take
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self._out(x, o[0].transpose(0, 1)[..., : self.vdim])

    def _out(self, x, o):
        gate = torch.sigmoid(self.g_proj(x).float()).to(o.dtype)
        return self.dense((o * gate.unsqueeze(-1)).flatten(-2))


# ---------------------------------------------------------------------------------------------------------
class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float = 0.0):
        super().__init__()
        self.gate_proj, self.up_proj = _linear(hidden, inter), _linear(hidden, inter)
        self.down_proj = _linear(inter, hidden)
        self.limit = limit

    def forward(self, x):
        return self.down_proj(ref.swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    """`mlp.gate`: sigmoid scores with a per-expert selection bias (aux-loss-free balancing)."""

    def __init__(self, cfg: LingConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.normalize, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def logits(self, x):
        """x: [N, hidden] -> [N, experts]: fp32 sums of the exact products of the bf16 inputs either way: on a GPU
        one bf16 GEMM with fp32 output (as the fused decode kernel computes them) rather than an fp32 GEMM over
        upcast copies, which took a long prefill's router several times longer."""
        if x.is_cuda and x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), self.weight.float())

    def forward(self, x):
        """x: [N, hidden] -> (weights [N, k] fp32, indices [N, k])."""
        logits = self.logits(x)
        # a prefill's many tokens: one routing kernel launch on a GPU instead of a dozen torch ops
        many = x.shape[0] > GATHER_EXPERTS_MAX_TOKENS and prefill_kernels(x)
        route = prefill_moe.route if many else ref.route_grouped_topk
        return route(logits, self.expert_bias, self.top_k, self.n_group, self.topk_group, self.normalize, self.scale)


class Experts(nn.Module):
    def __init__(self, cfg: LingConfig, inter: int, limit: float):
        super().__init__()
        self.inter, self.limit = inter, limit
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * inter, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, inter))

    def forward(self, x, weights, idx, plus=None):
        """x: [N, hidden]; weights, idx: [N, k]. Sum over the chosen experts of weight * expert(x), + plus ([N,
        hidden], the shared expert's output) when given: folded into the grouped kernels' weighted sum."""
        n, k = idx.shape
        n_exp = self.gate_up_proj.shape[0]
        if n <= GATHER_EXPERTS_MAX_TOKENS:
            gu = torch.einsum("nh,nkoh->nko", x, self.gate_up_proj[idx])
            act = ref.swiglu(gu[..., : self.inter], gu[..., self.inter:], self.limit)
            y = torch.einsum("nki,nkhi->nkh", act, self.down_proj[idx])
            out = (y.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)
        # on a CPU the dense form's 1/top_k-useful arithmetic costs more than grouping: ling-nano's 512-token
        # prefill piece, one MoE layer, one thread: dense 22.1 ms, grouped 9.8 ms (2-core AVX2 VM)
        elif n_exp <= DENSE_EXPERTS_MAX and x.is_cuda:
            out = self._dense(x, weights, idx)
        elif prefill_kernels(x):  # the grouped Triton kernels (kernels/prefill_moe.py)
            return prefill_moe.moe_prefill_triton(x, weights, idx, self.gate_up_proj, self.down_proj, self.inter,
                                                  self.limit, plus=plus)
        else:
            out = self._grouped(x, weights, idx)
        return out if plus is None else out + plus

    def _grouped(self, x, weights, idx):
        """The (token, expert) pairs sorted by expert, each expert's rows one group of torch's grouped matrix
        product: two launches for all experts and no host sync, where a loop over Ling-3.0-flash's 512 experts
        issued a dozen small ops for each (and read the counts back to the host) in every prefill chunk."""
        n, k = idx.shape
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        ones = torch.ones_like(flat, dtype=torch.int32)  # counted by index_add: CUDA's bincount reads the max back
        ends = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int32, device=x.device).index_add_(0, flat, ones)
        ends = ends.cumsum(0, dtype=torch.int32)  # offs: where each expert's rows end
        tokens = order // k
        gu = _grouped_mm(x[tokens], self.gate_up_proj.transpose(1, 2), offs=ends)
        act = ref.swiglu(gu[:, : self.inter], gu[:, self.inter:], self.limit)
        y = _grouped_mm(act, self.down_proj.transpose(1, 2), offs=ends)
        out = torch.zeros(n, x.shape[-1], dtype=torch.float32, device=x.device)
        return out.index_add_(0, tokens, y.float() * weights.flatten()[order, None]).to(x.dtype)

    def _dense(self, x, weights, idx):
        """Every expert on every token, the unchosen ones weighted 0: two large matmuls and no host sync.
        For a few small experts (ling-nano: 16 of width 48) this is far faster than gathering tokens per
        expert, and it is the same function."""
        n_exp, two_i, hidden = self.gate_up_proj.shape
        gu = (x @ self.gate_up_proj.reshape(n_exp * two_i, hidden).t()).view(-1, n_exp, two_i)
        act = ref.swiglu(gu[..., : self.inter], gu[..., self.inter:], self.limit)
        dense_w = torch.zeros(x.shape[0], n_exp, dtype=weights.dtype, device=x.device).scatter_(1, idx, weights)
        act = (act.float() * dense_w.unsqueeze(-1)).to(x.dtype).reshape(x.shape[0], n_exp * self.inter)
        return act @ self.down_proj.transpose(1, 2).reshape(n_exp * self.inter, hidden)


class MoE(nn.Module):
    def __init__(self, cfg: LingConfig, par: Parallel, layer: int):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg, par.split(cfg.moe_intermediate_size, "moe_intermediate_size"),
                               cfg.expert_limit(layer))
        self.shared_experts = SwiGLU(cfg.hidden_size,
                                     par.split(cfg.shared_intermediate, "shared expert intermediate size"),
                                     cfg.shared_limit(layer)) if cfg.num_shared_experts else None

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, idx = self.gate(flat)
        shared = self.shared_experts(flat) if self.shared_experts is not None else None
        return self.experts(flat, weights, idx, shared).view_as(x)


# ---------------------------------------------------------------------------------------------------------
class DecoderLayer(nn.Module):
    def __init__(self, cfg: LingConfig, par: Parallel, layer: int, kind: str, mlp: str):
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = KimiDeltaAttention(cfg, par) if kind == KDA else GatedMLA(cfg, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        inter = par.split(cfg.intermediate_size, "intermediate_size") if mlp == "dense" else 0
        self.mlp = SwiGLU(cfg.hidden_size, inter) if mlp == "dense" else MoE(cfg, par, layer)
        self.par = par

    def _mlp(self, h):
        return h + self.par.all_reduce(self.mlp(self.post_attention_layernorm(h)))


class MTPLayer(DecoderLayer):
    """Multi-token prediction: from h_t and the embedding of token t+1, predict token t+2."""

    def __init__(self, cfg: LingConfig, par: Parallel, layer: int):
        super().__init__(cfg, par, layer, "mla", "moe")
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = _linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mix(self, emb, h_final):
        """eh_proj([enorm(embed(t+1)); hnorm(h_t)]), h_t being the target's final-normed hidden state (what
        SGLang and vLLM hand their MTP layers: the output of the model's last norm)."""
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h_final)], dim=-1))


class LingModel(nn.Module):
    def __init__(self, cfg: LingConfig, par: Parallel):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        n = cfg.num_hidden_layers
        layers = [DecoderLayer(cfg, par, i, cfg.layer_types[i], cfg.mlp_types[i]) for i in range(n)]
        layers += [MTPLayer(cfg, par, n + j) for j in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LingForCausalLM(nn.Module):
    def __init__(self, cfg: LingConfig, par: Parallel | None = None):
        super().__init__()
        self.config, self.par = cfg, par or Parallel()
        self.model = LingModel(cfg, self.par)
        self.lm_head = _linear(cfg.hidden_size, self.par.split(cfg.vocab_size, "vocab_size"))
        self.n_layers = cfg.num_hidden_layers
        # slot of each layer in the stacked InferenceState tensors
        self.kda_slot = {i: s for s, i in enumerate(cfg.kda_layers)}
        mla = cfg.mla_layers + list(range(self.n_layers, self.n_layers + cfg.num_nextn_predict_layers))
        self.mla_slot = {i: s for s, i in enumerate(mla)}

    @property
    def decoder_layers(self):
        return self.model.layers[: self.n_layers]

    @property
    def mtp_layers(self):
        return self.model.layers[self.n_layers:]

    # ---- full sequence --------------------------------------------------------------------------------
    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, hidden], the residual stream after the last layer (before the final norm)."""
        h = self.model.word_embeddings(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        for layer in self.decoder_layers:
            h = self._layer_full(layer, h, positions)
        return h

    def _layer_full(self, layer: DecoderLayer, h, positions):
        x = layer.input_layernorm(h)
        a = layer.attention(x)[0] if layer.kind == KDA else layer.attention(x, positions)
        return layer._mlp(h + self.par.all_reduce(a))

    def head(self, h: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm + lm_head: this rank's vocab shard of the logits. normed: h's final norm, where the step
        made it (`step(..., normed=True)`)."""
        return self.lm_head(self.model.norm(h) if normed is None else normed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(input_ids))

    def mtp_logits(self, h: torch.Tensor, next_ids: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """Full-sequence MTP: h [B, T, hidden] (pre-norm, from `hidden`) at positions t, next_ids [B, T] = tokens
        t+1 -> logits for t+2."""
        layer = self.mtp_layers[depth]
        x = layer.mix(self.model.word_embeddings(next_ids), self.model.norm(h))
        positions = torch.arange(next_ids.shape[1], device=next_ids.device)
        x = self._layer_full(layer, x, positions)
        return self.lm_head(layer.final_layernorm(x))

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """1-D ids [T] -> float logits [T, vocab] (the whole vocab, gathered across TP ranks)."""
        return self.par.all_gather_last(self(input_ids.view(1, -1))[0]).float()

    # ---- batch 1 with state ---------------------------------------------------------------------------
    def new_state(self, capacity: int, device=None, dtype=None) -> InferenceState:
        cfg = self.config
        device = device or self.lm_head.weight.device
        dtype = dtype or self.lm_head.weight.dtype
        heads = cfg.num_attention_heads // self.par.size
        n_kda, n_mla = len(self.kda_slot), len(self.mla_slot)
        return InferenceState(
            kda=torch.zeros(n_kda, heads, cfg.head_dim, cfg.head_dim, device=device, dtype=torch.float32),
            conv=torch.zeros(n_kda, 3, heads * cfg.head_dim, cfg.short_conv_kernel_size - 1, device=device,
                             dtype=dtype),
            latent=torch.zeros(n_mla, capacity, cfg.latent_dim, device=device, dtype=dtype),
        )

    def step(self, input_ids: torch.Tensor, state: InferenceState, positions: torch.Tensor,
             kv_len: int | None = None, normed: bool = False, prefill: bool = False,
             valid: torch.Tensor | None = None, keep: tuple[int, ...] | None = None,
             snapshots: Snapshots | None = None):
        """Advance `state` by T tokens at `positions` [T]; returns the hidden states [T, hidden] (pre-norm), and
        with `normed` also their final norm, the head's input: (hidden, normed). The fused step makes both in
        one launch; here the pair keeps the two steps' contracts the same.

        `kv_len` bounds the MLA keys read (the last position + 1, when the caller knows it on the host);
        None reads the whole cache, masked on device (the fixed-shape form CUDA graphs capture). `prefill`: the
        tokens are a prompt's next ones, positions = kv_len - T .. kv_len - 1 (kv_len given), so long steps'
        MLA attention needs no mask tensor (`GatedMLA.attend_prefill`). `valid` ([T] bool on the device): the
        tokens are padded after the first n (a fixed-shape prefill, `ModelRunner`'s prefill graphs): the
        KDA states end as after the n real tokens, and the padded tokens' MLA rows (positions past them) are
        written like any row past the sequence, masked until overwritten. `keep` (may be empty) names layers whose
        outputs (the residual stream after them, a drafter's features) come back after the hidden states, as the
        fused step returns them: (hidden, {layer: [T, hidden]}[, normed]). `snapshots` (a prefill's): the KDA and
        conv states after its first `snapshots.ends` tokens are also written there.
        """
        h = self.model.word_embeddings(input_ids)
        kv_len = state.capacity if kv_len is None else kv_len
        kept = {} if keep is not None else None
        if prefill:
            h = self._prefill_layers(h, state, positions, kv_len, valid, keep, kept, snapshots)
        else:
            assert snapshots is None, "snapshots are a prefill's"
            for i, layer in enumerate(self.decoder_layers):
                h = self._layer_step(i, layer, h, state, positions, kv_len, prefill, valid)
                if keep and i in keep:
                    kept[i] = h
        out = (h,) + ((kept,) if keep is not None else ()) + ((self.model.norm(h),) if normed else ())
        return out if len(out) > 1 else h

    def _prefill_layers(self, h, state: InferenceState, positions, kv_len: int, valid=None,
                        keep: tuple[int, ...] | None = None, kept: dict | None = None,
                        snapshots: Snapshots | None = None):
        """The decoder layers of a prefill step: `_layer_step`'s arithmetic with each residual add and the norm
        after it as one launch on a GPU (`norm.add_rms_norm`: the same bits as `h + a` then the RMSNorm), where
        torch spends about eight elementwise launches over [T, hidden] per norm. h is updated in place, so the
        residual streams after the layers `keep` names go into `kept` as copies."""
        layers, eps = self.decoder_layers, self.config.rms_norm_eps
        x, h = norm.add_rms_norm(h, None, layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(layers):
            a = self._attend(i, layer, x, state, positions, kv_len, True, valid, snapshots)
            x, h = norm.add_rms_norm(self.par.all_reduce(a), h, layer.post_attention_layernorm.weight, eps)
            m = self.par.all_reduce(layer.mlp(x))
            if i + 1 < len(layers):
                x, h = norm.add_rms_norm(m, h, layers[i + 1].input_layernorm.weight, eps)
            else:
                h = h + m
            if keep and i in keep:
                kept[i] = h.clone()
        return h

    def _layer_step(self, i, layer: DecoderLayer, h, state: InferenceState, positions, kv_len, prefill=False,
                    valid=None):
        a = self._attend(i, layer, layer.input_layernorm(h), state, positions, kv_len, prefill, valid)
        return layer._mlp(h + self.par.all_reduce(a))

    def _attend(self, i, layer: DecoderLayer, x, state: InferenceState, positions, kv_len, prefill=False,
                valid=None, snapshots: Snapshots | None = None):
        """Layer i's attention of its normed input x over the state (updated): this rank's partial output."""
        if layer.kind == KDA:
            s = self.kda_slot[i]
            snap = None if snapshots is None else (snapshots.ends, snapshots.kda[s], snapshots.conv[s])
            a, conv, rec = layer.attention(x[None], state.conv[s:s + 1], state.kda[s:s + 1], valid, snap)
            state.conv[s].copy_(conv[0])
            state.kda[s].copy_(rec[0])
            return a[0]
        cache = state.latent[self.mla_slot[i]]
        cache.index_copy_(0, positions, layer.attention.latent(x, positions))
        return layer.attention.attend_latent(x, positions, cache, kv_len, end_aligned=prefill)

    def mtp_step(self, h: torch.Tensor, next_ids: torch.Tensor, state: InferenceState, positions: torch.Tensor,
                 kv_len: int | None = None, depth: int = 0, normed: bool = False):
        """MTP over the state: h [T, hidden] at `positions`, next_ids [T] -> the MTP layer's output [T, hidden]
        (apply `mtp_head` for logits), and with `normed` also its final norm: (output, normed), as `step`. Its
        latent cache rows are indexed by the same positions."""
        layer = self.mtp_layers[depth]
        x = layer.mix(self.model.word_embeddings(next_ids), self.model.norm(h))
        kv_len = state.capacity if kv_len is None else kv_len
        x = self._layer_step(self.n_layers + depth, layer, x, state, positions, kv_len)
        return (x, layer.final_layernorm(x)) if normed else x

    def mtp_head(self, x: torch.Tensor, depth: int = 0, weight: torch.Tensor | None = None,
                 normed: torch.Tensor | None = None) -> torch.Tensor:
        """The MTP layer's logits: its final norm (or `normed`, where the step made it), then the lm_head (or
        `weight`: a drafter's reduced vocabulary)."""
        y = self.mtp_layers[depth].final_layernorm(x) if normed is None else normed
        return self.lm_head(y) if weight is None else F.linear(y, weight)

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters, MTP layers excluded.

        Active counts what one token computes with: the chosen experts instead of all, and no embedding table
        (a lookup reads one row). For Ling-3.0-flash: 124.4B total, 5.10B active."""
        cfg, total, routed = self.config, 0, 0
        for name, p in self.named_parameters():
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= self.n_layers:
                continue
            total += p.numel()
            if ".mlp.experts." in name:
                routed += p.numel()
        embedding = self.model.word_embeddings.weight.numel()
        active = total - embedding - routed + routed * cfg.num_experts_per_tok // cfg.num_experts
        return total, active

    # ---- initialisation -------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random weights for training from scratch and for generated test checkpoints."""
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0, generator=generator).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty_like(p).uniform_(-6.9, -2.3, generator=generator).exp().clamp_min(1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("expert_bias"):
                p.zero_()
            elif leaf == "weight" and p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)
