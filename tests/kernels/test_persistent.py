"""The persistent one-layer kernel (lingls.kernels.persistent): its schedule proven from the task tables, and
the kernel (under TRITON_INTERPRET=1 on CPU, one or a few programs) against the plain-torch layer."""

import dataclasses
import os

import pytest
import torch

from lingls.kernels import persistent as pk
from tests.kernels.conftest import rel

TINY = pk.LayerShape(hidden=64, heads=2, head_dim=16, experts=16, inter=8, shared_inter=8, top_k=4, n_group=4,
                     topk_group=2, proj_rows=8, oproj_rows=16, router_rows=8, gu_rows=4, down_rows=16, block_k=32,
                     kda_bv=8)


@pytest.mark.parametrize("shape,programs,norm_tasks", [(pk.LayerShape(), 132, True)] + [
    (TINY, p, n) for p in (1, 3, 40) for n in (True, False)])
def test_schedule_is_correct_under_any_interleaving(shape, programs, norm_tasks):
    schedule = pk.build_schedule(shape, programs, norm_tasks=norm_tasks)
    pk.check_schedule(schedule, interleavings=2 if shape.hidden > 1000 else 30, seed=programs)
    kinds = {t.kind for t in schedule.tasks}
    assert kinds == set(range(1, 10 if norm_tasks else 9))


def test_check_schedule_refuses_a_missing_dependency():
    schedule = pk.build_schedule(TINY, 3)
    table = schedule.table.clone()
    # the routing task waits for nothing: the experts' activations would read routing nobody wrote yet
    for p in range(schedule.programs):
        for i in range(schedule.max_tasks):
            if table[p, i, 0] == pk.ROUTE:
                table[p, i, 2:4] = torch.tensor([-1, 0])
    broken = dataclasses.replace(schedule, table=table)
    with pytest.raises(AssertionError):
        pk.check_schedule(broken, interleavings=5)
    # a wait for fewer tiles than signal the counter
    table = schedule.table.clone()
    kda = ((table[..., 0] == pk.KDA) & (table[..., 2] >= 0)).nonzero()[0]
    table[kda[0], kda[1], 3] -= 1
    with pytest.raises(AssertionError, match="waits for"):
        pk.check_schedule(dataclasses.replace(schedule, table=table), interleavings=0)


def _inputs(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = pk.random_layer(shape, generator=g)
    h = torch.randn(1, shape.hidden, generator=g).to(torch.bfloat16)
    state = torch.randn(shape.heads, shape.head_dim, shape.head_dim, generator=g) * 0.1
    conv = torch.randn(3, shape.channels, 3, generator=g).to(torch.bfloat16)
    return w, h, state, conv


def test_reference_matches_fused_step_reference_ops():
    """The layer reference composes the same definitions as fused_step's reference ops (gemv, kda, norm, moe)."""
    pytest.importorskip("triton")
    from lingls.kernels import gemv, kda, moe, norm

    s = TINY
    w, h, state, conv = _inputs(s, 1)
    ref_state, ref_conv = state.clone(), conv.clone()
    out = pk.layer_reference(h, w, ref_state, ref_conv, s)
    c = s.channels
    x, residual = norm.add_rms_norm_reference(h, None, w.in_norm, s.eps)
    p = gemv.gemv_reference(x, w.proj)
    q, k, v, f, g, b = p.split([c, c, c, c, c, s.heads], dim=1)
    st, cv = state.clone(), conv.clone()
    o = kda.kda_step_reference(q, k, v, f, b, g, cv, w.conv, w.a_log, w.dt_bias, w.o_norm, st,
                               lower_bound=s.lower_bound, eps=s.eps)
    a = gemv.gemv_reference(o, w.o_proj)
    x2, residual = norm.add_rms_norm_reference(a, residual.clone(), w.post_norm, s.eps)
    m = moe.fused_moe_reference(x2, w.router, w.expert_bias, w.gate_up, w.down, w.shared_gate_up, w.shared_down,
                                top_k=s.top_k, n_group=s.n_group, topk_group=s.topk_group, normalize=True,
                                scale=s.scale)
    expect = (residual.float() + m.float()).to(torch.bfloat16)
    assert rel(out, expect) < 1e-2  # the reference keeps the experts' activations in bf16, as the kernels do
    assert rel(ref_state, st) < 1e-6 and torch.equal(ref_conv, cv)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("norm_tasks", [True, False])
@pytest.mark.parametrize("programs", [1, 3, 40])
def test_kernel_matches_reference(programs, norm_tasks):
    """One program runs every task in the global order; several (GPU only: the interpreter runs programs one
    after another, so a program polling a counter another one bumps would spin forever) run concurrently."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    if dev == "cpu" and programs > 1:
        pytest.skip("the interpreter runs programs sequentially")
    # Triton 3.6's interpreter rounds fp32 -> bf16 differently from torch (up to 1.5 bf16 ulps seen), and the
    # layer rounds to bf16 at every op's output as the chain does: a wider tolerance there than on a GPU
    tol = 3e-2 if dev == "cpu" else 1e-2
    s = TINY
    schedule = pk.build_schedule(s, programs, norm_tasks=norm_tasks)
    ws = pk.workspace(schedule, dev)
    seeds = (programs, programs + 10) if norm_tasks else (programs,)  # two launches: the second waits on the
    for seed in seeds:  # next generation (once: the interpreter is slow)
        w, h, state, conv = _inputs(s, seed)
        w = pk.LayerWeights(*(t.to(dev) for t in w))
        ref_state, ref_conv = state.clone(), conv.clone()
        expect = pk.layer_reference(h, pk.LayerWeights(*(t.cpu() for t in w)), ref_state, ref_conv, s)
        st, cv = state.to(dev), conv.to(dev)
        out = torch.full_like(h, float("nan")).to(dev)
        pk.persistent_layer(h.to(dev), out, w, st, cv, schedule, ws)
        assert rel(out.cpu(), expect) < tol
        assert rel(st.cpu(), ref_state) < tol
        assert rel(cv.cpu(), ref_conv) < tol
    assert ws.counters[schedule.epoch].item() == len(seeds)


# ---------------------------------------------------------------------------------------------------------
# The CUDA C++ runner (lingls.kernels.persistent_cuda) on the local_route tables: the norms recomputed by their
# consumers, the routing by every program that hosts routed tasks

LOCAL = dict(norm_tasks=False, local_route=True)


@pytest.mark.parametrize("shape,programs", [(pk.LayerShape(), 132)] + [(TINY, p) for p in (1, 3, 40)])
def test_cuda_runner_tables_are_proven(shape, programs):
    """The tables the CUDA runner executes: `check_schedule` (the consumers' waits, every read after its
    write under any interleaving, the routed tasks reading the logits), `check_loader` (the loader waits only
    for its own CTA's routing and KDA tasks, which cannot deadlock), and the runner's own limits, with a ring
    of at least two stages that fits a Hopper block's shared memory."""
    from lingls.kernels import persistent_cuda as pc

    schedule = pk.build_schedule(shape, programs, **LOCAL)
    pk.check_schedule(schedule, interleavings=2 if shape.hidden > 1000 else 30, seed=programs)
    assert {t.kind for t in schedule.tasks} == set(range(1, 9)) - {pk.ROUTE}  # no ROUTE, no NORM task
    pc.check_supported(schedule)
    plan = pc.smem_plan(schedule)
    assert 2 <= plan.stages <= pc.MAX_STAGES and plan.smem_bytes <= pc.SMEM_LIMIT
    assert plan.stage_bytes >= max(pc.stage_bytes_by_kind(shape).values())


def test_local_route_needs_recomputed_norms():
    with pytest.raises(ValueError, match="norm_tasks=False"):
        pk.build_schedule(TINY, 3, norm_tasks=True, local_route=True)


def test_check_loader_refuses_routing_before_the_router():
    from lingls.kernels import persistent_cuda as pc

    schedule = pk.build_schedule(TINY, 3, **LOCAL)
    router = pk._counters(TINY)["router"]
    table = schedule.table.clone()
    for p in range(schedule.programs):  # every program's first wait for the router's tiles dropped
        hits = ((table[p, :, 2] == router) | (table[p, :, 4] == router)).nonzero()
        if len(hits):
            i = hits[0, 0]
            slot = 2 if table[p, i, 2] == router else 4
            table[p, i, slot:slot + 2] = torch.tensor([-1, 0])
    with pytest.raises(AssertionError, match="would route before"):
        pk.check_loader(dataclasses.replace(schedule, table=table))
    # a router tile after the routed task that waits for it: the consumers would wait for themselves
    one = pk.build_schedule(TINY, 1, **LOCAL)
    table = one.table.clone()
    kinds = table[0, :, 0].tolist()
    r, g = kinds.index(pk.ROUTER), kinds.index(pk.EXPERT_GU)
    table[0, [r, g]] = table[0, [g, r]]
    with pytest.raises(AssertionError):
        pk.check_loader(dataclasses.replace(one, table=table))
    with pytest.raises(ValueError, match="local_route"):
        pc.check_supported(pk.build_schedule(TINY, 3))
    with pytest.raises(ValueError, match="local_route"):  # the Triton kernel runs the ROUTE task
        pk.launch(None, None, None, None, None, schedule, None)


def _nvcc():
    import shutil

    return shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


@pytest.mark.skipif(not torch.cuda.is_available() or not _nvcc(), reason="needs CUDA and nvcc")
@pytest.mark.parametrize("programs,pdl,policy", [(p, pdl, {}) for p in (1, 3, 40) for pdl in (True, False)]
                         + [(3, True, dict(inflight=2)), (40, True, dict(inflight=8)),
                            (40, True, dict(free_kinds=(pk.PROJ, pk.EXPERT_GU, pk.DOWN))),
                            (3, True, dict(kda_quiet=False))])
def test_cuda_runner_matches_reference(programs, pdl, policy):
    """Two launches (the second on the next generation of the counters) against the plain-torch layer; the
    routing every program computed for itself is the reference's."""
    from lingls.kernels import persistent_cuda as pc

    s = TINY
    schedule = pk.build_schedule(s, programs, **LOCAL)
    ws = pk.workspace(schedule, "cuda")
    for seed in (programs, programs + 10):
        w, h, state, conv = _inputs(s, seed)
        ref_state, ref_conv = state.clone(), conv.clone()
        expect = pk.layer_reference(h, w, ref_state, ref_conv, s)
        wd = pk.LayerWeights(*(t.cuda() for t in w))
        st, cv = state.cuda(), conv.cuda()
        out = torch.full_like(h, float("nan")).cuda()
        torch.cuda.synchronize()
        pc.launch(h.cuda(), out, wd, st, cv, schedule, ws, pdl=pdl, **policy)
        assert rel(out.cpu(), expect) < 1e-2
        assert rel(st.cpu(), ref_state) < 1e-2
        assert rel(cv.cpu(), ref_conv) < 1e-2
    assert ws.counters[schedule.epoch].item() == 2
