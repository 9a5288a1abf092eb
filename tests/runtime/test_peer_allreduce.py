"""The one-shot peer all-reduce without GPUs.

- Its kernel's logic (slots, parities, flags, epochs, fixed-order sum) in Triton's interpreter: the ranks' receive
  buffers all live in this process, and each rank's push half runs before any rank's reduce half (the interpreter
  runs programs one after another, so one launch per rank would wait forever for a peer that has not run yet).
- The fallback (gloo on CPU, two processes): the same sums, and `PeerAllReduce.create` agrees, on every rank, to
  step aside.
The real thing (two GPUs, NVLink, CUDA graphs, against NCCL) is bench/tp_gpu.py.
"""

from __future__ import annotations

import multiprocessing
import os
import socket

import pytest
import torch

from lingls.kernels import peer_allreduce as pa

needs_triton = pytest.mark.skipif(pa.triton is None or (not torch.cuda.is_available()
                                                         and os.environ.get("TRITON_INTERPRET") != "1"),
                                  reason="needs Triton (its interpreter on CPU)")


def aligned_zeros(nbytes: int) -> torch.Tensor:
    """A CUDA allocation is 512-byte aligned, which the kernel's vector hints rely on; a CPU one only 64."""
    raw = torch.zeros(nbytes + 512, dtype=torch.uint8)
    start = -raw.data_ptr() % 512
    return raw[start:start + nbytes]


def simulated_ranks(world: int, max_bytes: int = 16 * 2560 * 2) -> list[pa.PeerAllReduce]:
    layout = pa._Layout(world, max_bytes)
    buffers = [aligned_zeros(layout.total) for _ in range(world)]
    return [pa.PeerAllReduce(r, world, buffers[r], [b.data_ptr() for b in buffers], max_bytes) for r in range(world)]


def all_reduce(ranks, xs, outs=None):
    outs = xs if outs is None else outs
    for r, x in zip(ranks, xs):
        r.launch(x, outs[ranks.index(r)], push=True, reduce=False)
    for r, x in zip(ranks, xs):
        r.launch(x, outs[ranks.index(r)], push=False, reduce=True)
    return outs


@needs_triton
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_gets_the_same_sum_call_after_call(world):
    ranks = simulated_ranks(world)
    g = torch.Generator().manual_seed(world)
    for call, t in enumerate([1, 16, 3, 1, 9]):  # sizes change between calls, as verify and decode steps do
        xs = [torch.randn(t, 2560, generator=g).bfloat16() for _ in range(world)]
        want = sum(x.float() for x in xs)
        outs = all_reduce(ranks, xs, [torch.empty_like(x) for x in xs])
        for out in outs[1:]:
            assert torch.equal(out, outs[0])  # bit-identical on every rank: the sum runs in rank order
        # the interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest): within one bf16 step
        torch.testing.assert_close(outs[0].float(), want, rtol=2**-7, atol=2**-7)
        programs = -(-t * 2560 // pa.BLOCK)
        assert all(int(r.error) == 0 for r in ranks)
        assert ranks[0].epochs[:programs].min() >= 1
    # program 0 took part in all five calls: epoch 5, and its flags on every rank say so
    assert [int(r.epochs[0]) for r in ranks] == [5] * world
    for r in ranks:
        assert [int(f) for i, f in enumerate(r.flags[:world]) if i != r.rank] == [5] * (world - 1)


def add_norm(ranks, xs, residuals, weight, eps=1e-6):
    for r, x, res in zip(ranks, xs, residuals):
        r.launch_add_norm(x, res, weight, eps, push=True, reduce=False)
    return [r.launch_add_norm(x, res, weight, eps, push=False, reduce=True) for r, x, res in zip(ranks, xs, residuals)]


@needs_triton
@pytest.mark.parametrize("world", [2, 4])
def test_fused_add_norm_is_the_all_reduce_then_the_norm_kernel_bit_for_bit(world):
    """The fused kernel against the two launches it replaces (the plain all-reduce, then norm.add_rms_norm's
    kernel), call after call with changing row counts, interleaved with plain all-reduces on the other channel."""
    from lingls.kernels.norm import fused_add_rms_norm

    ranks = simulated_ranks(world)
    g = torch.Generator().manual_seed(world)
    weight = torch.randn(2560, generator=g).bfloat16()
    base = torch.randn(16, 2560, generator=g).bfloat16()
    for call, t in enumerate([1, 9, 16, 1, 3]):
        xs = [torch.randn(t, 2560, generator=g).bfloat16() for _ in range(world)]
        kept = [x.clone() for x in xs]
        residuals = [base[:t].clone() for _ in range(world)]
        outs = add_norm(ranks, xs, residuals, weight)
        summed = all_reduce(ranks, [x.clone() for x in kept])[0]  # channel 0, between two fused calls
        want_res = base[:t].clone()
        want, _ = fused_add_rms_norm(summed, want_res, weight, 1e-6)
        for r in range(world):
            assert torch.equal(outs[r], want) and torch.equal(residuals[r], want_res)
            assert torch.equal(xs[r], kept[r])  # the input is not reduced in place
        assert all(int(r.error) == 0 for r in ranks)
    assert [int(r.norm_epochs[0]) for r in ranks] == [5] * world  # row 0 took part in every fused call
    assert [int(r.epochs[0]) for r in ranks] == [5] * world


@needs_triton
def test_fused_add_norm_falls_back_where_the_buffer_cannot_take_it():
    """CPU tensors (and messages too large) take the two-step path: the process group's all-reduce, the norm."""
    ranks = simulated_ranks(2)
    calls = []
    ranks[0].__class__ = type("Counting", (pa.PeerAllReduce,), {"__call__": lambda self, x: calls.append(x) or x})
    x, res, w = torch.randn(2, 2560).bfloat16(), torch.randn(2, 2560).bfloat16(), torch.ones(2560).bfloat16()
    want_res = res.clone()
    from lingls.kernels.norm import add_rms_norm_reference

    want, _ = add_rms_norm_reference(x, want_res, w, 1e-6)
    out, new_res = ranks[0].add_rms_norm(x, res, w, 1e-6)
    assert len(calls) == 1 and new_res is res and torch.equal(res, want_res)
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=2**-7)


@needs_triton
def test_float32_in_place_is_exact_and_parities_alternate():
    ranks = simulated_ranks(2)
    layout = ranks[0].layout
    # [parity, slot, elems]
    received = ranks[0].buffer[layout.flag_bytes:layout.channel_bytes].view(torch.float32).view(2, 2, -1)
    for call in range(4):
        xs = [torch.randn(5, 1000) for _ in range(2)]  # 5000 elements: the last program is partial
        partial1, want = xs[1].flatten().clone(), xs[0] + xs[1]
        all_reduce(ranks, xs)  # in place, as the model calls it
        assert torch.equal(xs[0], want) and torch.equal(xs[1], want)
        # call c runs epoch c + 1: rank 1's partial landed in rank 0's buffer, slot 1 of parity (c + 1) % 2
        assert torch.equal(received[(call + 1) % 2, 1, :5000], partial1)


@needs_triton
def test_a_missing_peer_sets_the_error_flag_instead_of_hanging():
    ranks = simulated_ranks(2)
    x = torch.ones(2560, dtype=torch.bfloat16)
    ranks[0].launch(x, x.clone(), push=False, reduce=True, max_spin=3)  # rank 1 never pushed
    assert ranks[0].failed()


def test_message_limits():
    ranks = simulated_ranks(2)
    r = ranks[0]
    assert r.layout.max_bytes >= 16 * 2560 * 2
    assert not r.fits(torch.zeros(16, 2560, dtype=torch.bfloat16))  # a CPU tensor never takes the peer path
    assert r.layout.flag_bytes % 256 == 0 and r.layout.flag_bytes >= r.layout.max_programs * 2 * 8


def test_peers_must_be_aligned_and_complete():
    layout = pa._Layout(2, 1024)
    a, b = aligned_zeros(layout.total), aligned_zeros(layout.total + 512)
    with pytest.raises(ValueError, match="aligned"):
        pa.PeerAllReduce(0, 2, a, [a.data_ptr(), b.data_ptr() + 8], 1024)
    with pytest.raises(ValueError, match="every rank"):
        pa.PeerAllReduce(1, 2, a, [a.data_ptr(), b.data_ptr()], 1024)  # rank 1's own buffer is not at its rank
    pa.PeerAllReduce(0, 2, a, [a, b], 1024)  # tensors stand for their addresses


def test_dlpack_view_is_the_memory_itself():
    """The view create() puts over its cudaMalloc'd buffer, here over CPU memory: same address, no copy."""
    owner = torch.arange(4096, dtype=torch.int32)
    view = pa._device_view(owner.data_ptr() + 512, 1024, torch.device("cpu"))
    assert view.dtype == torch.uint8 and view.numel() == 1024 and view.data_ptr() == owner.data_ptr() + 512
    assert torch.equal(view.view(torch.int32), owner[128:384])
    view.view(torch.int32)[0] = -7  # writes land in the owner's memory
    assert int(owner[128]) == -7


def test_ipc_handle_struct_is_64_bytes_by_value():
    assert pa.ctypes.sizeof(pa._IpcMemHandle) == 64
    raw = bytes(range(64))
    h = pa._IpcMemHandle.from_buffer_copy(raw)
    assert pa.ctypes.string_at(pa.ctypes.addressof(h), 64) == raw  # NUL bytes survive, unlike .reserved


def test_create_without_cuda_runtime_says_why():
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch loads libcudart")
    with pytest.raises(RuntimeError):
        pa._cudart()  # no libcudart in a CPU-only process: create() reports it and every rank falls back


# ---- the fallback over gloo: two CPU processes -------------------------------------------------------------
def _gloo_rank(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        from lingls.serve.tensor_parallel import make_parallel

        par = make_parallel(rank, world)
        peer = pa.PeerAllReduce.create()  # no CUDA here: every rank must answer None, and none may hang
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(t, 2560, generator=g).bfloat16() for t in (1, 9, 16) for _ in range(world)]
        sums = []
        for i in range(0, len(xs), world):
            mine = xs[i + rank].clone()
            sums.append(torch.equal(par.all_reduce(mine), sum(x.float() for x in xs[i:i + world]).bfloat16()))
        results.put((rank, peer is None, sums))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((rank, repr(e), []))


def test_gloo_fallback_sums_on_two_cpu_processes():
    ctx = multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, 2, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    assert got == [(0, True, [True] * 3), (1, True, [True] * 3)]


def test_kernels_compile_for_h200():
    """Both kernels (the fused one with PDL, the norm's row code inlined) through the GPU compiler and ptxas for
    sm_90 at decode shapes (no GPU needed): what the interpreter cannot check (types, inline code, PDL)."""
    from tests.kernels.test_kda import compile_for_sm90

    lines = compile_for_sm90("""
        from lingls.kernels import peer_allreduce as pa
        tables = dict(data_ptr="*bf16", flag_ptr="*i64", delta_ptr="*i64", epochs_ptr="*i64", error_ptr="*i32")
        build(pa._one_shot_kernel, dict(tables, x_ptr="*bf16", out_ptr="*bf16"),
              dict(RANK=0, WORLD=2, BLOCK=pa.BLOCK, PUSH=True, REDUCE=True, MAX_SPIN=pa.MAX_SPIN), 4)
        build(pa._one_shot_add_norm_kernel, dict(tables, x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16",
              out_ptr="*bf16", eps="fp32"), dict(RANK=1, WORLD=4, BLOCK=4096, PUSH=True, REDUCE=True,
              MAX_SPIN=pa.MAX_SPIN, USE_PDL=True), pa.NORM_WARPS, True)
    """)
    assert len(lines) == 2, lines
