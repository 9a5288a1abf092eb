"""Token choice on the device: greedy, or temperature + top-p with a seeded, counter-based random stream.

The random numbers are a hash of (seed, position, token id), not a stateful generator: no RNG state to
advance (CUDA-graph replays stay reproducible), the same seed gives the same completion on CPU and GPU and
after a prefix-cache restore, and every tensor-parallel rank draws the same token from the same (gathered)
logits without a broadcast. Sampling uses the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks
i with probability p_i.
"""

from __future__ import annotations

import torch

from lingls.kernels.reference import uniform_hash

try:
    from lingls.kernels import sampling as fused
except ImportError:  # CPU-only installs without Triton: greedy_tokens forms the logits
    fused = None


def sample(logits: torch.Tensor, positions: torch.Tensor, greedy: bool, temperature: torch.Tensor | None = None,
           top_p: torch.Tensor | None = None, seed: torch.Tensor | None = None) -> torch.Tensor:
    """logits [T, V] (the whole vocab) -> token ids [T] (int64), with no host synchronisation.

    `positions` [T] are the positions the chosen tokens will occupy (they key the random stream);
    temperature, top_p [1] float and seed [1] int64 are device tensors, so one captured graph serves any
    values. `greedy` is a host flag: it selects which graph to capture, not a data-dependent branch.
    """
    if greedy:
        return logits.argmax(-1)
    probs = (logits.float() / temperature.clamp_min(1e-5)).softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # the nucleus; always holds the most likely token
    noise = -torch.log(uniform_hash(seed, positions[:, None], order))  # keyed by token id, not rank
    choice = (sorted_p * keep / noise).argmax(-1, keepdim=True)
    return order.gather(-1, choice).squeeze(-1)


def greedy_tokens(model, x: torch.Tensor) -> torch.Tensor:
    """argmax over the whole vocab of lm_head(x), x [T, hidden] already through its final norm -> ids [T].

    The logits are never formed: on CUDA one launch per rank computes its vocab shard's logits and reduces
    them to a (best logit, global id) per row (`kernels.sampling.lm_head_choose`), and with tensor parallelism
    only those pairs are gathered, not the [T, vocab] logits. Both forms take the first maximum of the fp32
    logits of the bf16 inputs, so every device and rank count chooses the same token."""
    w, par = model.lm_head.weight, model.par
    if fused is None:
        return par.all_gather_last((x.float() @ w.float().t()).contiguous()).argmax(-1)
    val, idx = fused.choose(x.contiguous(), w, vocab_offset=par.rank * w.shape[0])
    if par.size == 1:
        return idx
    pairs = par.all_gather_last(torch.stack([val.double(), idx.double()])).view(2, par.size, -1)  # exact in fp64
    return fused.combine_ranks(pairs[0], pairs[1].long())
