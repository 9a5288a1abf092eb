"""Can a batch-1 step hide weight reads in L2 while the GPU waits? A probe, not part of the runtime.

At one token many phases of a layer leave HBM idle (the MoE routing, the KDA step, the norms: a few
microseconds each), while the next projections' weights are known in advance. This times, in CUDA graphs over
40 distinct 26 MB matrices (the TP=4 KDA input projection's size, 1 GB in all, so nothing stays in L2 by
accident), the GEMV that reads such a matrix:
- cold (the step as it is), and warm (the same matrix every time: the L2-resident speed);
- after an idle phase (one program spinning on the clock for IDLE_US) whose other programs asked L2 for the
  matrix (`prefetch.global.L2`, or the sm_90 bulk prefetch), with or without an expert-sized stream of other
  bytes (26 MB, read normally or marked evict-first) between the prefetch and the GEMV.
Each sequence and each of its parts is timed alone in the same run (µs per layer in the JSON); the GEMV's own
time in a sequence is the sequence's time minus its other parts.

    python bench/l2_probe.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from fused_step_gpu import graphed  # noqa: E402

from lingls.bench.step import copy_bandwidth, median_ms  # noqa: E402
from lingls.kernels.gemv import gemv  # noqa: E402

LAYERS, N, K, IDLE_US = 40, 5128, 2560, 6.0


@triton.jit
def _clock(dummy):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [dummy], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _idle_prefetch_kernel(ptr, n_lines, out_ptr, idle_ns, LINES: tl.constexpr, MODE: tl.constexpr):
    """Program 0 spins for idle_ns; the others ask L2 for LINES 128-byte lines each (MODE 0: none, 1: one
    prefetch per line, evict-last, 2: LINES lines per program by bulk prefetches, one per thread)."""
    pid = tl.program_id(0)
    if pid == 0:
        start = _clock(idle_ns)
        now = start
        while now - start < idle_ns:
            now = _clock(idle_ns)
        tl.store(out_ptr, now - start)
    elif MODE == 1:
        line = tl.minimum((pid - 1) * LINES + tl.arange(0, LINES), n_lines - 1)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [ptr + line.to(tl.int64) * 128], dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == 2:  # each of the program's 128 threads: one bulk prefetch of LINES bytes (LINES lines per program)
        at = tl.minimum((pid - 1) * LINES * 128 + tl.arange(0, 128) * LINES, n_lines * 128 - LINES)
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [ptr + at.to(tl.int64), tl.full((128,), LINES, tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _stream_kernel(ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """Read n bf16 values (as the expert kernels stream theirs), one sum per program."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        if EVICT_FIRST:
            acc += tl.load(ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        else:
            acc += tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def main(out: str) -> None:
    torch.manual_seed(0)
    bw = copy_bandwidth()
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    streams = [torch.randn(N * K, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    sink = torch.empty(65536, device="cuda", dtype=torch.int64)
    fsink = torch.empty(65536, device="cuda")
    n_lines = N * K * 2 // 128
    lines = {1: 512, 2: 2048}

    def idle(w, mode, idle_us=IDLE_US):  # idle_us=0: the prefetching programs alone
        per = lines.get(mode, 1)
        progs = 1 + (triton.cdiv(n_lines, per) if mode else 0)
        _idle_prefetch_kernel[(progs,)](w, n_lines, sink, int(idle_us * 1e3), LINES=per, MODE=mode, num_warps=4)

    def stream(s, evict_first):
        block, iters = 2048, 8
        _stream_kernel[(triton.cdiv(s.numel(), block * iters),)](s, fsink, s.numel(), BLOCK=block, ITERS=iters,
                                                                 EVICT_FIRST=evict_first, num_warps=8)

    def per_layer(fn) -> float:
        replay = graphed(lambda: [fn(i) for i in range(LAYERS)])
        return median_ms(replay, reps=20) * 1e3 / LAYERS

    seqs = {
        "gemv cold": lambda i: gemv(x, ws[i]),
        "gemv warm (same matrix)": lambda i: gemv(x, ws[0]),
        "idle": lambda i: idle(ws[i], 0),
        "idle + prefetch (per line)": lambda i: idle(ws[i], 1),
        "idle + prefetch (bulk)": lambda i: idle(ws[i], 2),
        "prefetch alone (per line)": lambda i: idle(ws[i], 1, 0),
        "prefetch alone (bulk)": lambda i: idle(ws[i], 2, 0),
        "stream": lambda i: stream(streams[i], False),
        "stream evict-first": lambda i: stream(streams[i], True),
        "idle, gemv": lambda i: (idle(ws[i], 0), gemv(x, ws[i])),
        "idle + prefetch (per line), gemv": lambda i: (idle(ws[i], 1), gemv(x, ws[i])),
        "idle + prefetch (bulk), gemv": lambda i: (idle(ws[i], 2), gemv(x, ws[i])),
        "idle, stream, gemv": lambda i: (idle(ws[i], 0), stream(streams[i], False), gemv(x, ws[i])),
        "idle + prefetch (per line), stream, gemv": lambda i: (idle(ws[i], 1), stream(streams[i], False),
                                                              gemv(x, ws[i])),
        "idle + prefetch (per line), stream evict-first, gemv": lambda i: (idle(ws[i], 1), stream(streams[i], True),
                                                                          gemv(x, ws[i])),
        "idle + prefetch (bulk), stream evict-first, gemv": lambda i: (idle(ws[i], 2), stream(streams[i], True),
                                                                      gemv(x, ws[i])),
        "idle, stream evict-first, gemv": lambda i: (idle(ws[i], 0), stream(streams[i], True), gemv(x, ws[i])),
    }
    us = {}
    for name, fn in seqs.items():
        try:
            us[name] = per_layer(fn)
        except Exception as e:  # noqa: BLE001 - a probe: report what failed, time the rest
            us[name] = repr(e)[:200]
        print(f"{us[name] if isinstance(us[name], str) else f'{us[name]:8.2f} us'}  {name}", flush=True)
    floor_us = N * K * 2 / bw * 1e6
    print(f"copy {bw / 1e12:.2f} TB/s; the matrix's floor {floor_us:.2f} us")
    Path(out).write_text(json.dumps(dict(what="L2 prefetch probe (us per layer, 40 layers)",
                                         device=torch.cuda.get_device_name(), copy_bw_tbs=bw / 1e12,
                                         matrix_bytes=N * K * 2, idle_us=IDLE_US, floor_us=floor_us, us=us), indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "l2_probe.json")
