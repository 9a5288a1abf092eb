"""Speculative decoding at batch 1: a drafter proposes K tokens, one target forward of K+1 tokens checks them.

A round, all on the device (the host only launches it, and reads its result one round later):
1. draft: the drafter writes K tokens after the current token `cur` (at position P, sampled, not yet consumed).
2. verify: the target consumes [cur, d_1..d_K] at P..P+K in one forward and chooses a token after each. The KDA
   layers run `kernels.kda.kda_step` in staged mode: the live recurrent and conv states are only read, and what
   the recurrence consumed at every position (key, decay, value, beta) and the conv's inputs go to a stage
   buffer. MLA layers write their latent rows at P..P+K as usual: rows past the accepted ones hold rejected
   tokens, but a query at position x only sees rows <= x and every row a later query sees is rewritten (by the
   next round's forward) before it is read.
3. accept: n = the accepted drafts (greedy: the leading drafts equal to the target's argmax; sampling: the
   standard rejection rule, `rejection_sample`), the round's tokens are d_1..d_n plus one token of the target's
   own (the correction, or the bonus when all K pass), so every round yields n + 1 >= 1 tokens. The last of
   them becomes `cur` and the position advances by n + 1. One launch (`kernels.accept.settle_round`) decides
   greedy n, writes the round's result and moves `cur` and the position.
4. commit: `kda.commit(n, ...)` replays the recurrence over positions P..P+n from the live state (and rebuilds
   the conv windows after P+n from the staged conv inputs), reading n on the device; the drafter absorbs what
   the target computed (MTP rows, block-drafter context KV, lookup history), indexed by n on the device.
The host posts [n, tokens] to a pinned buffer and reads round r while round r+1 runs (on CPU, synchronously).
On CUDA each phase (draft, verify) is captured once per (KV bucket, greedy) as a CUDA graph.

Drafters share one small interface (`Drafter`): MTP (the checkpoint's next-token-prediction layer chained K
times), prompt lookup (the longest recent n-gram match in the prompt and the text generated so far, found on
the device), the DSpark block drafter (`lingls.model.dspark`: the published Ling-3.0-flash-DSpark layout, which
ling-nano's shipped drafter also uses; `DSparkRuntime`), and `Fallback(lookup, model drafter)`. `--draft` strings: none,
mtp, lookup, a drafter directory, or several joined by '+' (the first that has a draft wins: lookup when it matches,
else the model drafter). K, the drafts per round, defaults to a block drafter's block size (the verify window is K+1
tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch

from lingls.kernels import accept, kda
from lingls.model.ling import LingForCausalLM
from lingls.runtime.fused_step import FusedStep
from lingls.runtime.graphs import GraphSet
from lingls.runtime.runner import Fence, ModelRunner
from lingls.runtime.sampling import argmax_shards, uniform_hash
from lingls.runtime.spec.draft_vocab import DraftVocab

DEFAULT_K = 4
COIN = -1  # the "token id" keying a position's acceptance coin in the hash (every real id is >= 0)
DRAFT_KEY = -2  # a drafter's draw of token t at a position is keyed by DRAFT_KEY - t: apart from the verify's draws


# ---- sampling ------------------------------------------------------------------------------------------------
def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The distribution `sampling.sample` draws from: softmax(logits / T) cut to the top-p nucleus, renormalised."""
    probs = (logits.float() / temperature.clamp_min(1e-5)).softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    kept = sorted_p * ((sorted_p.cumsum(-1) - sorted_p) < top_p)
    return torch.zeros_like(probs).scatter_(-1, order, kept / kept.sum(-1, keepdim=True))


def rejection_sample(logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, positions: torch.Tensor,
                     temperature: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor):
    """The standard speculative-sampling rule, so the output is distributed as the target's samples.

    logits [..., K+1, V]: the target's at the K+1 verified positions; drafts [..., K]; q [..., K, V] the
    drafter's distributions the drafts were sampled from, or None for drafts chosen deterministically (q is
    then one-hot); positions [..., K+1]: the positions the chosen tokens occupy (they key the random stream).
    Draft i is accepted with probability min(1, p(d_i) / q(d_i)); at the first rejection the token is drawn
    from max(0, p - q) renormalised; if all pass, a bonus token from p_K. Returns (n [...] accepted drafts,
    tokens [..., K+1] whose first n + 1 are the round's output). The coin of a position and its residual draw
    use different keys of the hash, so they are independent of each other and of the drafts.
    """
    p = target_probs(logits, temperature, top_p)
    k = drafts.shape[-1]
    d = drafts.unsqueeze(-1)
    p_d = p[..., :k, :].gather(-1, d).squeeze(-1)
    if q is None:
        q_d = torch.ones_like(p_d)
        resid = p[..., :k, :].scatter(-1, d, 0.0)
    else:
        q_d = q.float().gather(-1, d).squeeze(-1)
        resid = (p[..., :k, :] - q.float()).clamp_min(0.0)
    coin = uniform_hash(seed, positions[..., :k], torch.full_like(drafts, COIN))
    n = (coin * q_d < p_d).long().cumprod(-1).sum(-1)
    resid = torch.cat([resid, p[..., k:, :]], -2)
    ids = torch.arange(p.shape[-1], device=p.device)
    choice = (resid / -torch.log(uniform_hash(seed, positions.unsqueeze(-1), ids))).argmax(-1)
    steps = torch.arange(k + 1, device=p.device)
    tokens = torch.where(steps < n.unsqueeze(-1), torch.cat([drafts, choice[..., k:]], -1), choice)
    return n, tokens


# ---- drafters --------------------------------------------------------------------------------------------------
class Drafter:
    """What a drafter sees. All device-side methods have fixed shapes and never read a value on the host.

    - `target_layers`: the target layers whose outputs (residual stream) it reads, concatenated, as `feats`.
    - `prefill(h, feats, ids, positions, start)`: after each prefill step of the target over ids at
      positions start..; h is the target's pre-norm hidden [T, hidden].
    - `begin(tokens, cur, pos)`: before the first round; tokens = what the state has consumed (host list),
      cur [1] the first sampled token at position pos [1] (device).
    - `propose(cur, pos, kv_len, greedy) -> (drafts [K], q [K, V] or None)`: q, the distributions the drafts
      were sampled from, only when not greedy (None: deterministic drafts, a one-hot q).
    - `accept(h, feats, tokens, n, positions, kv_len)`: after a verify over positions P..P+K; tokens[i] is
      the token at position P+i+1 for i <= n (rows past n are garbage and must only land where masked).
    - `live()`: device tensors that carry state between rounds (saved around CUDA-graph capture).
    """

    target_layers: tuple[int, ...] = ()
    name = "drafter"

    def __init__(self, k: int):
        self.k = k

    def prefill(self, h, feats, ids, positions, start: int) -> None:
        pass

    def begin(self, tokens: list[int], cur: torch.Tensor, pos: torch.Tensor) -> None:
        pass

    def propose(self, cur, pos, kv_len: int, greedy: bool = True):
        raise NotImplementedError

    def accept(self, h, feats, tokens, n, positions, kv_len: int) -> None:
        pass

    def live(self) -> list[torch.Tensor]:
        return []


class LookupDrafter(Drafter):
    """Prompt lookup on the device: find the latest earlier end j of the longest match (min_ngram..max_ngram
    tokens) of the sequence's last tokens, and draft what followed it. A match that overlaps the end repeats
    with its period (j + 1 + i mod (P - j)), which also drafts runs like `----`. `found` says whether any match
    of at least min_ngram tokens exists (Fallback uses it)."""

    name = "lookup"

    def __init__(self, k: int, capacity: int, device, max_ngram: int = 4, min_ngram: int = 2):
        super().__init__(k)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.hist = torch.full((capacity + k + 2,), -1, dtype=torch.long, device=device)  # token at each position
        self.idx = torch.arange(self.hist.shape[0], device=device)
        self.steps = torch.arange(k, device=device)
        self.found = torch.zeros((), dtype=torch.bool, device=device)

    def begin(self, tokens, cur, pos):
        n = len(tokens)
        self.hist[:n].copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=True)
        self.hist[n:n + 1].copy_(cur)

    def propose(self, cur, pos, kv_len, greedy=True):
        hist, size = self.hist, self.hist.shape[0]
        run = torch.ones(size, dtype=torch.bool, device=hist.device)
        length = torch.zeros(size, dtype=torch.long, device=hist.device)
        for o in range(self.max_ngram):
            tail = hist.gather(0, (pos - o).clamp_min(0))  # the token o places before the end
            shifted = torch.cat([hist.new_full((o,), -1), hist[: size - o]]) if o else hist
            run = run & (shifted == tail) & (pos >= o)
            length += run
        ok = (self.idx < pos) & (length >= self.min_ngram)
        score = torch.where(ok, length * size + self.idx, -1)  # longest first, then latest
        best = score.argmax()
        self.found.copy_(score.max() >= 0)
        period = (pos - best).clamp_min(1)
        return hist.gather(0, (best + 1 + self.steps % period).clamp(max=size - 1)), None

    def accept(self, h, feats, tokens, n, positions, kv_len):
        self.hist.index_copy_(0, positions + 1, tokens)


class MTPDrafter(Drafter):
    """The checkpoint's MTP layer, chained: row x of its latent cache mixes the target's hidden at x with the
    token at x+1 and predicts x+2. After each verify the rows of the consumed positions are recomputed from the
    target's real hidden states; drafting then chains the layer on its own output (standing in for the target
    hidden it does not have yet), writing provisional rows that the next round overwrites."""

    name = "mtp"

    def __init__(self, model: LingForCausalLM, state, k: int, fused=None, vocab: DraftVocab | None = None):
        if not model.mtp_layers:
            raise ValueError("the checkpoint has no MTP layer (num_nextn_predict_layers = 0): use another drafter")
        super().__init__(k)
        self.model, self.state = model, state
        self.fused = fused
        self.vocab = vocab  # the head's reduced vocabulary (`draft_vocab`), or None for the whole lm_head
        self.mtp_step = model.mtp_step if fused is None else fused.mtp_step  # the fused kernels on CUDA
        self.mtp_head = model.mtp_head if fused is None else fused.mtp_head
        dev, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        self.h_last = torch.zeros(1, model.config.hidden_size, device=dev, dtype=dtype)  # target hidden, last prefilled
        self.last_at: int | None = None  # its position (host)
        # the MTP output predicting P+1 and its final norm (the head's input), one buffer: one copy fills both
        self.xy = torch.zeros(2, model.config.hidden_size, device=dev, dtype=dtype)
        self.steps = torch.arange(k, device=dev)

    def _argmax(self, x, normed):
        weight, ids = (None, None) if self.vocab is None else (self.vocab.weight, self.vocab.ids)
        return argmax_shards(self.mtp_head(x, weight=weight, normed=normed), self.model.par, ids)

    def _keep(self, out, row=None):
        """Store an MTP step's (output, final norm) [of row `row`] as the next round's first draft input."""
        torch.cat(out if row is None else [o.index_select(0, row) for o in out], out=self.xy)

    def prefill(self, h, feats, ids, positions, start):
        rows_h, rows_pos, rows_next = h[:-1], positions[:-1], ids[1:]
        if self.last_at == start - 1:  # the previous step's last row waited for this step's first token
            rows_h, rows_pos, rows_next = (torch.cat([self.h_last, rows_h]), torch.cat([positions[:1] - 1, rows_pos]),
                                           ids)
        if rows_h.shape[0]:
            self.mtp_step(rows_h, rows_next, self.state, rows_pos, kv_len=start + ids.shape[0])
        self.h_last.copy_(h[-1:])
        self.last_at = start + ids.shape[0] - 1

    def begin(self, tokens, cur, pos):
        # a prompt that was entirely cached leaves no hidden state: its first drafts are just weaker
        if self.last_at == len(tokens) - 1:
            self._keep(self.mtp_step(self.h_last, cur, self.state, pos - 1, kv_len=len(tokens), normed=True))

    def propose(self, cur, pos, kv_len, greedy=True):
        x, y = self.xy[:1], self.xy[1:]
        tok = self._argmax(x, y)
        drafts = [tok]
        at = pos + self.steps  # every draft step's position in one launch, not one add per step
        for i in range(1, self.k):
            x, y = self.mtp_step(x, tok, self.state, at[i - 1:i], kv_len=kv_len, normed=True)
            tok = self._argmax(x, y)
            drafts.append(tok)
        return torch.cat(drafts), None

    def accept(self, h, feats, tokens, n, positions, kv_len):
        if self.fused is not None:  # every row's cache row, the output of row n alone
            self._keep(self.fused.mtp_step(h, tokens, self.state, positions, kv_len=kv_len, only=n, normed=True))
        else:
            self._keep(self.model.mtp_step(h, tokens, self.state, positions, kv_len=kv_len, normed=True), row=n)
        self.last_at = None

    def live(self):
        return [self.xy]


class DSparkRuntime(Drafter):
    """The DSpark block drafter (`lingls.model.dspark`) at run time: its context KV cache (one row per consumed
    position, from the target's residual stream after `target_layer_ids`, appended by every prefill and verify
    forward) and one round: the B-row block forward, then K <= B drafts chosen left to right through the
    Markov head. Every round runs all B rows (fixed shapes; attention inside the block is bidirectional, so
    fewer rows would change the drafts) and takes the first K.

    The block's own keys and values go into the cache at rows pos..pos+B-1, and every block row attends to the
    rows below pos + B: the context before the block and the block itself, one key range for all B queries (no
    concatenation, no per-row mask). Those rows are past every committed position: the next verify rewrites the
    ones it commits before any query sees them as context, and a later block rewrites the rest.

    The round and the absorption of verified rows run on `ops`: on CUDA the fused kernels (`gemv` for the other
    projections, `gate|up` one GEMV over rows joined at construction, `norm`'s residual add + RMSNorm, and
    `kernels.dspark`: the joined q|k|v GEMV with the q/k norm, RoPE and cache write in its launch,
    split-sequence block attention, the Markov-corrected greedy choice), elsewhere their plain-torch
    references: one wiring, checked on any CPU.

    Greedy: slot by slot, the Markov-corrected argmax over the vocabulary shards (no gathered logits).
    Sampling: each draft is drawn from the drafter's own corrected distribution q_i = target_probs(logits_i +
    markov(d_{i-1})) (the temperature and top-p the target uses), which is returned as the q of the rejection
    rule, so the output is distributed as the target's samples."""

    name = "dspark"

    def __init__(self, model: LingForCausalLM, drafter, k: int, capacity: int, runner: ModelRunner,
                 kernels: bool | None = None):
        """kernels: the fused kernels (default: on CUDA with Triton) or their references."""
        from lingls.kernels import reference as ref
        from lingls.kernels import triton
        from lingls.runtime.fused_step import fuse_rows

        cfg = drafter.config
        if not 1 <= k <= cfg.block_size:
            raise ValueError(f"K={k}: a DSpark round drafts 1..block_size ({cfg.block_size}) tokens")
        super().__init__(k)
        self.model, self.drafter, self.runner = model, drafter, runner
        self.target_layers = tuple(cfg.target_layer_ids)
        dev, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        attn = drafter.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.heads, attn.kv_heads, attn.head_dim
        b = self.block = cfg.block_size
        # context rows for every position the runner can hold, and the block's rows past the last of them
        shape = (cfg.num_hidden_layers, capacity + b + 1, attn.kv_heads, attn.head_dim)
        self.ctx_k = torch.zeros(shape, device=dev, dtype=dtype)
        self.ctx_v = torch.zeros(shape, device=dev, dtype=dtype)
        self.masks = torch.full((b - 1,), cfg.mask_token_id, dtype=torch.long, device=dev)  # the block after the anchor
        self.slots = torch.arange(b, device=dev)
        self.vocab = torch.arange(model.config.vocab_size, device=dev)
        self.drafts = torch.zeros(b, dtype=torch.long, device=dev)
        self.inv_freq = ref.rope_inv_freq(attn.head_dim, cfg.rope_theta, dev)
        if kernels is None:
            kernels = dev.type == "cuda" and triton is not None
        self.ops = _DSparkOps(kernels)
        self.qkv = [fuse_rows([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                    for a in (layer.self_attn for layer in drafter.layers)]
        self.gate_up = [fuse_rows([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]) for layer in drafter.layers]
        self.markov_w1 = drafter.markov_head.markov_w1.weight.detach()
        self.markov_w2 = drafter.markov_head.markov_w2.weight.detach()

    def _reduce_add_norm(self, a, residual, weight):
        """(rms_norm(residual + all_reduce(a)), the new residual), as `FusedStep._reduce_add_norm`."""
        par, eps = self.model.par, self.drafter.config.rms_norm_eps
        if par.all_reduce_add_norm is not None and self.ops.kernels:
            return par.all_reduce_add_norm(a, residual, weight, eps)
        return self.ops.add_rms_norm(par.all_reduce(a), residual, weight, eps)

    def _absorb(self, feats, positions):
        """Context rows of consecutive positions from the target's features: fc, hidden_norm, then every
        layer's k_proj -> k_norm -> RoPE and v_proj into the cache."""
        ops, dr = self.ops, self.drafter
        c, _ = ops.add_rms_norm(ops.linear(feats, dr.fc.weight), None, dr.hidden_norm.weight,
                                dr.config.rms_norm_eps)
        kv_rows = self.heads * self.head_dim
        for i, layer in enumerate(dr.layers):
            norm = layer.self_attn.k_norm.weight
            ops.qkv_rope(c, self.qkv[i][kv_rows:], norm, norm, self.inv_freq, positions[:1], self.ctx_k[i],
                         self.ctx_v[i], 0, self.kv_heads, dr.config.rms_norm_eps)

    def prefill(self, h, feats, ids, positions, start):
        self._absorb(feats, positions)

    def block_hidden(self, cur, pos, kv_len: int) -> torch.Tensor:
        """The block [cur, mask x (B-1)] at pos.. through the drafter: its final-normed rows [B, hidden]."""
        ops, dr, eps = self.ops, self.drafter, self.drafter.config.rms_norm_eps
        layers = dr.layers
        x, h = ops.embed_rms_norm(torch.cat([cur, self.masks]), self.model.model.word_embeddings.weight,
                                  layers[0].input_layernorm.weight, eps)
        kv = kv_len + self.block  # the rows the attention's grid covers (static): the block's are below it
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            q = ops.qkv_rope(x, self.qkv[i], attn.q_norm.weight, attn.k_norm.weight, self.inv_freq, pos,
                             self.ctx_k[i], self.ctx_v[i], self.heads, self.kv_heads, eps)
            o = ops.attend(q, self.ctx_k[i], self.ctx_v[i], pos, kv,
                           (attn.o_proj.weight, self.gate_up[i], layer.mlp.down_proj.weight))
            x, h = self._reduce_add_norm(ops.linear(o, attn.o_proj.weight), h, layer.post_attention_layernorm.weight)
            m = ops.linear(ops.linear(x, self.gate_up[i], swiglu=True, limit=layer.mlp.limit),
                           layer.mlp.down_proj.weight)
            norm = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else dr.norm.weight
            x, h = self._reduce_add_norm(m, h, norm)
        return x

    def block_logits(self, cur, pos, kv_len: int) -> torch.Tensor:
        """This rank's vocabulary shard of the block's logits [B, V_local] before the Markov bias."""
        return self.ops.linear(self.block_hidden(cur, pos, kv_len), self.model.lm_head.weight)

    def _choose_on_device(self, local, cur) -> torch.Tensor:
        """The greedy drafts by `kernels.dspark.markov_choose`, one launch per slot, each token written once into
        `drafts`: at TP=1 by its own slot's launch; under TP each launch's exchange message is all-reduced and
        decided by the next slot's launch (the last by `pick_rows`)."""
        from lingls.kernels.dspark import markov_choose
        from lingls.kernels.sampling import pick_rows

        par, w1, w2, drafts = self.model.par, self.markov_w1, self.markov_w2, self.drafts
        prev = cur
        for i in range(self.k):
            row = local[i:i + 1]
            if par.size == 1:
                prev = markov_choose(row, prev, w1, w2, out=drafts[i:i + 1])
            else:
                prev = par.all_reduce(markov_choose(row, prev, w1, w2, par.rank, par.size,
                                                    prev_out=drafts[i - 1:i] if i else None))
        if par.size > 1:
            pick_rows(prev, out=drafts[self.k - 1:self.k])
        return drafts[:self.k]

    def propose(self, cur, pos, kv_len, greedy=True):
        m, dr, r = self.model, self.drafter, self.runner
        local = self.block_logits(cur, pos, kv_len)
        if greedy and self.ops.kernels:
            return self._choose_on_device(local, cur), None
        prev, drafts, qs = cur, [], []
        for i in range(self.k):  # semi-autoregressive: each draft biases the next through the Markov head
            row = local[i:i + 1] + dr.markov_bias(prev).to(local.dtype)
            if greedy:  # slot by slot, the Markov-corrected argmax over the vocabulary shards
                prev = argmax_shards(row, m.par)
            else:
                q = target_probs(m.par.all_gather_last(row), r.temperature, r.top_p)
                noise = -torch.log(uniform_hash(r.seed, pos + 1 + i, DRAFT_KEY - self.vocab))
                prev = (q / noise).argmax(-1)
                qs.append(q)
            drafts.append(prev)
        return torch.cat(drafts), None if greedy else torch.cat(qs)

    def accept(self, h, feats, tokens, n, positions, kv_len):
        self._absorb(feats, positions)


class _DSparkOps:
    """The DSpark round's kernels, or their references (same signatures), as `fused_step._Ops`."""

    def __init__(self, kernels: bool):
        from lingls.kernels import dspark, gemv, norm

        self.kernels = kernels
        self.linear = _rows_linear if kernels else gemv.gemv_reference
        # programmatic dependent launch where the model's step uses it: a GEMV's weights stream in while the
        # kernel before it finishes
        self.add_rms_norm = partial(norm.fused_add_rms_norm, pdl=True) if kernels else norm.add_rms_norm_reference
        self.embed_rms_norm = (partial(norm.fused_embed_rms_norm, pdl=True) if kernels
                               else norm.embed_rms_norm_reference)
        self.qkv_rope = _rows_qkv_rope if kernels else dspark.block_qkv_rope_reference
        self.attend = dspark.block_attend if kernels else dspark.block_attend_reference


def _rows_linear(x, w, swiglu: bool = False, limit: float = 0.0):
    """`gemv.gemv` for up to 16 rows (a round, a verify), its reference for more (a prefill chunk)."""
    from lingls.kernels import gemv

    if x.shape[0] <= gemv.MAX_T:
        return gemv.gemv(x, w, swiglu=swiglu, limit=limit, pdl=x.is_cuda)
    return gemv.gemv_reference(x, w, swiglu=swiglu, limit=limit)


def _rows_qkv_rope(x, w, *args):
    """`dspark.block_qkv_rope` (the q|k|v GEMV with the q/k norm, RoPE and cache write) for up to 16 rows (a
    round, a verify), the GEMV's reference and then `dspark.block_qk_rope` for more (a prefill chunk)."""
    from lingls.kernels import dspark, gemv

    if x.shape[0] <= gemv.MAX_T:
        return dspark.block_qkv_rope(x, w, *args, pdl=x.is_cuda)
    return dspark.block_qk_rope(gemv.gemv_reference(x, w), *args)


class Fallback(Drafter):
    """Lookup first (code repeats itself: when it matches it is nearly free and often long), the model drafter
    otherwise. Both run every round (fixed shapes); the choice is a `where` on the device."""

    def __init__(self, lookup: LookupDrafter, other: Drafter):
        super().__init__(lookup.k)
        self.lookup, self.other = lookup, other
        self.target_layers = other.target_layers
        self.name = f"{lookup.name}+{other.name}"

    def prefill(self, *a):
        self.lookup.prefill(*a)
        self.other.prefill(*a)

    def begin(self, *a):
        self.lookup.begin(*a)
        self.other.begin(*a)

    def propose(self, cur, pos, kv_len, greedy=True):
        d_lookup, _ = self.lookup.propose(cur, pos, kv_len, greedy)
        d_other, q_other = self.other.propose(cur, pos, kv_len, greedy)
        drafts = torch.where(self.lookup.found, d_lookup, d_other)
        if q_other is None:
            return drafts, None
        one_hot = torch.nn.functional.one_hot(d_lookup, q_other.shape[-1]).to(q_other.dtype)
        return drafts, torch.where(self.lookup.found, one_hot, q_other)

    def accept(self, *a):
        self.lookup.accept(*a)
        self.other.accept(*a)

    def live(self):
        return self.lookup.live() + self.other.live()


def default_k(device: torch.device) -> int:
    """K for lookup and MTP when none is given: on CPU a verify step costs ~1.6 decode steps at K=4, so short
    drafts pay best there (bench/results/spec_cpu*.json); on a GPU it costs about one. A block drafter's
    default is its block size."""
    return DEFAULT_K if device.type == "cuda" else 2


def make_drafter(spec: str, runner: ModelRunner, k: int | None = None, vocab: str | None = None) -> Drafter | None:
    """Build the drafter named by a `--draft` string (None for "none"); k: drafted tokens per round (None: the
    block drafter's block size, else `default_k`; a block drafter drafts at most its block size); vocab: a
    draft-vocabulary file for the MTP drafter's head (`draft_vocab`)."""
    parts = [p for p in spec.split("+") if p]
    if not parts or parts == ["none"]:
        if vocab is not None:
            raise ValueError("--draft-vocab needs a drafter (--draft mtp)")
        return None
    if vocab is not None and "mtp" not in parts:
        raise ValueError("--draft-vocab applies to the MTP drafter's head (--draft mtp or lookup+mtp)")
    if k is not None and k < 1:
        raise ValueError(f"--draft-k {k}: must be >= 1")
    blocks = {p: _load_block_drafter(p, runner) for p in parts if p not in ("lookup", "mtp")}
    if blocks:  # the model drafter decides K: its block size by default, never more
        size = next(iter(blocks.values())).config.block_size
        k = size if k is None else min(k, size)
    elif k is None:
        k = default_k(runner.device)
    made = [DSparkRuntime(runner.model, blocks[p], k, runner.capacity, runner) if p in blocks
            else _one_drafter(p, runner, k, vocab) for p in parts]
    if len(made) == 1:
        return made[0]
    if len(made) != 2 or not isinstance(made[0], LookupDrafter) or isinstance(made[1], LookupDrafter):
        raise ValueError(f"--draft {spec}: combine as lookup+DRAFTER (lookup first, one model drafter after it)")
    return Fallback(made[0], made[1])


def _one_drafter(name: str, runner: ModelRunner, k: int, vocab: str | None = None) -> Drafter:
    if name == "lookup":
        return LookupDrafter(k, runner.capacity, runner.device)
    fused = runner.fused if isinstance(runner.fused, FusedStep) else None  # else the model's own MTP step
    return MTPDrafter(runner.model, runner.state, k, fused,
                      DraftVocab.load(vocab, runner.model) if vocab is not None else None)


def _load_block_drafter(path: str, runner: ModelRunner):
    """The DSpark drafter in directory `path`, this rank's shard."""
    from lingls.model import dspark

    model = runner.model
    if not dspark.is_dspark_dir(path):
        raise ValueError(f"--draft {path}: not none, mtp, lookup or a drafter directory (a DSpark checkpoint: "
                         "config.json with dflash_config or a DSpark architecture)")
    try:
        return dspark.load_dspark(path, model.config, par=model.par, device=runner.device,
                                  dtype=model.lm_head.weight.dtype)
    except dspark.DSparkConfigError as e:
        raise ValueError(f"--draft {path}: {e}") from None


# ---- the speculative runner ------------------------------------------------------------------------------------
@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0  # drafts accepted
    tokens: int = 0  # tokens produced by rounds (accepted + one per round)
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def accept_length(self) -> float:
        """Tokens per verify step (the accepted drafts plus the target's own token), as SGLang reports it."""
        return self.tokens / self.rounds if self.rounds else 0.0


class _Clock:
    """Draft and verify times per round: wall clock on CPU (synchronous), CUDA events on GPU (read with the
    round's result, which the host has already waited for, so timing adds no synchronisation)."""

    def __init__(self, device: torch.device, slots: int):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(slots)]
        self.times = [[0.0, 0.0, 0.0] for _ in range(slots)]

    def mark(self, slot: int, i: int) -> None:
        if self.cuda:
            self.events[slot][i].record()
        else:
            self.times[slot][i] = time.perf_counter()

    def read(self, slot: int) -> tuple[float, float]:
        if self.cuda:
            e = self.events[slot]
            return e[0].elapsed_time(e[1]) / 1e3, e[1].elapsed_time(e[2]) / 1e3
        t = self.times[slot]
        return t[1] - t[0], t[2] - t[1]


class Speculator:
    """Speculative decoding for one ModelRunner, attached to it (`ModelRunner.attach`): the runner hands it every
    prefill piece's hidden states (so the drafter sees the prompt) and its decode loop.

    The verify step is the fused step's (`FusedStep.step` with `stage`): its kernels where the runner runs them,
    else their torch references (a CPU, or LINGLS_KERNELS=0), whose wiring is the same."""

    def __init__(self, runner: ModelRunner, drafter: Drafter):
        model = runner.model
        if not model.config.kda_safe_gate:
            raise ValueError("speculative verification stages KDA through kernels.kda.kda_step, which implements "
                             "the safe gate only (kda_safe_gate: true)")
        k = drafter.k
        if k + 1 > FusedStep.max_tokens:
            raise ValueError(f"K={k}: a verify step runs at most {FusedStep.max_tokens} tokens (K <= "
                             f"{FusedStep.max_tokens - 1})")
        self.runner, self.model, self.drafter, self.k = runner, model, drafter, k
        self.keep = tuple(drafter.target_layers)  # the layers whose outputs are the drafter's features
        self.verify_step = runner.fused if isinstance(runner.fused, FusedStep) else FusedStep(model, kernels=False)
        state, dev = runner.state, runner.device
        n_kda, heads, d = state.kda.shape[0], state.kda.shape[1], state.kda.shape[-1]
        self.stage_kda = torch.zeros(n_kda, k + 1, heads, kda.STAGE_ROWS, d, device=dev, dtype=state.kda.dtype)
        self.stage_conv = torch.zeros(state.conv.shape[0], k + 1, *state.conv.shape[1:3], device=dev,
                                      dtype=state.conv.dtype)  # [n_kda, K+1, 3, C]: the conv's inputs
        self.ids = torch.zeros(k + 1, dtype=torch.long, device=dev)  # [cur, drafts]
        self.q = None  # drafter distributions of the pending round (None: deterministic drafts)
        self.arange = torch.arange(k + 1, device=dev)
        self.result = torch.zeros(k + 2, dtype=torch.long, device=dev)  # [n, tokens...]
        self.fence = Fence(dev, 2, k + 2)
        self.clock = _Clock(dev, 2)
        self.stats = SpecStats()
        # simulated acceptance (benchmarks at random weights, where real drafts are never accepted): a long
        # device tensor [1] whose value, clamped to 0..K, replaces every round's accepted count (set it before
        # the first round; graphs read its current value at each replay)
        self.force_accept: torch.Tensor | None = None
        self.graphs = GraphSet(shares=runner.graphs)  # the round's phases, in the pool of the runner's steps
        runner.attach(self)

    # ---- target forwards ---------------------------------------------------------------------------------------
    def _features(self, kept: dict) -> torch.Tensor | None:
        """The drafter's features: the residual streams after its target layers, concatenated."""
        return torch.cat([kept[i] for i in self.keep], -1) if self.keep else None

    def prefill(self, h, kept: dict, ids, positions, start: int) -> None:
        """After each prefill piece of the runner (`ModelRunner.prefill_step`): the drafter absorbs it."""
        self.drafter.prefill(h, self._features(kept), ids, positions, start)

    def target(self, ids, positions, kv_len: int, staged: bool):
        """The target's step over the K+1 tokens of a round, with KDA staged per position when `staged` (see the
        module note): (hidden, the drafter's features, the hidden's final norm)."""
        h, kept, normed = self.verify_step.step(ids, self.runner.state, positions, kv_len, keep=self.keep,
                                                stage=(self.stage_kda, self.stage_conv) if staged else None,
                                                normed=True)
        return h, self._features(kept), normed

    # ---- one round ---------------------------------------------------------------------------------------------
    def _draft(self, kv_len: int, greedy: bool) -> None:
        r = self.runner
        drafts, q = self.drafter.propose(r.ids[:1], r.pos, kv_len, greedy)
        self.ids[1:].copy_(drafts)  # ids[0], the current token, was written by the last round's settle
        self.q = q

    def _verify(self, kv_len: int, greedy: bool) -> None:
        r, m, state = self.runner, self.model, self.runner.state
        positions = r.pos + self.arange
        h, feats, normed = self.target(self.ids, positions, kv_len, staged=True)
        local = self.verify_step.head(h, normed)  # this rank's vocab shard
        if greedy:  # n: the leading drafts equal to the target's argmax, decided in `settle`
            n, choice = None, argmax_shards(local, m.par)
        else:
            n, choice = rejection_sample(m.par.all_gather_last(local), self.ids[1:], self.q, positions + 1,
                                         r.temperature, r.top_p, r.seed)
        # [n, tokens] into the result, the next input token into both id buffers, the position advanced; with
        # force_accept the round claims the first n drafts, then the target's own token
        n, tokens = accept.settle(choice, self.ids[1:], (r.ids[:1], self.ids[:1]), r.pos, self.result, n=n,
                                  force=self.force_accept)
        kda.commit(n, state.kda, self.stage_kda, state.conv, self.stage_conv)
        self.drafter.accept(h, feats, tokens, n, positions, kv_len)

    def _launch(self, kv_len: int, greedy: bool, slot: int) -> None:
        self.clock.mark(slot, 0)
        self._run(("draft", kv_len, greedy), lambda: self._draft(kv_len, greedy))
        self.clock.mark(slot, 1)
        self._run(("verify", kv_len, greedy, self.force_accept is not None), lambda: self._verify(kv_len, greedy))
        self.clock.mark(slot, 2)
        self.fence.post(slot, self.result)

    def _run(self, key: tuple, body) -> None:
        """Launch one phase: a graph replay on CUDA (captured on first use)."""
        if not self.runner.use_graphs:
            body()
            return
        self.graphs.run(key, body, self.live())

    def live(self) -> list[torch.Tensor]:
        """What a round changes, which a capture's runs must leave as they were (rows written past the current
        position are masked and rewritten, as in any round)."""
        r = self.runner
        return [r.state.kda, r.state.conv, r.ids, r.pos, self.ids, self.result, *self.drafter.live()]

    # ---- the loop ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, max_new: int, greedy: bool) -> Iterator[int]:
        """Like `ModelRunner.decode`: yield up to max_new tokens after `prefill`. The host launches round r+1,
        then reads round r. When it stops (max_new, or the iterator is closed), it still reads every launched
        round so that the prefix cache's token list matches what the state has consumed."""
        r, k, fence, cache = self.runner, self.k, self.fence, self.runner.cache
        position = len(cache.tokens)  # host mirror of r.pos, as of the rounds read so far
        self.drafter.begin(cache.tokens, r.ids[:1], r.pos)
        self.ids[:1].copy_(r.ids[:1])  # the first round's current token (later rounds' come from settle)
        self.result[:1].zero_()  # the prefill's token: a pseudo-round with no drafts
        self.result[1:2].copy_(r.ids[:1])
        fence.post(0, self.result)
        unread = [(0, False)]  # (slot, is a round) of posted results, oldest first
        emitted, launched = 0, 0
        try:
            while unread:
                rounds_unread = sum(is_round for _, is_round in unread)
                top = position + (k + 1) * rounds_unread  # the furthest r.pos can be now
                if emitted + len(unread) < max_new and top + k + 1 < r.capacity:
                    slot = (launched + 1) % 2
                    self._launch(r.bucket(top + k + 1), greedy, slot)
                    launched += 1
                    unread.append((slot, True))
                slot, is_round = unread.pop(0)
                n, tokens = self._read(slot, is_round)
                position += n + 1 if is_round else 0
                # tokens[:n] were consumed by their own round; the last by the next round, if it was launched
                cache.tokens.extend(tokens[:n] + (tokens[n:] if unread else []))
                for token in tokens:
                    if emitted == max_new:
                        break
                    emitted += 1
                    yield token
                if emitted == max_new:
                    self._drain(unread)
                    return
        except GeneratorExit:
            self._drain(unread)
            raise
        except BaseException:
            cache.reset()
            raise

    def _read(self, slot: int, is_round: bool) -> tuple[int, list[int]]:
        n, *tokens = self.fence.read(slot, self.k + 2)
        if is_round:
            s = self.stats
            s.rounds += 1
            s.drafted += self.k
            s.accepted += n
            s.tokens += n + 1
            draft_s, verify_s = self.clock.read(slot)
            s.draft_s += draft_s
            s.verify_s += verify_s
        return n, tokens[: n + 1]

    def _drain(self, unread: list) -> None:
        """Account for the rounds still in flight (their consumed tokens) without emitting them."""
        while unread:
            slot, is_round = unread.pop(0)
            n, tokens = self._read(slot, is_round)
            self.runner.cache.tokens.extend(tokens[:n] + (tokens[n:] if unread else []))


def attach(runner: ModelRunner, spec: str, k: int | None = None, vocab: str | None = None) -> Speculator | None:
    """Make `runner` decode speculatively with the drafter(s) named by `spec` (None for "none"); k: drafted
    tokens per round (`make_drafter`); vocab: a draft-vocabulary file for the MTP head."""
    drafter = make_drafter(spec, runner, k, vocab)
    return Speculator(runner, drafter) if drafter is not None else None
