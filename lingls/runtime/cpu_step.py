"""CpuStep: the model's batch-1 step for a few tokens on a CPU, in few, large torch ops.

Same contract as `LingForCausalLM.step` (advance an InferenceState by T tokens at `positions`, return the
pre-norm hidden states, with `normed` also their final norm) and as `FusedStep.step` for a runner, for
T <= MAX_TOKENS (decode steps, and the few tokens a one-line edit re-prefills after prefix reuse).

Why: at ling-nano's size (hidden 256) a token's arithmetic is ~10 MFLOP, well under a millisecond, but the
model's own step (the readable reference form) issues ~1,000 torch dispatches a token, each with a few
microseconds of overhead, plus a oneDNN convolution setup per causal conv and an advanced-index copy of the
chosen experts' weights: ~20 ms a token on one core. Here each layer is a handful of ops (~580 dispatches a
token, views included), and what remains is mostly streaming the fp32 weights (~22 MB a token, the 8 MB
lm_head included) from memory:
- one matrix product for every projection that reads the layer's input (KDA: q, k, v, f, g, b; MLA: q, the
  latent's down-projection, the gate; MoE: the router, every expert's gate and up, the shared expert's),
  over weights joined once at construction (the model's parameters are re-pointed at views of the joined
  tensor, so these are not stored twice and the model's own forms keep reading the same numbers; the experts'
  down projections are copied into a row layout, 1.6 MB a layer for ling-nano);
- the causal conv as a product with the conv state, the KDA recurrence at each token as three batched
  matrix products on the state in place;
- MLA: rope on the key and the queries together, one score product over [latent | rope] keys;
- MoE at one token: the chosen experts' weights gathered (an eighth of the layer's at ling-nano's top-4 of 32),
  one product for their gate-up, one for their weighted down projections summed into the residual; at more tokens all
  experts computed, weighted 0 where not chosen, their down product joined with the shared expert's;
- every output projection adds into the residual stream in its product (addmm).
Rope angles and the attention mask are made once per step, not once per layer.

The functions are the model's (ops regrouped, not approximated): `tests/nano/test_cpu_step.py` checks hidden
states, normed outputs and every state tensor against `LingForCausalLM.step` on random weights and inputs, and
greedy tokens through the runner. fp32 weights only (the CPU default); other dtypes keep the model's step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lingls.kernels import reference as ref
from lingls.model.config import KDA
from lingls.model.ling import (
    CHUNKED_KDA_MIN_TOKENS,
    GatedMLA,
    InferenceState,
    KimiDeltaAttention,
    LingForCausalLM,
    MoE,
    SwiGLU,
)
from lingls.runtime.fused_step import fuse_rows

# up to this many tokens the model's step runs its recurrent KDA form, token by token, as this step does; from
# CHUNKED_KDA_MIN_TOKENS on it runs the chunked form, and longer inputs go to it
MAX_TOKENS = CHUNKED_KDA_MIN_TOKENS - 1
GATHER_EXPERTS_MAX_SHARE = 0.5  # read only the chosen experts while they are at most this share of all


def doubled(norm_weight: torch.Tensor) -> torch.Tensor:
    """An RMSNorm weight as `rms_norm` takes it: twice over."""
    return torch.cat([norm_weight.detach()] * 2)


def rms_norm(x: torch.Tensor, weight2: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over x's last dimension (weight2: its weight, `doubled`) as the layer norm of [x, -x]: a mean of
    0 leaves the variance x's mean square, so it is the same function, in one kernel where torch's CPU rms_norm
    runs about ten ops, three of them copies (25 against 37 us a call on one core of a 2-core VM)."""
    n = x.shape[-1]
    return F.layer_norm(torch.cat([x, x.neg()], -1), (2 * n,), weight2, None, eps)[..., :n]


def route(logits: torch.Tensor, router) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.route_grouped_topk` (the same choice and weights) in fewer ops: the groups left out are masked
    by a broadcast over [N, groups, experts per group], not a repeat_interleave of the kept ones (~50 us a call)."""
    n, e, groups = logits.shape[0], logits.shape[1], router.n_group
    scores = logits.sigmoid()
    choice = scores + router.expert_bias
    if router.topk_group < groups:
        grouped = choice.view(n, groups, e // groups)
        kept = grouped.topk(2, dim=-1).values.sum(-1).topk(router.topk_group, dim=-1).indices
        keep = torch.zeros(n, groups, 1, dtype=torch.bool).scatter_(1, kept.unsqueeze(-1), True)
        choice = torch.where(keep, grouped, float("-inf")).view(n, e)
    idx = choice.topk(router.top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if router.normalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * router.scale, idx


def fuse_columns(weights: list[torch.Tensor]) -> torch.Tensor:
    """One [width, columns] tensor holding the [rows, width] weights' transposes side by side, each weight
    re-pointed at its (transposed) view of it, as `fuse_rows` does for rows. A product x @ it reads a wide output
    from contiguous rows, which MKL ran 1.7x faster than F.linear over the rows layout on a 2-core AVX2 VM once
    the weights came from memory rather than cache (1,284 x 256: 100 against 175 us; 1,536 x 256: 118 against
    208 us; no gain at 256 or 420 outputs, so only the wide products use it)."""
    joined = fuse_rows(weights).t().contiguous()
    start = 0
    for w in weights:
        rows = w.shape[0]
        w.data = joined[:, start:start + rows].t()
        start += rows
    return joined


def supports(model: LingForCausalLM) -> bool:
    """Whether CpuStep serves this model: fp32 on a CPU, unsharded."""
    w = model.lm_head.weight
    return w.device.type == "cpu" and w.dtype == torch.float32 and model.par.size == 1


class CpuStep:
    max_tokens = MAX_TOKENS  # longer inputs are prefills: the model's own step

    def __init__(self, model: LingForCausalLM):
        if not supports(model):
            raise ValueError("CpuStep runs an unsharded fp32 model on a CPU")
        self.model, self.cfg = model, model.config
        self.eps = self.cfg.rms_norm_eps
        self.hidden = self.cfg.hidden_size
        self.layers = [self._prepare(i, layer) for i, layer in enumerate(model.decoder_layers)]
        # the lm_head as [hidden, vocab]: a product with a [vocab, hidden] weight (F.linear's layout) ran at under
        # half the speed on a 2-core AVX2 VM (MKL, ling-nano's 8192 x 256: 1.0-1.1 ms a token against 0.43-0.50).
        # The model's lm_head is re-pointed at its transpose (F.linear over it reads the same rows), unless tied.
        head = model.lm_head.weight
        self.head_t = head.detach().t().contiguous()
        if head is not model.model.word_embeddings.weight:
            head.data = self.head_t.t()
        self._views_of, self._views = None, []
        self.final_norm = doubled(model.model.norm.weight)
        self.rope_freq = ref.rope_inv_freq(self.cfg.qk_rope_head_dim, self.cfg.rope_theta, torch.device("cpu"))

    # ---- weights in the layouts the step reads ---------------------------------------------------------------
    def _prepare(self, i: int, layer) -> dict:
        hid = self.hidden
        e = {"kind": layer.kind, "in_norm": doubled(layer.input_layernorm.weight),
             "post_norm": doubled(layer.post_attention_layernorm.weight)}
        attn = layer.attention
        if isinstance(attn, KimiDeltaAttention):
            c, h, d = attn.heads * attn.d, attn.heads, attn.d
            e["proj_t"] = fuse_columns([m.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.f_proj,
                                                           attn.g_proj, attn.b_proj)])
            e["split"] = [3 * c, c, c + h]  # q, k, v | f | g, b (both through a sigmoid)
            # [3C, K]: q, k, v channels' taps, oldest first (the order conv1d applies them to the state + input)
            e["conv"] = torch.cat([cv.weight.detach().squeeze(1) for cv in (attn.q_conv1d, attn.k_conv1d,
                                                                            attn.v_conv1d)]).contiguous()
            e["conv_rows"] = e["conv"][:, None, :]  # [3C, 1, K]: against the unfolded windows [3C, T, K]
            e["rate"] = attn.A_log.detach().float().exp().view(h, 1)
            e["dt_bias"] = attn.dt_bias.detach().float().view(h, d)
            e["dt_rate"] = e["dt_bias"] * e["rate"]  # rate * (f + dt_bias) = f * rate + this
            e["qk_scale"] = torch.tensor([d ** -0.5, 1.0]).view(2, 1, 1)  # q is scaled after its L2 norm, k not
            e["o_norm"] = doubled(attn.o_norm.weight)
            e["dense_t"] = attn.dense.weight.detach().t()
            e["slot"] = self.model.kda_slot[i]
            e["attn"] = attn
        elif isinstance(attn, GatedMLA):
            h, nope, rope, rank = attn.heads, attn.nope, attn.rope, attn.rank
            first = [attn.q_a_proj] if hasattr(attn, "q_a_proj") else [attn.q_proj]
            e["proj"] = fuse_rows([m.weight for m in first + [attn.kv_a_proj_with_mqa, attn.g_proj]])
            e["split"] = [first[0].weight.shape[0], rank + rope, h]
            w = attn.kv_b_proj.weight.detach().view(h, nope + attn.vdim, rank)
            e["w_k"] = w[:, :nope].contiguous()  # [H, nope, rank]
            e["w_v_t"] = w[:, nope:].transpose(1, 2).contiguous()  # [H, rank, v]
            e["kv_norm"] = doubled(attn.kv_a_layernorm.weight)
            e["dense_t"] = attn.dense.weight.detach().t()
            e["slot"] = self.model.mla_slot[i]
            e["attn"] = attn
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            ex, shared = mlp.experts, mlp.shared_experts
            n_exp = ex.gate_up_proj.shape[0]
            params = [mlp.gate.weight]
            # the experts' down projections as rows [E * I, hidden]: a product over the chosen (or all) experts'
            # weighted activations sums their outputs (a copy: the model's layout is [E, hidden, I])
            downs = [ex.down_proj.detach().transpose(1, 2).reshape(n_exp * ex.inter, hid)]
            if shared is not None:
                params += [shared.gate_proj.weight, shared.up_proj.weight]
                downs.append(shared.down_proj.weight.detach().t())
                e["shared_inter"], e["shared_limit"] = shared.gate_proj.weight.shape[0], shared.limit
                e["shared_down_t"] = shared.down_proj.weight.detach().t()
            # rows: router, shared gate, shared up (what every token reads), then every expert's gate-up
            e["moe_in"] = fuse_rows(params + [ex.gate_up_proj])
            e["moe_head_rows"] = e["moe_in"].shape[0] - ex.gate_up_proj.numel() // hid
            e["moe_head"] = e["moe_in"][: e["moe_head_rows"]]  # what one token reads before choosing experts
            e["moe_down"] = torch.cat(downs, dim=0).contiguous()  # [E*I (+ shared), hidden]
            e["experts"], e["inter"], e["limit"] = n_exp, ex.inter, ex.limit
            e["router"], e["gate_up"] = mlp.gate, ex.gate_up_proj
            e["down_rows"] = e["moe_down"][: n_exp * ex.inter].view(n_exp, ex.inter, hid)
        elif isinstance(mlp, SwiGLU):
            e["gate_up_t"] = fuse_columns([mlp.gate_proj.weight, mlp.up_proj.weight])
            e["inter"], e["limit"] = mlp.gate_proj.weight.shape[0], mlp.limit
            e["down_t"] = mlp.down_proj.weight.detach().t()
        return e

    # ---- the step --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, state: InferenceState, positions: torch.Tensor,
             kv_len: int | None = None, normed: bool = False):
        t = input_ids.shape[0]
        if not 1 <= t <= MAX_TOKENS:
            raise ValueError(f"CpuStep runs 1..{MAX_TOKENS} tokens; longer inputs are prefills (model.step)")
        kv_len = state.capacity if kv_len is None else kv_len
        h = F.embedding(input_ids, self.model.model.word_embeddings.weight)
        angles = positions.float()[:, None] * self.rope_freq[None, :]
        rotation = torch.complex(angles.cos(), angles.sin())[:, None]  # [T, 1, rope/2]: one per pair, all heads
        hidden = torch.arange(kv_len)[None, :] > positions[:, None]  # [T, kv_len]: keys after each query
        for e, held in zip(self.layers, self._state_views(state)):
            x = rms_norm(h, e["in_norm"], self.eps)
            if e["kind"] == KDA:
                h = self._kda(e, x, h, *held)
            else:
                h = self._mla(e, x, h, held, positions, kv_len, rotation, hidden)
            x = rms_norm(h, e["post_norm"], self.eps)
            h = self._moe(e, x, h) if "moe_in" in e else self._dense_mlp(e, x, h)
        if normed:
            return h, rms_norm(h, self.final_norm, self.eps)
        return h

    def _state_views(self, state: InferenceState) -> list:
        """Each layer's piece of `state` (KDA: its conv window [3C, K-1] and recurrent state [H, Dk, Dv]; MLA: its
        latent rows), made once per state tensors rather than once per step (a view is a torch op)."""
        tensors = (state.kda, state.conv, state.latent)
        if self._views_of is None or any(a is not b for a, b in zip(self._views_of, tensors)):
            taps = self.cfg.short_conv_kernel_size
            self._views = [(state.conv[e["slot"]].view(-1, taps - 1), state.kda[e["slot"]]) if e["kind"] == KDA
                           else state.latent[e["slot"]] for e in self.layers]
            self._views_of = tensors
        return self._views

    @torch.inference_mode()
    def head(self, h: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        if normed is None:
            normed = rms_norm(h, self.final_norm, self.eps)
        return normed @ self.head_t

    # ---- layers: each returns the residual stream h with its output added -----------------------------------
    def _kda(self, e: dict, x: torch.Tensor, h: torch.Tensor, conv_state: torch.Tensor,
             s: torch.Tensor) -> torch.Tensor:
        """conv_state [3C, K-1] and s [H, Dk, Dv]: the layer's conv window and recurrent state, updated in place.
        One token (a decode step) takes views where more take a slice per token: fewer torch ops."""
        attn: KimiDeltaAttention = e["attn"]
        t, hh, d = x.shape[0], attn.heads, attn.d
        qkv, f, gb = (x @ e["proj_t"]).split(e["split"], dim=1)
        # causal depthwise conv over [state | inputs] ([3C, K-1+T]), then SiLU; the state keeps the last K-1
        taps = e["conv"]
        ext = torch.cat([conv_state, qkv.t()], dim=1)
        if t == 1:  # the window is [state | input] itself
            qkv = F.silu(torch.linalg.vecdot(ext, taps)).view(1, 3, hh, d)
        else:
            y = F.silu(torch.linalg.vecdot(ext.unfold(1, taps.shape[1], 1), e["conv_rows"]))  # [3C, T]
            qkv = y.t().reshape(t, 3, hh, d)
        conv_state.copy_(ext[:, t:])
        qk = qkv[:, :2]  # ref.l2_normalize, then q's scale
        qk = qk / torch.linalg.vecdot(qk, qk).add_(1e-6).sqrt_().unsqueeze(-1) * e["qk_scale"]
        if attn.safe_gate:  # ref.kda_gate, the gate's log decay, then its exp
            z = torch.addcmul(e["dt_rate"], f.view(t, hh, d), e["rate"])  # rate * (f + dt_bias)
            decay = torch.exp(torch.sigmoid(z).mul_(attn.lower_bound))
        else:
            decay = torch.exp(F.softplus(f.view(t, hh, d) + e["dt_bias"]).mul_(-e["rate"]))
        gb = torch.sigmoid(gb)
        gate, beta = gb[:, : hh * d].view(t, hh, d), gb[:, hh * d:]  # [T, H, D], [T, H]
        # the delta rule at each token: decay, correct towards v along k, read with q
        if t == 1:
            q, k = qk.view(2, hh, 1, d).unbind(0)
            s.mul_(decay.view(hh, d, 1))
            err = torch.baddbmm(qkv[0, 2].view(hh, 1, d), k, s, alpha=-1).mul_(beta.view(hh, 1, 1))
            s.baddbmm_(k.view(hh, d, 1), err)
            o = torch.bmm(q, s).view(1, hh, d)
        else:
            q, k, v = qk[:, 0].unsqueeze(2), qk[:, 1].unsqueeze(2), qkv[:, 2].unsqueeze(2)  # [T, H, 1, D]
            k_col, decay, beta = k.transpose(2, 3), decay.unsqueeze(-1), beta.view(t, hh, 1, 1)
            outs = []
            for i in range(t):
                s.mul_(decay[i])
                err = torch.baddbmm(v[i], k[i], s, alpha=-1).mul_(beta[i])
                s.baddbmm_(k_col[i], err)
                outs.append(torch.bmm(q[i], s))
            o = torch.cat(outs, dim=1).transpose(0, 1)
        o = rms_norm(o, e["o_norm"], self.eps) * gate
        return torch.addmm(h, o.reshape(t, hh * d), e["dense_t"])

    def _mla(self, e: dict, x, h, cache, positions, kv_len: int, rotation, hidden) -> torch.Tensor:
        attn: GatedMLA = e["attn"]
        t, hh, nope, rp, rank = x.shape[0], attn.heads, attn.nope, attn.rope, attn.rank
        q, kv, gate = F.linear(x, e["proj"]).split(e["split"], dim=1)
        if hasattr(attn, "q_a_proj"):
            q = attn.q_b_proj(attn.q_a_layernorm(q))
        q = q.view(t, hh, nope + rp)
        # rope on the queries' rope parts and the key's together: [T, H + 1, rope], written as [evens | odds]
        r = torch.cat([q[..., nope:], kv[:, None, rank:]], dim=1)
        if attn.interleave:  # pairs (x0, x1), (x2, x3), ...: one complex product
            turned = torch.view_as_real(torch.view_as_complex(r.view(t, hh + 1, rp // 2, 2)) * rotation)
            r = turned.transpose(-1, -2).reshape(t, hh + 1, rp)
        else:
            cos, sin = rotation.real, rotation.imag
            r1, r2 = r.chunk(2, dim=-1)
            r = torch.cat([r1 * cos - r2 * sin, r2 * cos + r1 * sin], dim=-1)
        c = rms_norm(kv[:, :rank], e["kv_norm"], self.eps)
        cache.index_copy_(0, positions, torch.cat([c, r[:, hh]], dim=-1))
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), e["w_k"])  # [H, T, rank]
        q_all = torch.cat([q_lat, r[:, :hh].transpose(0, 1)], dim=-1)  # [H, T, rank + rope]
        keys = cache[:kv_len]
        scores = (q_all.reshape(hh * t, -1) @ keys.t()).view(hh, t, kv_len).mul_(attn.scale)
        probs = scores.masked_fill_(hidden, float("-inf")).softmax(-1)
        o_lat = (probs.view(hh * t, kv_len) @ keys[:, :rank]).view(hh, t, rank)
        o = torch.bmm(o_lat, e["w_v_t"]).transpose(0, 1)  # [T, H, v]
        o = o * torch.sigmoid(gate)[..., None]
        return torch.addmm(h, o.reshape(t, -1), e["dense_t"])

    def _moe(self, e: dict, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The router's choice weighs each expert's output. One token reads only the chosen experts' weights
        (a gather copies 1/4 of a layer's experts at ling-nano's top-4 of 16); more tokens compute every expert,
        weighted 0 where not chosen (one product over all of them beats gathering most of them)."""
        t, n_exp, inter, router = x.shape[0], e["experts"], e["inter"], e["router"]
        gather = t == 1 and router.top_k <= GATHER_EXPERTS_MAX_SHARE * n_exp
        p = F.linear(x, e["moe_head"] if gather else e["moe_in"])
        weights, idx = route(p[:, :n_exp], router)
        if "shared_inter" in e:
            si = e["shared_inter"]
            shared = ref.swiglu(p[:, n_exp: n_exp + si], p[:, n_exp + si: n_exp + 2 * si], e["shared_limit"])
        if gather:
            chosen = idx[0]
            gu = (x @ e["gate_up"].index_select(0, chosen).view(-1, x.shape[1]).t()).view(-1, 2 * inter)  # [k, 2I]
            act = ref.swiglu(gu[:, :inter], gu[:, inter:], e["limit"]).mul_(weights.view(-1, 1))
            h = torch.addmm(h, act.view(1, -1), e["down_rows"].index_select(0, chosen).view(-1, x.shape[1]))
            return torch.addmm(h, shared, e["shared_down_t"]) if "shared_inter" in e else h
        gu = p[:, e["moe_head_rows"]:].view(t, n_exp, 2 * inter)
        act = ref.swiglu(gu[..., :inter], gu[..., inter:], e["limit"])  # [T, E, I]
        dense_w = torch.zeros(t, n_exp).scatter_(1, idx, weights)  # the router's weight, 0 for the others
        act = (act * dense_w[..., None]).view(t, n_exp * inter)
        return torch.addmm(h, torch.cat([act, shared], dim=1) if "shared_inter" in e else act, e["moe_down"])

    def _dense_mlp(self, e: dict, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        gu = x @ e["gate_up_t"]
        return torch.addmm(h, ref.swiglu(gu[:, : e["inter"]], gu[:, e["inter"]:], e["limit"]), e["down_t"])

