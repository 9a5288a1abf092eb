"""fla-core's chunked KDA for training, with its first-use autotuning bounded.

`lingls.model.ling.delta_rule` runs fla-core's `chunk_kda` (forward and backward Triton kernels) on CUDA whenever
fla is importable. Each of its ~20 autotuned kernels compiles and times 4-48 configurations on first use, which
took minutes for the training shapes; `bound_autotuning` keeps, per kernel, the few configurations nearest the
usual choice (4 warps, 2 stages), one per distinct block size first. Triton's autotune cache
(`TRITON_CACHE_DIR`, results kept on disk through TRITON_CACHE_AUTOTUNING / FLA_CACHE_RESULTS) makes a later
process on the same machine skip even that.
"""

from __future__ import annotations

import sys

import torch


def _rank(config) -> tuple:
    return (abs(config.num_warps - 4), abs(config.num_stages - 2), config.num_warps)


def pick_configs(configs: list, limit: int) -> list:
    """At most `limit` configs: the best-ranked one of each distinct set of block sizes, then the rest by rank."""
    ordered = sorted(configs, key=_rank)
    firsts, seen = [], set()
    for c in ordered:
        key = tuple(sorted(c.kwargs.items(), key=lambda kv: kv[0]))
        if key not in seen:
            seen.add(key)
            firsts.append(c)
    rest = [c for c in ordered if c not in firsts]
    return (firsts + rest)[:limit]


def _autotuners():
    from triton.runtime.autotuner import Autotuner
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in vars(module).values():
            fn, depth = value, 0
            while fn is not None and depth < 4 and not isinstance(fn, Autotuner):
                fn, depth = getattr(fn, "fn", None), depth + 1
            if isinstance(fn, Autotuner):
                found[id(fn)] = fn
    return list(found.values())


def bound_autotuning(limit: int = 3) -> int:
    """Import fla's KDA kernels and cap every fla autotuner at `limit` timed configs (applied after each
    kernel's own pruning, so a config it rules out for the shapes at hand is never the one kept). limit=1 keeps
    a single config and times nothing (what Triton's CPU interpreter needs). Returns how many autotuners."""
    import fla.ops.kda  # noqa: F401 - loads every kernel chunk_kda's forward and backward use

    tuners = _autotuners()
    for tuner in tuners:
        if limit == 1:
            tuner.configs = pick_configs(tuner.configs, 1)
            continue
        prune = tuner.prune_configs

        def bounded(kwargs, _prune=prune):
            return pick_configs(_prune(kwargs), limit)
        tuner.prune_configs = bounded
    return len(tuners)


def enable(use_fla: bool, limit: int = 3) -> bool:
    """Choose the KDA kernel the model trains with: fla-core's chunk_kda (with bounded autotuning) when
    `use_fla` and it imports, else lingls' torch chunked form. Returns whether fla is in use."""
    from lingls.model import ling

    ling._FLA.clear()
    if use_fla and ling.fla_chunk_kda() is not None:
        bound_autotuning(limit)
        return True
    ling._FLA[:] = [None]  # delta_rule then takes the torch forms
    return False


def check_against_torch(device: str = "cuda", batch: int = 2, tokens: int = 512, heads: int = 4, dim: int = 64,
                        lower_bound: float = -5.0, seed: int = 0, tolerance: float = 2e-2) -> dict:
    """fla's chunk_kda against lingls' torch chunked KDA (fp32) on fresh random inputs of the model's kind
    (unit q/k scaled as the model does, Ling's bounded gate, a random initial state): the outputs, the final
    state and the gradients of q, k, v, g and beta. Errors are max |fla - torch| / max |torch|."""
    from lingls.kernels import reference as ref
    from lingls.model import ling

    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q = ref.l2_normalize(rand(batch, tokens, heads, dim)) * dim ** -0.5
    k = ref.l2_normalize(rand(batch, tokens, heads, dim))
    v = rand(batch, tokens, heads, dim)
    g = ref.kda_gate(rand(batch, tokens, heads, dim), rand(heads) * 0.5, rand(heads * dim) * 0.5, lower_bound, True)
    beta = torch.sigmoid(rand(batch, tokens, heads))
    state = rand(batch, heads, dim, dim) * 0.1
    weight_o, weight_s = rand(batch, tokens, heads, dim), rand(batch, heads, dim, dim)
    results = {}
    for name in ("fla", "torch"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        if name == "fla":
            o, s = ling.fla_chunk_kda()(q=xs[0], k=xs[1], v=xs[2], g=xs[3], beta=xs[4], scale=1.0,
                                         initial_state=state, output_final_state=True,
                                         use_qk_l2norm_in_kernel=False)
        else:
            o, s = ref.kda_chunked(*xs, state, lower_bound=lower_bound)
        ((o * weight_o).sum() + (s * weight_s).sum()).backward()
        results[name] = [o.detach(), s.detach()] + [x.grad for x in xs]
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta"]
    errors = {n: float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
              for n, a, b in zip(names, results["fla"], results["torch"])}
    return {"shape": [batch, tokens, heads, dim], "relative_errors": errors, "tolerance": tolerance,
            "ok": all(e <= tolerance for e in errors.values())}
