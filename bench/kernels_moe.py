"""H200 benchmark of the batch-1 GEMV, fused MoE and lm_head-choice kernels at Ling-3.0-flash TP=4 rank shapes.

    python -m bench.kernels_moe OUT.json            # on the GPU machine: checks, then times
    TRITON_INTERPRET=1 python -m bench.kernels_moe OUT.json --dry   # this script's plumbing on CPU, tiny shapes

1. Correctness on the GPU against the references at the real shapes (fresh random weights, outputs poisoned),
   including graph replays == eager calls (the self-resetting counters).
2. Time: every variant is captured in a CUDA graph of LAYERS consecutive calls, each on a different layer's
   weights (as in a real step: no L2 reuse between calls), and the graph replays are timed with
   triton.testing.do_bench (median, L2 flushed between replays); time per call = median / LAYERS.
3. Floor: bytes the call must read (the weights it touches: for MoE the router + the distinct experts the
   tokens actually chose + the shared expert; plus activations) over the copy bandwidth measured in the same run.
The torch peers run the same math the model runs eagerly today (bf16 F.linear, argmax, the gather-einsum MoE),
captured the same way. Per-launch times of the fused MoE come from one profiled replay.
"""

from __future__ import annotations

import argparse
import platform

import torch

from bench.common import write_result
from lingls.kernels import gemv as G
from lingls.kernels import moe as M
from lingls.kernels import sampling as S

FLASH_TP4 = dict(h=2560, e=512, i=192, i_s=192, top_k=8, n_group=8, topk_group=4, vocab=39296)
TINY = dict(h=128, e=32, i=32, i_s=32, top_k=4, n_group=4, topk_group=2, vocab=1000)
# GEMV shapes of one TP=4 rank: (name, N, K, epilogue)
GEMV_SHAPES = [("kda_qkvfgb", 5 * 1024 + 8, 2560, None), ("kda_o+res", 2560, 1024, "residual"),
               ("mla_q", 1536, 2560, None), ("mla_kv_a", 576, 2560, None),
               ("dense_gate_up+swiglu", 1536, 2560, "swiglu"), ("dense_down+res", 2560, 1536, "residual")]


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def rnd(*shape, scale=1.0, dtype=torch.bfloat16, dev="cuda"):
    return (torch.randn(*shape, device=dev) * scale).to(dtype)


def moe_layer(c, dev):
    h, e, i, i_s = c["h"], c["e"], c["i"], c["i_s"]
    return M.prepare_moe_weights(rnd(e, h, scale=h ** -0.5, dev=dev), rnd(e, scale=0.05, dtype=torch.float32, dev=dev),
                                 rnd(e, 2 * i, h, scale=h ** -0.5, dev=dev), rnd(e, h, i, scale=i ** -0.5, dev=dev),
                                 rnd(i_s, h, scale=h ** -0.5, dev=dev), rnd(i_s, h, scale=h ** -0.5, dev=dev),
                                 rnd(h, i_s, scale=i_s ** -0.5, dev=dev))


def moe_cfg(c):
    return dict(top_k=c["top_k"], n_group=c["n_group"], topk_group=c["topk_group"], normalize=True, scale=2.5,
                limit=0.0, shared_limit=0.0)


def check(c, dev, log):
    """Every kernel against its reference at these shapes; returns {name: error} and asserts the bounds."""
    errs = {}
    for t in (1, 9, 16):
        for name, n, k, epi in GEMV_SHAPES:
            n, k = (n, k) if c is FLASH_TP4 else (min(n, 96), min(k, 256))
            x = rnd(t, k, dev=dev)
            w = rnd(2 * n if epi == "swiglu" else n, k, scale=k ** -0.5, dev=dev)
            res = rnd(t, n, dev=dev) if epi == "residual" else None
            out = torch.full((t, n), float("nan"), device=dev)
            G.gemv(x, w, res, epi == "swiglu", out=out)
            errs[f"gemv {name} T={t} (fp32 out)"] = rel(out, G.gemv_reference(x.float(), w.float(), res,
                                                                               epi == "swiglu"))
        w = moe_layer(c, dev)
        x = rnd(t, c["h"], dev=dev)
        cfg = moe_cfg(c)
        out, tw, ti = M.fused_moe(x, *w, return_routing=True, **cfg)
        ref_out, rw, ri = M.fused_moe_reference(x, *w, return_routing=True, **cfg)
        same = sum(set(a.tolist()) == set(b.tolist()) for a, b in zip(ti.cpu(), ri.cpu()))
        log(f"  moe T={t}: routing sets equal for {same}/{t} tokens (differences must be near-ties)")
        errs[f"moe T={t} (kernel routing)"] = rel(out, M.fused_moe_reference(x, *w, routing=(tw, ti), **cfg))
        if same == t:
            errs[f"moe T={t} (reference routing)"] = rel(out, ref_out)
        lw = rnd(c["vocab"], c["h"], scale=c["h"] ** -0.5, dev=dev)
        _, idx = S.lm_head_choose(x, lw)
        logits = x.double() @ lw.double().t()
        gap = logits.max(-1).values - logits.gather(1, idx[:, None]).squeeze(1)
        errs[f"lm_head greedy T={t} (logit gap)"] = gap.abs().max().item()
        pos = torch.arange(t, device=dev) + 77
        temp, seed = torch.tensor([0.7], device=dev), torch.tensor([12345], device=dev)
        _, sidx = S.lm_head_choose(x, lw, True, pos, temp, seed)
        ridx = S.lm_head_choose_reference(x, lw, True, pos, temp, seed)[1]
        errs[f"lm_head sample T={t} (mismatches)"] = float((sidx != ridx).sum())
    bound = lambda k: 1e-5 if "fp32" in k or "gap" in k else 1e-2 if "moe" in k else 0.5  # noqa: E731
    bad = {k: v for k, v in errs.items() if not v < bound(k)}
    for k, v in errs.items():
        log(f"  {k}: {v:.3g}")
    assert not bad, f"correctness failures: {bad}"
    return errs


def graph_time(fns, reps_ms=200):
    """Capture the calls (one per layer) in one CUDA graph; median replay time per call in microseconds."""
    import triton.testing

    for f in fns:  # compile / allocate outside the capture
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(g.replay, warmup=50, rep=reps_ms, return_mode="median")
    return ms * 1e3 / len(fns), g


def kernel_breakdown(g, n_calls):
    """Per-kernel GPU time (us per call) from one profiled replay."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            out[ev.key] = t / n_calls
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="JSON results path")
    ap.add_argument("--dry", action="store_true", help="CPU interpreter, tiny shapes, checks only")
    ap.add_argument("--layers", type=int, default=8, help="weight sets per captured graph (defeats L2 reuse)")
    args = ap.parse_args()
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    dev = "cpu" if args.dry else "cuda"
    c = TINY if args.dry else FLASH_TP4
    torch.manual_seed(0)
    result = {"config": c, "torch": torch.__version__, "python": platform.python_version()}
    if not args.dry:
        import triton
        result.update(device=torch.cuda.get_device_name(), triton=triton.__version__)
    log("correctness:")
    result["errors"] = check(c, dev, log)
    if args.dry:
        write_result(args.out, result)
        return

    import triton.testing

    buf = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(buf)
    copy_ms = triton.testing.do_bench(lambda dst=dst, buf=buf: dst.copy_(buf), warmup=50, rep=300, return_mode="median")
    bw = 2 * buf.numel() / (copy_ms * 1e-3)  # bytes/s, read + write
    del buf, dst
    result["copy_TBps"] = bw / 1e12
    log(f"copy bandwidth: {bw / 1e12:.2f} TB/s")
    rows = []

    def row(kernel, t, us, nbytes, torch_us=None, extra=None):
        floor = nbytes / bw * 1e6
        r = dict(kernel=kernel, T=t, us=us, floor_us=floor, bytes=nbytes, x_floor=us / floor,
                 torch_us=torch_us, **(extra or {}))
        rows.append(r)
        log(f"{kernel:28s} T={t:2d} {us:8.2f} us  floor {floor:7.2f} us ({us / floor:4.2f}x floor)"
            + (f"  torch {torch_us:8.2f} us" if torch_us else ""))

    L = args.layers
    for t in (1, 9):
        # GEMVs
        for name, n, k, epi in GEMV_SHAPES:
            ws = [rnd(2 * n if epi == "swiglu" else n, k, scale=k ** -0.5) for _ in range(L)]
            x, res = rnd(t, k), rnd(t, n)
            outs = [torch.empty(t, n, dtype=torch.bfloat16, device=dev) for _ in range(L)]
            sw = epi == "swiglu"
            r_ = res if epi == "residual" else None
            us, _ = graph_time([lambda w=w, o=o: G.gemv(x, w, r_, sw, out=o) for w, o in zip(ws, outs)])

            def peer(w):
                y = x @ w.t()
                if sw:
                    y = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
                return y + res if r_ is not None else y

            tus, _ = graph_time([lambda w=w: peer(w) for w in ws])
            nbytes = ws[0].numel() * 2 + (t * k + t * n * (2 if r_ is not None else 1)) * 2
            row(f"gemv {name}", t, us, nbytes, tus)
            del ws
        # fused MoE
        layers = [moe_layer(c, dev) for _ in range(L)]
        x = rnd(t, c["h"])
        cfg = moe_cfg(c)
        distinct = []
        for w in layers:
            _, _, ti = M.fused_moe(x, *w, return_routing=True, **cfg)
            distinct.append(len(set(ti.flatten().tolist())))
        us, g = graph_time([lambda w=w: M.fused_moe(x, *w, **cfg) for w in layers])
        per_kernel = kernel_breakdown(g, L)
        tus, _ = graph_time([lambda w=w: M.fused_moe_reference(x, *w, compute_dtype=torch.bfloat16, **cfg)
                             for w in layers])
        h, e, i, i_s = c["h"], c["e"], c["i"], c["i_s"]
        d_mean = sum(distinct) / len(distinct)
        nbytes = (e * h + d_mean * 3 * h * i + 3 * h * i_s + 2 * t * h) * 2
        row("fused_moe (3 launches)", t, us, nbytes, tus, dict(distinct_experts=d_mean, per_kernel_us=per_kernel))
        for kname, kus in per_kernel.items():
            log(f"    {kname[:60]:60s} {kus:8.2f} us")
        del layers
        # lm_head + choice (one weight: 0.2 GB does not fit in L2)
        lw = rnd(c["vocab"], h, scale=h ** -0.5)
        pos, temp, seed = torch.arange(t, device=dev), torch.tensor([0.7], device=dev), torch.tensor([1], device=dev)
        nbytes = lw.numel() * 2 + t * h * 2
        us, _ = graph_time([lambda lw=lw: S.lm_head_choose(x, lw)])
        tus, _ = graph_time([lambda lw=lw: (x @ lw.t()).argmax(-1)])
        row("lm_head greedy", t, us, nbytes, tus)
        us, _ = graph_time([lambda lw=lw: S.lm_head_choose(x, lw, True, pos, temp, seed)])
        row("lm_head sample (top_p=1)", t, us, nbytes)
        del lw
    result["rows"] = rows
    # graph replays must keep giving the eager answer on new inputs (counters reset, routing read on device)
    w, cfg = moe_layer(c, dev), moe_cfg(c)
    x = rnd(9, c["h"])
    captured = torch.empty_like(x)
    _, g = graph_time([lambda: captured.copy_(M.fused_moe(x, *w, **cfg))])
    for _ in range(3):
        x.copy_(rnd(9, c["h"]))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, M.fused_moe(x, *w, **cfg)), "graph replay differs from an eager call"
    result["graph_replay_equals_eager"] = True
    log("fused_moe graph replay == eager call on 3 new inputs")

    write_result(args.out, result)
    log(f"\n{'kernel':28s} {'T':>2s} {'us':>8s} {'floor':>8s} {'x floor':>7s} {'torch us':>8s}")
    for r in rows:
        log(f"{r['kernel']:28s} {r['T']:2d} {r['us']:8.2f} {r['floor_us']:8.2f} {r['us'] / r['floor_us']:7.2f} "
            + (f"{r['torch_us']:8.2f}" if r["torch_us"] else ""))


if __name__ == "__main__":
    main()
