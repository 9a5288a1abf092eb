"""FusedStep: the model's batch-1 step for T <= 16 tokens through the fused kernels of `lingls.kernels`.

Same contract as `LingForCausalLM.step` (advance an InferenceState by T tokens, return the pre-norm hidden
states), same weights: at construction the projections that one GEMV should read together are moved into one
contiguous tensor and the model's own parameters are re-pointed at views of it (no second copy of any weight),
so the eager model and this step keep computing from the same memory.

Per decoder layer, with the residual stream kept in the activation dtype as the model keeps it:
- add + RMSNorm fused (`norm.add_rms_norm`) at both norms of every layer; under tensor parallelism with the
  peer all-reduce, the all-reduce before each of them joins that kernel (`Parallel.all_reduce_add_norm`); the
  first layer's input norm reads the embedding rows itself (`norm.fused_embed_rms_norm`);
- KDA: one GEMV for q, k, v, f, g and b, one `kda.kda_step` (conv, norms, gate, delta rule, gated output norm),
  one GEMV for the output projection;
- MLA: one GEMV for q, the latent's down-projection and the gate; `mla.mla_prologue` (RMSNorm of the latent,
  rope of key and queries, the cache rows written, the queries absorbed through W_k); `mla.mla_attend` (the
  split-sequence kernel, then the merge with W_v and the gate, for one row picked on the device where the
  drafter asks for one); one GEMV for the output projection (with q_lora_rank, the model's own absorbed path);
- MoE: `moe.fused_moe` (router + grouped top-k, gate-up + SwiGLU, weighted down with the shared expert);
- dense MLP: a GEMV with the SwiGLU epilogue over [gate; up], then the down GEMV.
The MTP drafter's layer runs the same way after its input mix (the embedding rows and three norms in one launch
writing eh_proj's input, one GEMV). The heads (`head`, `mtp_head`) read the final norm that the last layer's
residual add made in its launch (`step(..., normed=True)`), or norm in one launch, before the lm_head (the
drafter's head as a GEMV).

`kernels=False` runs every op's plain-torch reference instead: the same wiring, checkable on any CPU.
"""

from __future__ import annotations

from functools import partial

import torch

from lingls.kernels import reference as ref
from lingls.model.config import KDA
from lingls.model.ling import GatedMLA, KimiDeltaAttention, LingForCausalLM, MoE, SwiGLU

MAX_TOKENS = 16


def fuse_rows(weights: list[torch.Tensor]) -> torch.Tensor:
    """One [rows, width] tensor holding the weights' rows in order (width: their last dimension; a 3-D weight,
    the experts' [E, 2I, H], gives E * 2I rows), each weight re-pointed at its view of it, so the rows are not
    stored twice and the model's own forms keep reading the same numbers."""
    width = weights[0].shape[-1]
    joined = torch.cat([w.detach().reshape(-1, width) for w in weights], dim=0).contiguous()
    start = 0
    for w in weights:
        rows = w.numel() // width
        w.data = joined[start:start + rows].view(w.shape)
        start += rows
    return joined


class _Ops:
    """The fused kernels, or their references (same signatures)."""

    def __init__(self, kernels: bool, pdl: bool):
        from lingls.kernels import gemv, kda, mla, moe, norm

        pdl = pdl and kernels and torch.cuda.is_available()  # programmatic dependent launch: CUDA only
        self.kernels, self.pdl = kernels, pdl
        self.linear = partial(gemv.gemv, pdl=pdl) if kernels else gemv.gemv_reference
        self.kda_step = partial(kda.fused_kda_step, pdl=pdl) if kernels else kda.kda_step_reference
        self.add_rms_norm = partial(norm.fused_add_rms_norm, pdl=pdl) if kernels else norm.add_rms_norm_reference
        self.embed_rms_norm = partial(norm.fused_embed_rms_norm, pdl=pdl) if kernels else norm.embed_rms_norm_reference
        self.mtp_input = partial(norm.fused_mtp_input, pdl=pdl) if kernels else norm.mtp_input_reference
        self.moe = partial(moe.fused_moe, pdl=pdl) if kernels else moe.fused_moe_reference
        self.prepare_moe = moe.prepare_moe_weights
        self.mla_prologue = partial(mla.mla_prologue, pdl=pdl) if kernels else mla.mla_prologue_reference
        self.mla_attend = partial(mla.mla_attend, pdl=pdl) if kernels else mla.mla_attend_reference


class FusedStep:
    max_tokens = MAX_TOKENS  # longer inputs are prefills: the model's own step

    def __init__(self, model: LingForCausalLM, kernels: bool | None = None, pdl: bool = True):
        """kernels: the Triton kernels (default on CUDA) or their references; pdl: launch each kernel as a
        programmatic dependent launch of the previous one (CUDA; off only to measure what it saves)."""
        self.model, self.cfg, self.par = model, model.config, model.par
        device = model.lm_head.weight.device
        self.ops = _Ops(device.type == "cuda" if kernels is None else kernels, pdl)
        self.layers = [self._prepare(layer) for layer in model.decoder_layers]
        self.mtp = [self._prepare(layer) for layer in model.mtp_layers]  # the drafter's MTP layers, same kernels
        self.moe_cfg = dict(top_k=self.cfg.num_experts_per_tok, n_group=self.cfg.n_group,
                            topk_group=self.cfg.topk_group, normalize=self.cfg.norm_topk_prob,
                            scale=self.cfg.routed_scaling_factor)

    def _prepare(self, layer) -> dict:
        """A layer's weights in the layouts the kernels read (views of the model's own, see the module note)."""
        entry = {"layer": layer}
        attn = layer.attention
        if isinstance(attn, KimiDeltaAttention):
            entry["proj"] = fuse_rows([m.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.f_proj,
                                                      attn.g_proj, attn.b_proj)])
            entry["conv"] = torch.stack([c.weight.detach().squeeze(1) for c in (attn.q_conv1d, attn.k_conv1d,
                                                                                attn.v_conv1d)]).contiguous()
        elif isinstance(attn, GatedMLA) and not hasattr(attn, "q_a_proj"):
            entry["mla_proj"] = fuse_rows([attn.q_proj.weight, attn.kv_a_proj_with_mqa.weight, attn.g_proj.weight])
            w = attn.kv_b_proj.weight.detach().view(attn.heads, attn.nope + attn.vdim, attn.rank)
            entry["w_k"], entry["w_v"] = w[:, : attn.nope], w[:, attn.nope:]  # [H, nope, rank], [H, v, rank]
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            shared = mlp.shared_experts
            sgu = fuse_rows([shared.gate_proj.weight, shared.up_proj.weight]) if shared is not None else None
            weights = self.ops.prepare_moe(mlp.gate.weight.detach(), mlp.gate.expert_bias.detach(),
                                           mlp.experts.gate_up_proj.detach(), mlp.experts.down_proj.detach())
            shared_down = shared.down_proj.weight.detach() if shared is not None else None
            entry["moe"] = weights._replace(shared_gate_up=sgu, shared_down=shared_down)
        elif isinstance(mlp, SwiGLU):
            entry["gate_up"] = fuse_rows([mlp.gate_proj.weight, mlp.up_proj.weight])
        return entry

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, state, positions: torch.Tensor, kv_len: int | None = None,
             stage: tuple[torch.Tensor, torch.Tensor] | None = None, keep: tuple[int, ...] | None = None,
             normed: bool = False):
        """Advance `state` by T <= 16 tokens at `positions`; returns the hidden states [T, hidden] (pre-norm),
        and with `normed` also their final norm (the head's input, made by the last residual add's launch):
        (hidden, normed).

        Speculative verify: `stage` = (stage_kda [n_kda, >=T, H, kda.STAGE_ROWS, D], stage_conv [n_kda, >=T, 3,
        C]) receives every layer's KDA recurrence inputs and conv inputs at each position instead of the live
        states being updated (see `kda.commit`), and
        `keep` (may be empty) names layers whose output hidden states are returned too, after the hidden states:
        (hidden, {layer: [T, hidden]}[, normed])."""
        if input_ids.shape[0] > MAX_TOKENS:
            raise ValueError(f"FusedStep runs 1..{MAX_TOKENS} tokens; longer inputs are prefills (model.step)")
        x, residual = self.ops.embed_rms_norm(input_ids, self.model.model.word_embeddings.weight,
                                              self.layers[0]["layer"].input_layernorm.weight, self.cfg.rms_norm_eps)
        h, kept, y = self._run(x, residual, self.layers, 0, state, positions, kv_len, stage, keep,
                               final_norm=self.model.model.norm.weight if normed else None)
        out = (h,) + ((kept,) if keep is not None else ()) + ((y,) if normed else ())
        return out if len(out) > 1 else h

    @torch.inference_mode()
    def mtp_step(self, h: torch.Tensor, next_ids: torch.Tensor, state, positions: torch.Tensor,
                 kv_len: int | None = None, depth: int = 0, only: torch.Tensor | None = None, normed: bool = False):
        """`LingForCausalLM.mtp_step` on the fused kernels: the MTP layer's output [T, hidden] (with `normed`:
        (output, its final norm), made in one launch as in `step`).

        only: a device index [1]: every row's latent cache row is written, but the layer's output is computed
        for that row alone ([1, hidden]): after a verify the drafter needs the output of the last accepted row
        and the cache rows of all, so its attention and MoE run at one token, not K+1."""
        if next_ids.shape[0] > MAX_TOKENS:
            out = self.model.mtp_step(h, next_ids, state, positions, kv_len, depth, normed=normed)
            if only is not None:
                out = tuple(o.index_select(0, only) for o in out) if normed else out.index_select(0, only)
            return out
        layer = self.model.mtp_layers[depth]
        x, residual = self.ops.add_rms_norm(self._mix(layer, h, next_ids), None, layer.input_layernorm.weight,
                                            self.cfg.rms_norm_eps)
        x, _, y = self._run(x, residual, self.mtp[depth: depth + 1], self.model.n_layers + depth, state, positions,
                            kv_len, only=only, final_norm=layer.final_layernorm.weight if normed else None)
        return (x, y) if normed else x

    def _mix(self, layer, h: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """`MTPLayer.mix` (eh_proj of [enorm(embed(next)); hnorm(norm(h))]) in two launches: the embedding rows
        and the three norms in one (`norm.fused_mtp_input`), then one GEMV."""
        both = self.ops.mtp_input(next_ids, self.model.model.word_embeddings.weight, h, layer.enorm.weight,
                                  self.model.model.norm.weight, layer.hnorm.weight, self.cfg.rms_norm_eps)
        return self.ops.linear(both, layer.eh_proj.weight)

    @torch.inference_mode()
    def head(self, h: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """`LingForCausalLM.head` (final norm + lm_head, this rank's vocab shard) with the norm in one launch, or
        none where the step made it (`normed`)."""
        if normed is None:
            normed, _ = self.ops.add_rms_norm(h, None, self.model.model.norm.weight, self.cfg.rms_norm_eps)
        return self.model.lm_head(normed)

    @torch.inference_mode()
    def mtp_head(self, x: torch.Tensor, depth: int = 0, weight: torch.Tensor | None = None,
                 normed: torch.Tensor | None = None) -> torch.Tensor:
        """`LingForCausalLM.mtp_head` with the MTP layer's final norm in one launch (or none, given `normed`), and
        the head (the lm_head's shard, or `weight`: a drafter's reduced vocabulary) as one of this step's GEMVs.
        A draft step has one row; cuBLAS's kernel for the whole head's shard streamed as fast, but came after a
        workspace memset and a gap each draft step: the GEMV took TP=4's K=8 drafts 0.913-0.915 -> 0.873-0.877 ms
        per round (one H200, bench/results/spec_tp4_draft_head_ab.json)."""
        if normed is None:
            normed, _ = self.ops.add_rms_norm(x, None, self.model.mtp_layers[depth].final_layernorm.weight,
                                              self.cfg.rms_norm_eps)
        return self.ops.linear(normed, self.model.lm_head.weight if weight is None else weight)

    def _run(self, x, residual, entries: list[dict], first: int, state, positions, kv_len, stage=None, keep=None,
             only=None, final_norm=None):
        """The layers `entries` (model layer indices first, first + 1, ...) over the residual stream, from its
        first input norm x; with `only` (one MLA layer: the MTP layer's), past the cache writes only row `only`
        goes on. Returns (the stream, the kept layers' streams, its norm by `final_norm` or None); with
        `final_norm` the last residual add and that norm are one launch (in the PDL chain, unlike a torch add)."""
        model = self.model
        kv_len = state.capacity if kv_len is None else kv_len
        kept = {}
        # rope frequencies (one width and theta per model; computed once per device, outside any graph capture)
        freq = ref.rope_inv_freq(self.cfg.qk_rope_head_dim, self.cfg.rope_theta, positions.device)
        for j, entry in enumerate(entries):
            i, layer = first + j, entry["layer"]
            if layer.kind == KDA:
                slot = model.kda_slot[i]
                a = self._kda(entry, x, state, slot, None if stage is None else (stage[0][slot], stage[1][slot]))
            else:
                a = self._mla(entry, x, state.latent[model.mla_slot[i]], positions, kv_len, freq, only)
            if only is not None:
                residual = residual.index_select(0, only)
            x, residual = self._reduce_add_norm(a, residual, layer.post_attention_layernorm.weight)
            m = self._mlp(entry, x, i)
            last = j + 1 == len(entries)
            norm = final_norm if last else entries[j + 1]["layer"].input_layernorm.weight
            if norm is not None:
                x, residual = self._reduce_add_norm(m, residual, norm)
            else:
                x, residual = None, residual + self.par.all_reduce(m)
            if keep and i in keep:
                kept[i] = residual.clone()  # the stream is updated in place by the next layer
        return residual, kept, x

    def _reduce_add_norm(self, a, residual, weight):
        """(rms_norm(residual + all_reduce(a)), the new residual): one kernel where the collective fuses the
        add and the norm (the peer all-reduce, kernels on), else the all-reduce, then `add_rms_norm`."""
        fused = self.par.all_reduce_add_norm
        if fused is not None and self.ops.kernels:
            return fused(a, residual, weight, self.cfg.rms_norm_eps, pdl=self.ops.pdl)
        return self.ops.add_rms_norm(self.par.all_reduce(a), residual, weight, self.cfg.rms_norm_eps)

    def _kda(self, entry, x, state, slot: int, stage) -> torch.Tensor:
        attn: KimiDeltaAttention = entry["layer"].attention
        c, h = attn.heads * attn.d, attn.heads
        p = self.ops.linear(x, entry["proj"])
        q, k, v, f, g, b = p.split([c, c, c, c, c, h], dim=1)
        o = self.ops.kda_step(q, k, v, f, b, g, state.conv[slot], entry["conv"], attn.A_log, attn.dt_bias,
                              attn.o_norm.weight, state.kda[slot], lower_bound=attn.lower_bound, eps=attn.eps,
                              stage=stage)
        return self.ops.linear(o, attn.dense.weight)

    def _mla(self, entry, x, cache, positions, kv_len: int, freq, only=None) -> torch.Tensor:
        """The MLA layer's step: this step's latent rows into the cache, then absorbed attention over it (for
        row `only` alone when given)."""
        attn: GatedMLA = entry["layer"].attention
        pick = (lambda t: t) if only is None else (lambda t: t.index_select(0, only))
        if "mla_proj" not in entry:
            cache.index_copy_(0, positions, attn.latent(x, positions))
            return attn.attend_latent(pick(x), pick(positions), cache, kv_len)
        h, nope, rope, rank = attn.heads, attn.nope, attn.rope, attn.rank
        q, kv, g = self.ops.linear(x, entry["mla_proj"]).split([h * (nope + rope), rank + rope, h], dim=1)
        q_lat, q_rope = self.ops.mla_prologue(q, kv, attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps, freq,
                                              cache, positions, h, nope, attn.interleave, entry["w_k"])
        o = self.ops.mla_attend(q_lat, q_rope, cache[:kv_len], positions, attn.scale, entry["w_v"], g, row=only)
        return self.ops.linear(o, attn.dense.weight)

    def _mlp(self, entry, x, layer_index: int) -> torch.Tensor:
        mlp = entry["layer"].mlp
        if "moe" in entry:
            return self.ops.moe(x, *entry["moe"], limit=self.cfg.expert_limit(layer_index),
                                shared_limit=self.cfg.shared_limit(layer_index), **self.moe_cfg)
        act = self.ops.linear(x, entry["gate_up"], swiglu=True, limit=mlp.limit)
        return self.ops.linear(act, mlp.down_proj.weight)

