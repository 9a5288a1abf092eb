"""Token choice on the device: greedy, or temperature + top-p with a seeded, counter-based random stream.

The random numbers are a hash of (seed, position, token id), not a stateful generator: no RNG state to
advance (CUDA-graph replays stay reproducible), the same seed gives the same completion on CPU and GPU and
after a prefix-cache restore, and every tensor-parallel rank draws the same token from the same (gathered)
logits without a broadcast. Sampling uses the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks
i with probability p_i. The greedy choice needs no gathered logits at all (`argmax_shards`).
"""

from __future__ import annotations

import torch

from lingls.kernels.reference import uniform_hash


def sample(logits: torch.Tensor, positions: torch.Tensor, greedy: bool, temperature: torch.Tensor | None = None,
           top_p: torch.Tensor | None = None, seed: torch.Tensor | None = None) -> torch.Tensor:
    """logits [T, V] (the whole vocab) -> token ids [T] (int64), with no host synchronisation.

    `positions` [T] are the positions the chosen tokens will occupy (they key the random stream);
    temperature, top_p [1] float and seed [1] int64 are device tensors, so one captured graph serves any
    values. `greedy` is a host flag: it selects which graph to capture, not a data-dependent branch.
    """
    if greedy:
        return argmax(logits)
    probs = (logits.float() / temperature.clamp_min(1e-5)).softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # the nucleus; always holds the most likely token
    noise = -torch.log(uniform_hash(seed, positions[:, None], order))  # keyed by token id, not rank
    choice = (sorted_p * keep / noise).argmax(-1, keepdim=True)
    return order.gather(-1, choice).squeeze(-1)


def chosen_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [T, V] (the whole vocab, masked where a choice was constrained), tokens [T] -> the log-probability
    of each chosen token under the model's own distribution (temperature 1, no nucleus) [T] fp32, on the device.
    What a line's confidence is summed from (`engine.local.LineGate`)."""
    logits = logits.float()
    return logits.gather(-1, tokens.view(-1, 1)).squeeze(-1) - logits.logsumexp(-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1): on CUDA the one-launch kernel (`kernels.sampling.argmax_rows`, ~4x faster than
    torch's single-row reduction over a 157k vocabulary)."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1:
        from lingls.kernels.sampling import argmax_rows

        return argmax_rows(logits)
    return logits.argmax(-1)


MAX_EXCHANGED_ID = 1 << 24  # token ids travel as fp32 in `argmax_shards`' exchange: exact below 2^24


def argmax_shards(local: torch.Tensor, par, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy choice over a vocabulary split across tensor-parallel ranks, without gathering the logits.

    local [T, V_local]: this rank's shard of the logits; rank r's row j is token r * V_local + j, unless `ids`
    [V_local] (int64, on the device) names each row's token (a drafter's reduced vocabulary). par: the model's
    `Parallel`. Returns token ids [T] int64, the same on every rank. Each rank takes its own best (score,
    token) and the ranks swap the pairs in one all-reduce of a [2, ranks, T] fp32 message that is zero outside
    the rank's own slots: a sum that gathers, exact for ids below 2^24. The best score wins, the lowest rank
    on ties, so without `ids` this is `all_gather_last(local).argmax(-1)` token for token.

    Why: gathering a row of Ling-3.0-flash's logits is one NCCL all-gather, ~30 us on two H200s inside a CUDA
    graph, paid by every decode step, verify and draft step; the pairs take one peer all-reduce of a few
    bytes. On CUDA it is three launches: the argmax that writes the message (`kernels.sampling.argmax_rows`),
    the all-reduce, the pick (`pick_rows`)."""
    t, v = local.shape
    offset = par.rank * v
    if ids is None and v * par.size > MAX_EXCHANGED_ID:
        raise ValueError(f"a vocabulary of {v * par.size} ids does not fit the fp32 exchange")
    if local.is_cuda and local.stride(-1) == 1 and par.size & (par.size - 1) == 0:
        from lingls.kernels.sampling import argmax_rows, pick_rows

        if par.size == 1:
            return argmax_rows(local, ids=ids)
        return pick_rows(par.all_reduce(argmax_rows(local, ids=ids, offset=offset, exchange=(par.rank, par.size))))
    i = local.argmax(-1)
    token = ids.index_select(0, i) if ids is not None else i + offset
    if par.size == 1:
        return token
    msg = torch.zeros(2, par.size, t, dtype=torch.float32, device=local.device)
    msg[0, par.rank] = local.gather(-1, i[:, None]).squeeze(-1).float()
    msg[1, par.rank] = token.float()
    msg = par.all_reduce(msg)
    best = msg[0].argmax(0, keepdim=True)  # [1, T]: the first (lowest) rank among equal scores
    return msg[1].gather(0, best).squeeze(0).long()
