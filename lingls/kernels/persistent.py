"""One KDA + MoE decoder layer at T=1 as one persistent kernel (issue 35's first step).

The chain of launches (`lingls.runtime.fused_step`) runs a KDA layer with its MoE as nine dependent kernels
(input norm, the q/k/v/f/g/b GEMV, the KDA step, the output GEMV, the post-attention norm, router, routing,
experts' gate-up, down). Here the same layer is one launch: `programs` resident programs each walk their own
list of tasks, built on the host once per shape by `build_schedule`:

  PROJ       rows of the fused [q; k; v; f; g; b] projection, the input RMSNorm recomputed by every task
  KDA        one head's conv + SiLU, q/k L2 norm, gate, delta rule, gated output norm (state in registers)
  OPROJ      rows of the output projection
  ROUTER     rows of the router (the residual add + post-attention RMSNorm recomputed by every task)
  SHARED_GU  rows of the shared expert's gate and up, SwiGLU
  ROUTE      sigmoid, expert bias, grouped top-k, renormalised, scaled (`moe.route_token`)
  EXPERT_GU  rows of one routed expert's gate and up, SwiGLU
  DOWN       rows of the hidden state: shared and routed experts' down rows, the weighted sum, both residual adds

Dependencies are counters in global memory, one per group of producing tiles (a head's projection rows, the
heads, the output projection, the router, the routing, the experts' activations): a producer bumps its counter
with a release after its stores, a consumer polls with an acquire until the counter reaches its expected
count. Counters are never reset: launch g (1, 2, ...) waits for need * g, where g is read at the start from an
epoch cell that the last program to finish the launch advances, so a replayed CUDA graph needs no memset.
No grid-wide barrier: a task waits only for the tiles it reads.

Every task requests the weights it can before it waits: a GEMV task its rows (all of K, in registers), the KDA
task its recurrent and conv state and constants, the DOWN task its shared-expert rows before the routing and
its routed rows between the routing and the activations. Only the routed experts' gate-up rows wait for the
routing. `build_schedule` orders the tasks topologically and deals them to programs by a list schedule that
models each program's streaming time, so a single program running every task in order is correct (the CPU
interpreter test), and `check_schedule` proves from the tables alone that every read follows its writes under
any interleaving the counters allow.

Weights use `fused_step`'s layouts: the fused projection rows [q; k; v; f; g; b] (`fuse_rows`), the conv taps
stacked [3, C, 4], the MoE as `moe.MoEWeights` (routed gate_up [E, 2I, H], down [E, H, I], the shared expert's
[gate; up] [2I_s, H] and down [H, I_s]).
"""

from __future__ import annotations

import dataclasses
import random
from typing import NamedTuple

import torch

from lingls.kernels import reference as ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves
    triton = tl = None

_jit = triton.jit if triton is not None else (lambda fn: fn)

# task kinds (0: an empty slot of a program's list)
NONE, PROJ, KDA, OPROJ, ROUTER, SHARED_GU, ROUTE, EXPERT_GU, DOWN, NORM = range(10)
KIND_NAMES = ["none", "proj", "kda", "oproj", "router", "shared_gu", "route", "expert_gu", "down", "norm"]
# a task row: kind, tile, (counter, need) twice, the counter it signals (-1: none), its index in the global order
FIELDS = 8
STAMPS = 4  # per task in the timeline: start, weights requested, inputs ready, end (globaltimer, ns)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One rank's KDA + MoE layer (defaults: Ling-3.0-flash at TP=4) and the kernel's tile sizes."""
    hidden: int = 2560
    heads: int = 8
    head_dim: int = 128
    experts: int = 512
    inter: int = 192
    shared_inter: int = 192
    top_k: int = 8
    n_group: int = 8
    topk_group: int = 4
    scale: float = 2.5
    eps: float = 1e-6
    lower_bound: float = -5.0
    limit: float = 0.0
    shared_limit: float = 0.0
    proj_rows: int = 8
    oproj_rows: int = 16
    router_rows: int = 8
    gu_rows: int = 4
    down_rows: int = 8
    block_k: int = 512
    kda_bv: int = 32

    @property
    def channels(self) -> int:
        return self.heads * self.head_dim

    @property
    def proj_n(self) -> int:
        return 5 * self.channels + self.heads

    def __post_init__(self):
        if (self.head_dim % self.proj_rows or self.head_dim % self.kda_bv or self.hidden % self.block_k
                or self.channels % self.block_k):
            raise ValueError("proj_rows and kda_bv must divide head_dim, block_k must divide hidden and "
                             "heads * head_dim")
        for name in ("hidden", "head_dim", "inter", "shared_inter"):
            if getattr(self, name) % getattr(self, "gu_rows" if "inter" in name else "proj_rows"):
                raise ValueError(f"{name} must be a multiple of its tile rows")
        if self.experts % self.n_group:
            raise ValueError("experts must split into n_group groups")


class LayerWeights(NamedTuple):
    """One layer's tensors in fused_step's layouts (see the module docstring)."""
    in_norm: torch.Tensor  # [H]
    proj: torch.Tensor  # [5C + NH, H]: q, k, v, f, g rows, then b
    conv: torch.Tensor  # [3, C, 4]
    a_log: torch.Tensor  # [NH] fp32
    dt_bias: torch.Tensor  # [C] fp32
    o_norm: torch.Tensor  # [D]
    o_proj: torch.Tensor  # [H, C]
    post_norm: torch.Tensor  # [H]
    router: torch.Tensor  # [E, H]
    expert_bias: torch.Tensor  # [E] fp32
    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    shared_gate_up: torch.Tensor  # [2I_s, H]
    shared_down: torch.Tensor  # [H, I_s]


def random_layer(shape: LayerShape, device="cpu", dtype=torch.bfloat16, generator=None) -> LayerWeights:
    """Random weights at scales that keep a layer's activations O(1) (for tests and benchmarks)."""
    s, h, c = shape, shape.hidden, shape.channels

    def rnd(*size, std=1.0, dt=dtype):
        return (torch.randn(*size, generator=generator, device=device, dtype=torch.float32) * std).to(dt)

    return LayerWeights(
        in_norm=1.0 + rnd(h, std=0.1), proj=rnd(s.proj_n, h, std=h ** -0.5), conv=rnd(3, c, 4, std=0.5),
        a_log=rnd(s.heads, std=0.5, dt=torch.float32), dt_bias=rnd(c, std=0.5, dt=torch.float32),
        o_norm=1.0 + rnd(s.head_dim, std=0.1), o_proj=rnd(h, c, std=c ** -0.5), post_norm=1.0 + rnd(h, std=0.1),
        router=rnd(s.experts, h, std=h ** -0.5), expert_bias=rnd(s.experts, std=0.1, dt=torch.float32),
        gate_up=rnd(s.experts, 2 * s.inter, h, std=h ** -0.5), down=rnd(s.experts, h, s.inter, std=s.inter ** -0.5),
        shared_gate_up=rnd(2 * s.shared_inter, h, std=h ** -0.5),
        shared_down=rnd(h, s.shared_inter, std=s.shared_inter ** -0.5))


def layer_bytes(shape: LayerShape, w: LayerWeights, experts_read: int | None = None) -> int:
    """Bytes one T=1 step of the layer must read (and the KDA state it writes): every always-read weight, the
    chosen experts' gate-up and down rows, the recurrent state read and written, the conv state."""
    k = shape.top_k if experts_read is None else experts_read
    always = [w.in_norm, w.proj, w.conv, w.a_log, w.dt_bias, w.o_norm, w.o_proj, w.post_norm, w.router,
              w.expert_bias, w.shared_gate_up, w.shared_down]
    n = sum(t.numel() * t.element_size() for t in always)
    n += k * (w.gate_up[0].numel() * w.gate_up.element_size() + w.down[0].numel() * w.down.element_size())
    n += 2 * shape.heads * shape.head_dim ** 2 * 4 + 2 * 3 * shape.channels * 3 * w.proj.element_size()
    return n


# ---------------------------------------------------------------------------------------------------------
# The reference: the same layer through the plain-torch definitions, in the chain's order and roundings


def layer_reference(h: torch.Tensor, w: LayerWeights, state: torch.Tensor, conv_state: torch.Tensor,
                    shape: LayerShape) -> torch.Tensor:
    """The layer as fused_step runs it with its reference ops: h [1, H] (the residual stream) -> the next
    residual stream [1, H]; `state` [NH, D, D] fp32 and `conv_state` [3, C, 3] updated in place.
    Each op's output is rounded to h's dtype where the chain's kernels write it."""
    s, c, dt = shape, shape.channels, h.dtype
    x = ref.rms_norm(h, w.in_norm, s.eps).to(dt)
    p = (x.float() @ w.proj.float().t()).to(dt)
    q, k, v, f, g, b = p.split([c, c, c, c, c, s.heads], dim=1)
    ys = []
    for i, xi in enumerate((q, k, v)):
        y, window = ref.causal_conv_silu(xi[None], w.conv[i], conv_state[i][None])
        ys.append(y[0].view(1, s.heads, s.head_dim))
        conv_state[i].copy_(window[0])
    qn = ref.l2_normalize(ys[0].float()) * s.head_dim ** -0.5
    kn = ref.l2_normalize(ys[1].float())
    gate = ref.kda_gate(f.view(1, s.heads, s.head_dim), w.a_log, w.dt_bias, s.lower_bound)
    beta = torch.sigmoid(b.float())
    o, new = ref.kda_recurrent(qn[None], kn[None], ys[2][None], gate[None], beta[None], state.float()[None])
    state.copy_(new[0])
    o = ref.gated_rms_norm(o[0], w.o_norm, g.view(1, s.heads, s.head_dim), s.eps).to(dt).reshape(1, c)
    a = (o.float() @ w.o_proj.float().t()).to(dt)
    h1 = (h.float() + a.float()).to(dt)
    x2 = ref.rms_norm(h1, w.post_norm, s.eps).to(dt)
    logits = x2.float() @ w.router.float().t()
    wts, idx = ref.route_grouped_topk(logits, w.expert_bias, s.top_k, s.n_group, s.topk_group, True, s.scale)
    gu = torch.einsum("h,koh->ko", x2[0].float(), w.gate_up[idx[0]].float())
    act = ref.swiglu(gu[:, :s.inter], gu[:, s.inter:], s.limit).to(dt).float()  # the kernels keep act in bf16
    y = torch.einsum("ki,khi->kh", act, w.down[idx[0]].float())
    m = (y * wts[0, :, None]).sum(0)
    sgu = x2.float() @ w.shared_gate_up.float().t()
    sact = ref.swiglu(sgu[:, :s.shared_inter], sgu[:, s.shared_inter:], s.shared_limit).to(dt).float()
    m = (m + (sact @ w.shared_down.float().t())[0]).to(dt)
    return (h1.float() + m.float()).to(dt)


# ---------------------------------------------------------------------------------------------------------
# The schedule


@dataclasses.dataclass
class Task:
    kind: int
    tile: int
    waits: list  # [(counter, need)], at most 2
    signal: int  # counter, or -1
    reads: set
    writes: set
    weight_bytes: int = 0  # streamed before the wait (modelled)
    late_bytes: int = 0  # streamed after a wait (routed experts)
    latency_us: float = 0.0  # dependent arithmetic after the inputs (modelled)
    index: int = -1
    program: int = -1


@dataclasses.dataclass
class Schedule:
    shape: LayerShape
    programs: int
    tasks: list  # global topological order
    table: torch.Tensor  # int32 [programs, max_tasks, FIELDS]
    n_counters: int
    epoch: int  # the epoch cell's index in the counters
    done: int  # the arrivals counter's index
    norm_tasks: bool  # see `layer_tasks`
    local_route: bool = False  # see `layer_tasks`

    @property
    def max_tasks(self) -> int:
        return self.table.shape[1]


def _counters(shape: LayerShape) -> dict:
    nh = shape.heads
    names = [f"head{h}" for h in range(nh)] + ["beta", "kda", "attn", "router", "route", "act", "out", "x", "x2",
                                               "done", "epoch"]
    return {n: i for i, n in enumerate(names)}


def layer_tasks(shape: LayerShape, norm_tasks: bool = True, local_route: bool = False) -> tuple[list[Task], dict]:
    """The layer's tasks in a topological order, with what each reads and writes (for `check_schedule`).
    norm_tasks: the two RMSNorms are tasks of their own (NORM tile 0: the input norm; tile 1: the residual add
    and the post-attention norm) whose outputs the GEMV tasks read; otherwise every consumer task recomputes
    the norm it needs from the residual stream (no dependent hop, but a reduction over H per task).
    local_route (without norm_tasks): no ROUTE task; every program that hosts routed tasks (EXPERT_GU, DOWN)
    routes for itself from the router's logits at its first routed task, so each routed task waits for the
    router's tiles and reads their logits (the CUDA runner; one hop fewer, the routing on every such SM)."""
    if local_route and norm_tasks:
        raise ValueError("local_route recomputes the norms in their consumers: use it with norm_tasks=False")
    s, c, H, bf = shape, shape.channels, shape.hidden, 2
    cnt = _counters(shape)
    tasks: list[Task] = []
    n_proj = -(-s.proj_n // s.proj_rows)
    n_oproj = -(-H // s.oproj_rows)
    n_router = -(-s.experts // s.router_rows)
    n_sgu = s.shared_inter // s.gu_rows
    n_egu = s.inter // s.gu_rows
    n_down = -(-H // s.down_rows)
    head_tiles = {h: [] for h in range(s.heads)}
    beta_tiles = []
    x_in, x_wait = ({"h_in"}, [])
    if norm_tasks:
        tasks.append(Task(NORM, 0, [], cnt["x"], {"h_in"}, {"x"}, latency_us=1.5))
        x_in, x_wait = ({"x"}, [(cnt["x"], 1)])
    for t in range(n_proj):
        row = t * s.proj_rows
        if row < 5 * c:
            head = (row % c) // s.head_dim
            head_tiles[head].append(t)
            signal = cnt[f"head{head}"]
        else:
            beta_tiles.append(t)
            signal = cnt["beta"]
        tasks.append(Task(PROJ, t, list(x_wait), signal, x_in, {("p", t)}, weight_bytes=s.proj_rows * H * bf,
                          latency_us=0.5))
    for head in range(s.heads):
        tasks.append(Task(KDA, head, [(cnt[f"head{head}"], len(head_tiles[head])), (cnt["beta"], len(beta_tiles))],
                          cnt["kda"], {("p", t) for t in head_tiles[head] + beta_tiles}, {("o", head), ("state", head)},
                          weight_bytes=s.head_dim ** 2 * 4, latency_us=4.0))
    for t in range(n_oproj):
        tasks.append(Task(OPROJ, t, [(cnt["kda"], s.heads)], cnt["attn"], {("o", hh) for hh in range(s.heads)},
                          {("a", t)}, weight_bytes=s.oproj_rows * c * bf, latency_us=0.5))
    attn_reads = {"h_in"} | {("a", t) for t in range(n_oproj)}
    x2_in, x2_wait, h1_in = attn_reads, (cnt["attn"], n_oproj), attn_reads
    if norm_tasks:
        tasks.append(Task(NORM, 1, [(cnt["attn"], n_oproj)], cnt["x2"], attn_reads, {"h1", "x2"}, latency_us=1.5))
        x2_in, x2_wait, h1_in = {"x2"}, (cnt["x2"], 1), {"h1"}
    for t in range(n_router):
        tasks.append(Task(ROUTER, t, [x2_wait], cnt["router"], x2_in, {("logit", t)},
                          weight_bytes=s.router_rows * H * bf, latency_us=1.0))
    for t in range(n_sgu):
        tasks.append(Task(SHARED_GU, t, [x2_wait], cnt["act"], x2_in, {("act", 0, t)},
                          weight_bytes=2 * s.gu_rows * H * bf, latency_us=1.0))
    logits = {("logit", t) for t in range(n_router)}
    if local_route:  # the routing is each routed task's own first step (once per program): it waits for the logits
        route_wait, route_reads = (cnt["router"], n_router), logits
    else:
        tasks.append(Task(ROUTE, 0, [(cnt["router"], n_router)], cnt["route"], logits, {"route"}, latency_us=4.0))
        route_wait, route_reads = (cnt["route"], 1), {"route"}
    for j in range(s.top_k):
        for t in range(n_egu):
            # local_route: the router's tiles each waited for the output projection, so the wait for the router
            # covers the post-attention norm's inputs too
            tasks.append(Task(EXPERT_GU, j * n_egu + t, [route_wait] if local_route else [x2_wait, route_wait],
                              cnt["act"], x2_in | route_reads, {("act", 1 + j, t)},
                              late_bytes=2 * s.gu_rows * H * bf, latency_us=1.0))
    acts = {("act", 0, t) for t in range(n_sgu)} | {("act", 1 + j, t) for j in range(s.top_k) for t in range(n_egu)}
    for t in range(n_down):
        tasks.append(Task(DOWN, t, [route_wait, (cnt["act"], n_sgu + s.top_k * n_egu)], cnt["out"],
                          h1_in | route_reads | acts, {("out", t)}, weight_bytes=s.down_rows * s.shared_inter * bf,
                          late_bytes=s.top_k * s.down_rows * s.inter * bf, latency_us=1.0))
    for i, t in enumerate(tasks):
        t.index = i
    return tasks, cnt


def build_schedule(shape: LayerShape, programs: int, bandwidth: float = 4.0e12, hop_us: float = 1.0,
                   norm_tasks: bool = True, local_route: bool = False) -> Schedule:
    """Deal the layer's tasks to `programs` programs by a list schedule over a simple model (each program
    streams at bandwidth / programs; a task's inputs are ready `hop_us` after its last producer ends; weights
    requested before the wait stream during it). Tasks are taken in the topological order and each goes to the
    program where it would end first, appended to its list, so every list is in topological order. A wait on a
    counter an earlier task of the same program already waited for is left out of the table (its slot -1): the
    count has been reached, and a poll costs a round trip to L2."""
    tasks, cnt = layer_tasks(shape, norm_tasks, local_route)
    per_us = bandwidth / programs / 1e6  # bytes per us per program
    free = [0.0] * programs
    ends_by_counter: dict[int, float] = {}
    for t in tasks:
        ready = max((ends_by_counter.get(c, 0.0) + hop_us for c, _ in t.waits), default=0.0)
        best, best_end = 0, None
        for p in range(programs):
            streamed = free[p] + t.weight_bytes / per_us
            end = max(streamed, ready) + t.late_bytes / per_us + t.latency_us
            if best_end is None or end < best_end - 1e-9:
                best, best_end = p, end
        t.program = best
        free[best] = best_end
        if t.signal >= 0:
            ends_by_counter[t.signal] = max(ends_by_counter.get(t.signal, 0.0), best_end)
    lists = [[t for t in tasks if t.program == p] for p in range(programs)]
    max_tasks = max(len(lst) for lst in lists)
    table = torch.zeros(programs, max_tasks, FIELDS, dtype=torch.int32)
    table[:, :, 2:7] = -1
    table[:, :, 3] = table[:, :, 5] = 0
    for p, lst in enumerate(lists):
        reached: set = set()  # counters an earlier task of this program already waited for (counts only grow)
        for i, t in enumerate(lst):
            waits = [(c, n) if c not in reached else (-1, 0) for c, n in t.waits] + [(-1, 0)] * (2 - len(t.waits))
            reached.update(c for c, _ in t.waits)
            table[p, i] = torch.tensor([t.kind, t.tile, waits[0][0], waits[0][1], waits[1][0], waits[1][1], t.signal,
                                        t.index], dtype=torch.int32)
    return Schedule(shape, programs, tasks, table, len(cnt), cnt["epoch"], cnt["done"], norm_tasks, local_route)


def _table_tasks(schedule: Schedule) -> list[list[tuple]]:
    """Each program's tasks as the kernel reads them: (index, (counter, need) waits, signal)."""
    out = []
    for p in range(schedule.programs):
        lst = []
        for row in schedule.table[p].tolist():
            if row[0] == NONE:
                continue
            waits = [(row[2], row[3]), (row[4], row[5])]
            lst.append((row[7], [(c, n) for c, n in waits if c >= 0], row[6]))
        out.append(lst)
    return out


def check_schedule(schedule: Schedule, interleavings: int = 20, seed: int = 0) -> None:
    """Prove from the task tables alone that the schedule is correct; raise AssertionError if not.

    1. Every counter a task waits on reaches exactly the count it waits for: the tasks signalling it number
       `need`, and nobody else signals it.
    2. Happens-before: a task follows the tasks earlier in its own list and, for each wait, every task that
       signals that counter (1. says the wait ends only after all of them). Every resource a task reads is
       written by a task that happens before it, and no two tasks write one resource.
    3. Executions: the single program running every list in order, and `interleavings` random interleavings in
       which any program whose next task's counters are reached may go next, all complete (no deadlock) with
       every read after its write.
    Tasks in the tables must be the schedule's tasks, each exactly once."""
    tasks = schedule.tasks
    lists = _table_tasks(schedule)
    seen = sorted(i for lst in lists for i, _, _ in lst)
    assert seen == list(range(len(tasks))), "every task exactly once in the tables"
    signallers: dict[int, list[int]] = {}
    for lst in lists:
        for i, _, sig in lst:
            if sig >= 0:
                signallers.setdefault(sig, []).append(i)
    waits_of = {i: w for lst in lists for i, w, _ in lst}
    for i, waits in waits_of.items():
        for c, need in waits:
            assert need == len(signallers.get(c, [])), f"task {i} waits for {need} on counter {c}, " \
                f"{len(signallers.get(c, []))} signal it"
    writer: dict = {}
    for t in tasks:
        for r in t.writes:
            assert r not in writer, f"{r} written twice"
            writer[r] = t.index
    # happens-before closure, in the global topological order (a task's predecessors all come earlier)
    before: dict[int, set] = {}
    prev_in_list = {}
    for lst in lists:
        for a, b in zip(lst, lst[1:]):
            prev_in_list[b[0]] = a[0]
    order = sorted(waits_of)
    for i in order:
        preds = set()
        if i in prev_in_list:
            preds.add(prev_in_list[i])
        for c, _ in waits_of[i]:
            preds.update(signallers.get(c, []))
        assert all(p < i for p in preds), f"task {i} depends on a later task: not topologically ordered"
        closure = set(preds)
        for p in preds:
            closure |= before[p]
        before[i] = closure
    for t in tasks:
        for r in t.reads:
            if r in writer:
                assert writer[r] in before[t.index], f"task {t.index} ({KIND_NAMES[t.kind]}) may read {r} " \
                    f"before task {writer[r]} writes it"
    rng = random.Random(seed)
    for run in range(interleavings + 1):  # run 0: one program running the global order
        count: dict[int, int] = {}
        done: set = set()
        cursor = [0] * len(lists)
        single = run == 0
        global_order = sorted(waits_of)
        g = 0
        while len(done) < len(tasks):
            if single:
                i = global_order[g]
                g += 1
                waits, sig = waits_of[i], tasks[i].signal
                assert all(count.get(c, 0) >= n for c, n in waits), f"task {i} would wait forever in one program"
            else:
                ready = [p for p, lst in enumerate(lists) if cursor[p] < len(lst)
                         and all(count.get(c, 0) >= n for c, n in lst[cursor[p]][1])]
                assert ready, f"deadlock with {len(tasks) - len(done)} tasks left"
                p = rng.choice(ready)
                i, waits, sig = lists[p][cursor[p]]
                cursor[p] += 1
            for r in tasks[i].reads:
                assert r not in writer or writer[r] in done, f"task {i} read {r} before it was written"
            done.add(i)
            if sig >= 0:
                count[sig] = count.get(sig, 0) + 1


ROUTED_WEIGHTS = (EXPERT_GU, DOWN)  # tasks whose weights' address depends on the routing


def check_loader(schedule: Schedule) -> None:
    """Prove that the CUDA runner (`persistent_cuda`) cannot deadlock on these tables and copies only the chosen
    experts' rows; raise AssertionError if not.

    The runner routes on every program that hosts routed tasks (a `local_route` schedule): its consumers, on
    reaching the program's first routed task (EXPERT_GU, DOWN) and before anything else of that task, wait for
    the router counter, compute the routing from the logits into shared memory and hand it to the loader.
    The loader walks the list in order, ahead of the consumers, and waits for nothing but free ring stages,
    that routing (before the first routed task's copies) and the end of a KDA task (so no copy queues ahead
    of the recurrence's own loads); the last two are the consumers' own progress at the same task, which
    needs only copies the loader issued before it. So the loader cannot block its consumers if the routing
    can complete: every program's first routed task must carry the wait for the router's tiles in its table
    row (or follow a task of the list that did; counts only grow), and no router tile may come after it in
    the same list (the consumers would wait for their own later task). `check_schedule` covers the rest."""
    assert schedule.local_route and not schedule.norm_tasks, "the CUDA runner runs local_route schedules"
    router = _counters(schedule.shape)["router"]
    for p, lst in enumerate(_table_tasks(schedule)):
        waited, first_routed = False, None
        for i, waits, _ in lst:
            kind = schedule.tasks[i].kind
            waited |= any(c == router for c, _ in waits)
            if kind in ROUTED_WEIGHTS and first_routed is None:
                first_routed = i
                assert waited, f"program {p}: task {i} ({KIND_NAMES[kind]}) would route before the router's " \
                    "tiles are all written"
            assert not (kind == ROUTER and first_routed is not None), \
                f"program {p}: router tile task {i} after the routed task {first_routed} that waits for it"


# ---------------------------------------------------------------------------------------------------------
# The kernel

if triton is not None:
    from lingls.kernels.kda import conv_silu, delta_rule, sigmoid
    from lingls.kernels.moe import load_bias, route_token
    from lingls.kernels.norm import rms_norm_row


@_jit
def _stamp(stamp_ptr, task, k: tl.constexpr, TIMELINE: tl.constexpr):
    if TIMELINE:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [task.to(tl.int64)], dtype=tl.int64,
                                        is_pure=False, pack=1)
        tl.store(stamp_ptr + task * 4 + k, now)


@_jit
def _wait(cnt_ptr, c, need, gen):
    """Poll counter c (one thread's acquire read, broadcast) until it reaches need * gen (c < 0: no wait)."""
    if c >= 0:
        target = need * gen
        seen = tl.atomic_add(cnt_ptr + c, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(cnt_ptr + c, 0, sem="acquire", scope="gpu")


@_jit
def _row_rms(h_ptr, a_ptr, K, eps, HAS_A: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of the row h (with HAS_A: of h + a rounded to h's dtype, the residual add's output)."""
    ss = 0.0
    for c in tl.static_range(K // BLOCK_K):
        kk = c * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(h_ptr + kk)
        if HAS_A:
            x = (x.to(tl.float32) + tl.load(a_ptr + kk).to(tl.float32)).to(h_ptr.dtype.element_ty)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, 0)
    return tl.rsqrt(ss / K + eps)


@_jit
def _x_tile(h_ptr, a_ptr, nw_ptr, kk, rms, NORM: tl.constexpr, HAS_A: tl.constexpr):
    """The GEMV's input at columns kk (any shape): h itself, or its RMSNorm (of h + a with HAS_A) rounded as
    the norm kernel writes it, in fp32."""
    x = tl.load(h_ptr + kk)
    if HAS_A:
        x = (x.to(tl.float32) + tl.load(a_ptr + kk).to(tl.float32)).to(h_ptr.dtype.element_ty)
    if NORM:
        w = tl.load(nw_ptr + kk).to(tl.float32)
        x = (w * (x.to(tl.float32) * rms).to(h_ptr.dtype.element_ty).to(tl.float32)).to(h_ptr.dtype.element_ty)
    return x.to(tl.float32)


@_jit
def _load_rows(w_ptr, rows, n_rows, K, BLOCK_K: tl.constexpr):
    """W's rows (a [R] index vector, masked at n_rows) over all K columns, as K // BLOCK_K tiles, requested at
    once."""
    tiles = ()
    for c in tl.static_range(K // BLOCK_K):
        kk = c * BLOCK_K + tl.arange(0, BLOCK_K)
        tiles = tiles + (tl.load(w_ptr + rows[:, None].to(tl.int64) * K + kk[None, :],
                                 mask=(rows[:, None] < n_rows) & (kk[None, :] < K), other=0.0),)
    return tiles


@_jit
def _dot_rows(tiles, h_ptr, a_ptr, nw_ptr, rows, K, rms, NORM: tl.constexpr, HAS_A: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """sum_k W[rows, k] x[k] in fp32 on the FMA units (x: `_x_tile`, read in the tiles' own layout)."""
    acc = tl.zeros(tiles[0].shape, tl.float32)
    for c in tl.static_range(K // BLOCK_K):
        kk = c * BLOCK_K + tl.arange(0, BLOCK_K)
        x = _x_tile(h_ptr, a_ptr, nw_ptr, kk[None, :] + 0 * rows[:, None], rms, NORM, HAS_A)
        acc += tiles[c].to(tl.float32) * x
    return tl.sum(acc, axis=1)


@_jit
def _gemv_task(w_ptr, out_ptr, h_ptr, a_ptr, nw_ptr, cnt_ptr, stamp_ptr, tile, idx, c0, n0, c1, n1, gen, n_rows, K,
               eps, ROWS: tl.constexpr, NORM: tl.constexpr, HAS_A: tl.constexpr, BLOCK_K: tl.constexpr,
               OUT_F32: tl.constexpr, TIMELINE: tl.constexpr):
    """PROJ, OPROJ, ROUTER: rows tile*ROWS.. of W times x (the input norm, plain o, or the post-attention norm)."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    tiles = _load_rows(w_ptr, rows, n_rows, K, BLOCK_K)
    _stamp(stamp_ptr, idx, 1, TIMELINE)
    _wait(cnt_ptr, c0, n0, gen)
    _wait(cnt_ptr, c1, n1, gen)
    _stamp(stamp_ptr, idx, 2, TIMELINE)
    rms = 1.0
    if NORM:
        rms = _row_rms(h_ptr, a_ptr, K, eps, HAS_A, BLOCK_K)
    y = _dot_rows(tiles, h_ptr, a_ptr, nw_ptr, rows, K, rms, NORM, HAS_A, BLOCK_K)
    if OUT_F32:
        tl.store(out_ptr + rows, y, mask=rows < n_rows)
    else:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < n_rows)


@_jit
def _gate_up_task(gu_ptr, sgu_ptr, topk_i_ptr, act_ptr, h_ptr, a_ptr, nw_ptr, cnt_ptr, stamp_ptr, tile, idx, c0, n0,
                  c1, n1, gen, H, INTER, I_S, eps, limit, shared_limit, SHARED: tl.constexpr, ROWS: tl.constexpr,
                  I_PAD: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, TIMELINE: tl.constexpr):
    """SHARED_GU (rows of the shared expert, requested before the wait) or EXPERT_GU (rows of routed slot j,
    requested once the routing is known): SwiGLU of gate and up rows into the slot's activations (bf16, as the
    chain keeps them). The input: h_ptr itself (the NORM task's x2), or with NORM the post-attention norm of
    h + a recomputed here (for EXPERT_GU while the routing is awaited)."""
    if SHARED:
        slot = 0
        inter = I_S
        lim = shared_limit
        r = tile * ROWS + tl.arange(0, ROWS)
        g_tiles = _load_rows(sgu_ptr, r, inter, H, BLOCK_K)
        u_tiles = _load_rows(sgu_ptr + inter * H, r, inter, H, BLOCK_K)
        _stamp(stamp_ptr, idx, 1, TIMELINE)
        _wait(cnt_ptr, c0, n0, gen)
        _stamp(stamp_ptr, idx, 2, TIMELINE)
        rms = 1.0
        if NORM:
            rms = _row_rms(h_ptr, a_ptr, H, eps, True, BLOCK_K)
    else:
        n_blk = INTER // ROWS
        j = tile // n_blk
        slot = 1 + j
        inter = INTER
        lim = limit
        r = (tile % n_blk) * ROWS + tl.arange(0, ROWS)
        _wait(cnt_ptr, c0, n0, gen)  # the attention output or its norm: a norm goes ahead of the routing
        rms = 1.0
        if NORM:
            rms = _row_rms(h_ptr, a_ptr, H, eps, True, BLOCK_K)
        _wait(cnt_ptr, c1, n1, gen)
        e = tl.load(topk_i_ptr + j, cache_modifier=".cg").to(tl.int64)
        base = gu_ptr + e * (2 * INTER * H)
        g_tiles = _load_rows(base, r, inter, H, BLOCK_K)
        u_tiles = _load_rows(base + inter * H, r, inter, H, BLOCK_K)
        _stamp(stamp_ptr, idx, 1, TIMELINE)
        _stamp(stamp_ptr, idx, 2, TIMELINE)
    gate = _dot_rows(g_tiles, h_ptr, a_ptr, nw_ptr, r, H, rms, NORM, NORM, BLOCK_K)
    up = _dot_rows(u_tiles, h_ptr, a_ptr, nw_ptr, r, H, rms, NORM, NORM, BLOCK_K)
    act = gate * tl.sigmoid(gate)
    if lim > 0:
        act = tl.minimum(act, lim)
        up = tl.minimum(tl.maximum(up, -lim), lim)
    tl.store(act_ptr + slot * I_PAD + r, (act * up).to(act_ptr.dtype.element_ty), mask=r < inter)


@_jit
def _norm_task(h_ptr, a_ptr, w_ptr, h1_ptr, x_ptr, cnt_ptr, stamp_ptr, idx, c0, n0, gen, H, eps,
               HAS_A: tl.constexpr, H_PAD: tl.constexpr, TIMELINE: tl.constexpr):
    """NORM: x = RMSNorm(h) (tile 0), or h1 = h + a and x2 = RMSNorm(h1) (tile 1), in the norm kernel's
    arithmetic (`norm.rms_norm_row`), once for all the GEMV tasks that read them."""
    offs = tl.arange(0, H_PAD)
    m = offs < H
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    _stamp(stamp_ptr, idx, 1, TIMELINE)
    _wait(cnt_ptr, c0, n0, gen)
    _stamp(stamp_ptr, idx, 2, TIMELINE)
    x = tl.load(h_ptr + offs, mask=m, other=0.0)
    if HAS_A:
        a = tl.load(a_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
        x = (x.to(tl.float32) + a.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h1_ptr + offs, x, mask=m)
    tl.store(x_ptr + offs, rms_norm_row(x, w, H, eps).to(x_ptr.dtype.element_ty), mask=m)


@_jit
def _kda_task(p_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, onorm_ptr, state_ptr, conv_ptr, o_ptr, cnt_ptr, stamp_ptr,
              h, idx, c0, n0, c1, n1, gen, q_scale, lower_bound, eps, C: tl.constexpr, D: tl.constexpr,
              BV: tl.constexpr, TIMELINE: tl.constexpr):
    """Head h's step (kda._kda_step_kernel's arithmetic at T=1), all D value columns in one task, BV at a time,
    so the gated output norm and the q/k conv state need no second program. The recurrent state (the bulk of
    the task's bytes) is requested before the wait, as D // BV tiles of [D, BV] (a whole [D, D] fp32 tile and
    its temporaries spilled to local memory at 8 warps)."""
    NV: tl.constexpr = D // BV
    dk = tl.arange(0, D)
    ck = h * D + dk
    dv = tl.arange(0, BV)
    rate = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + ck).to(tl.float32)
    S_tiles = ()
    for j in tl.static_range(NV):
        S_tiles = S_tiles + (tl.load(state_ptr + h * D * D + dk[:, None] * D + j * BV + dv[None, :]),)
    _stamp(stamp_ptr, idx, 1, TIMELINE)
    _wait(cnt_ptr, c0, n0, gen)
    _wait(cnt_ptr, c1, n1, gen)
    _stamp(stamp_ptr, idx, 2, TIMELINE)
    # the q/k taps and windows go out with the inputs (one round trip either way), not before the wait: held
    # across it they pushed the kernel's registers into local memory
    wq0 = tl.load(conv_w_ptr + ck * 4 + 0).to(tl.float32)
    wq1 = tl.load(conv_w_ptr + ck * 4 + 1).to(tl.float32)
    wq2 = tl.load(conv_w_ptr + ck * 4 + 2).to(tl.float32)
    wq3 = tl.load(conv_w_ptr + ck * 4 + 3).to(tl.float32)
    wk0 = tl.load(conv_w_ptr + (C + ck) * 4 + 0).to(tl.float32)
    wk1 = tl.load(conv_w_ptr + (C + ck) * 4 + 1).to(tl.float32)
    wk2 = tl.load(conv_w_ptr + (C + ck) * 4 + 2).to(tl.float32)
    wk3 = tl.load(conv_w_ptr + (C + ck) * 4 + 3).to(tl.float32)
    xq0 = tl.load(conv_ptr + ck * 3 + 0)
    xq1 = tl.load(conv_ptr + ck * 3 + 1)
    xq2 = tl.load(conv_ptr + ck * 3 + 2)
    xk0 = tl.load(conv_ptr + (C + ck) * 3 + 0)
    xk1 = tl.load(conv_ptr + (C + ck) * 3 + 1)
    xk2 = tl.load(conv_ptr + (C + ck) * 3 + 2)
    q_in = tl.load(p_ptr + ck, cache_modifier=".cg")
    k_in = tl.load(p_ptr + C + ck, cache_modifier=".cg")
    f = tl.load(p_ptr + 3 * C + ck, cache_modifier=".cg").to(tl.float32)
    b = tl.load(p_ptr + 5 * C + h, cache_modifier=".cg").to(tl.float32)
    qt = conv_silu(wq0, wq1, wq2, wq3, xq0.to(tl.float32), xq1.to(tl.float32), xq2.to(tl.float32),
                    q_in.to(tl.float32))
    kt = conv_silu(wk0, wk1, wk2, wk3, xk0.to(tl.float32), xk1.to(tl.float32), xk2.to(tl.float32),
                    k_in.to(tl.float32))
    qt = qt * (tl.rsqrt(tl.sum(qt * qt, 0) + 1e-6) * q_scale)
    kt = kt * tl.rsqrt(tl.sum(kt * kt, 0) + 1e-6)
    decay = tl.exp(lower_bound * sigmoid(rate * (f + dt_bias)))
    beta = sigmoid(b)
    qk = tl.sum(qt * kt, 0)
    ety = conv_ptr.dtype.element_ty  # the windows slide by one input (the projected rows, as stored)
    # every chunk's loads go out here, together: inside the chunk loop each chunk's loads had to follow the
    # previous chunk's stores (they may alias), a memory round trip per chunk
    v_ins = ()
    v_win = ()
    v_taps = ()
    zs = ()
    nws = ()
    for j in tl.static_range(NV):
        cv = h * D + j * BV + dv
        v_ins = v_ins + (tl.load(p_ptr + 2 * C + cv, cache_modifier=".cg"),)
        zs = zs + (tl.load(p_ptr + 4 * C + cv, cache_modifier=".cg"),)
        nws = nws + (tl.load(onorm_ptr + j * BV + dv),)
        for i in tl.static_range(3):
            v_win = v_win + (tl.load(conv_ptr + (2 * C + cv) * 3 + i),)
        for i in tl.static_range(4):
            v_taps = v_taps + (tl.load(conv_w_ptr + (2 * C + cv) * 4 + i),)
    outs = ()
    ss = 0.0
    for j in tl.static_range(NV):
        cv = h * D + j * BV + dv
        v_in = v_ins[j]
        xv1 = v_win[3 * j + 1]
        xv2 = v_win[3 * j + 2]
        vt = conv_silu(v_taps[4 * j].to(tl.float32), v_taps[4 * j + 1].to(tl.float32),
                        v_taps[4 * j + 2].to(tl.float32), v_taps[4 * j + 3].to(tl.float32),
                        v_win[3 * j].to(tl.float32), xv1.to(tl.float32), xv2.to(tl.float32), v_in.to(tl.float32))
        P, err, S = delta_rule(S_tiles[j], kt, decay, vt, beta)
        o = tl.sum(P * qt[:, None], 0) + qk * err
        tl.store(state_ptr + h * D * D + dk[:, None] * D + j * BV + dv[None, :], S)
        tl.store(conv_ptr + (2 * C + cv) * 3 + 0, xv1)
        tl.store(conv_ptr + (2 * C + cv) * 3 + 1, xv2)
        tl.store(conv_ptr + (2 * C + cv) * 3 + 2, v_in.to(ety))
        outs = outs + (o,)
        ss += tl.sum(o * o, 0)
    tl.store(conv_ptr + ck * 3 + 0, xq1)
    tl.store(conv_ptr + ck * 3 + 1, xq2)
    tl.store(conv_ptr + ck * 3 + 2, q_in.to(ety))
    tl.store(conv_ptr + (C + ck) * 3 + 0, xk1)
    tl.store(conv_ptr + (C + ck) * 3 + 1, xk2)
    tl.store(conv_ptr + (C + ck) * 3 + 2, k_in.to(ety))
    rms = tl.rsqrt(ss / D + eps)
    for j in tl.static_range(NV):
        cv = h * D + j * BV + dv
        gate = tl.sigmoid(zs[j].to(tl.float32))
        tl.store(o_ptr + cv, (outs[j] * rms * nws[j].to(tl.float32) * gate).to(o_ptr.dtype.element_ty))


@_jit
def _route_task(logit_ptr, bias_ptr, topk_w_ptr, topk_i_ptr, wt_ptr, cnt_ptr, stamp_ptr, idx, c0, n0, gen, E, scale,
                TOP_K: tl.constexpr, K_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                EPG: tl.constexpr, EPG_PAD: tl.constexpr, E_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                TIMELINE: tl.constexpr):
    """The grouped top-k of `moe.route_token` on the router's logits: topk_w / topk_i in selection order."""
    gbias, bias = load_bias(bias_ptr, E, G, G_PAD, EPG, EPG_PAD, E_PAD)
    _stamp(stamp_ptr, idx, 1, TIMELINE)
    _wait(cnt_ptr, c0, n0, gen)
    _stamp(stamp_ptr, idx, 2, TIMELINE)
    route_token(logit_ptr, gbias, bias, topk_w_ptr, topk_i_ptr, wt_ptr, 0, E, scale, 1, TOP_K, K_PAD, G, G_PAD, EPG,
                 EPG_PAD, E_PAD, TOPK_GROUP, True, True)


@_jit
def _down_task(dn_ptr, sdn_ptr, topk_w_ptr, topk_i_ptr, act_ptr, h_ptr, a_ptr, h1_ptr, out_ptr, cnt_ptr, stamp_ptr,
               tile, idx, c0, n0, c1, n1, gen, H, INTER, I_S, ROWS: tl.constexpr, TOP_K: tl.constexpr,
               I_PAD: tl.constexpr, H1_READY: tl.constexpr, TIMELINE: tl.constexpr):
    """Hidden rows tile*ROWS..: the shared expert's down rows (requested first), the routed experts' once the
    routing is known, then the weighted sum over the activations, plus both residual adds (h + a, then + moe)."""
    rh = tile * ROWS + tl.arange(0, ROWS)
    ri = tl.arange(0, I_PAD)
    hm = rh < H
    shared = tl.load(sdn_ptr + rh[:, None] * I_S + ri[None, :], mask=hm[:, None] & (ri[None, :] < I_S), other=0.0)
    _wait(cnt_ptr, c0, n0, gen)
    routed = ()
    for j in tl.static_range(TOP_K):
        e = tl.load(topk_i_ptr + j, cache_modifier=".cg").to(tl.int64)
        routed = routed + (tl.load(dn_ptr + e * H * INTER + rh[:, None] * INTER + ri[None, :],
                                   mask=hm[:, None] & (ri[None, :] < INTER), other=0.0),)
    _stamp(stamp_ptr, idx, 1, TIMELINE)
    _wait(cnt_ptr, c1, n1, gen)
    _stamp(stamp_ptr, idx, 2, TIMELINE)
    acc = shared.to(tl.float32) * tl.load(act_ptr + ri, cache_modifier=".cg").to(tl.float32)[None, :]
    for j in tl.static_range(TOP_K):
        wj = tl.load(topk_w_ptr + j, cache_modifier=".cg")
        aj = tl.load(act_ptr + (1 + j) * I_PAD + ri, cache_modifier=".cg").to(tl.float32)
        acc += routed[j].to(tl.float32) * (aj * wj)[None, :]
    m = tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty)
    if H1_READY:  # the NORM task's h + a
        h1 = tl.load(h1_ptr + rh, mask=hm, other=0.0, cache_modifier=".cg")
    else:
        h1 = (tl.load(h_ptr + rh, mask=hm, other=0.0).to(tl.float32)
              + tl.load(a_ptr + rh, mask=hm, other=0.0, cache_modifier=".cg").to(tl.float32)
              ).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rh, (h1.to(tl.float32) + m.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=hm)


@_jit
def _task_row(row, valid):
    """A task's table row (kind, tile, c0, n0, c1, n1, signal, index); kind 0 where not valid."""
    return (tl.load(row, mask=valid, other=0), tl.load(row + 1, mask=valid, other=0),
            tl.load(row + 2, mask=valid, other=0), tl.load(row + 3, mask=valid, other=0),
            tl.load(row + 4, mask=valid, other=0), tl.load(row + 5, mask=valid, other=0),
            tl.load(row + 6, mask=valid, other=0), tl.load(row + 7, mask=valid, other=0))


@_jit
def _layer_kernel(tasks_ptr, cnt_ptr, stamp_ptr, h_ptr, out_ptr,
                  in_norm_ptr, proj_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, onorm_ptr, oproj_ptr, post_norm_ptr,
                  router_ptr, bias_ptr, gu_ptr, dn_ptr, sgu_ptr, sdn_ptr, state_ptr, conv_ptr,
                  p_ptr, o_ptr, a_ptr, logit_ptr, wt_ptr, topk_w_ptr, topk_i_ptr, act_ptr, x_ptr, h1_ptr, x2_ptr,
                  eps, q_scale, lower_bound, scale, limit, shared_limit,
                  H: tl.constexpr, NH: tl.constexpr, D: tl.constexpr, E: tl.constexpr, INTER: tl.constexpr,
                  I_S: tl.constexpr, I_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  G: tl.constexpr, G_PAD: tl.constexpr, EPG_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, PROJ_ROWS: tl.constexpr, OPROJ_ROWS: tl.constexpr,
                  ROUTER_ROWS: tl.constexpr, GU_ROWS: tl.constexpr, DOWN_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                  KDA_BV: tl.constexpr, MAX_TASKS: tl.constexpr, P: tl.constexpr, EPOCH: tl.constexpr,
                  DONE: tl.constexpr, NORM_TASKS: tl.constexpr, H_PAD: tl.constexpr, TIMELINE: tl.constexpr):
    pid = tl.program_id(0)
    C: tl.constexpr = NH * D
    gen = tl.atomic_add(cnt_ptr + EPOCH, 0, sem="acquire", scope="gpu") + 1  # this launch's generation
    base = tasks_ptr + pid * MAX_TASKS * 8
    kind, tile, c0, n0, c1, n1, sig, idx = _task_row(base, True)
    for i in range(MAX_TASKS):
        # the next task's row goes out before this task runs: read at its start, it cost a round trip per task
        # before the task's weight loads could issue
        n_kind, n_tile, n_c0, n_n0, n_c1, n_n1, n_sig, n_idx = _task_row(base + (i + 1) * 8, i + 1 < MAX_TASKS)
        if kind != 0:
            _stamp(stamp_ptr, idx, 0, TIMELINE)
            if kind == 1:  # PROJ
                if NORM_TASKS:
                    _gemv_task(proj_ptr, p_ptr, x_ptr, x_ptr, in_norm_ptr, cnt_ptr, stamp_ptr, tile, idx, c0, n0, c1,
                               n1, gen, 5 * C + NH, H, eps, PROJ_ROWS, False, False, BLOCK_K, False, TIMELINE)
                else:
                    _gemv_task(proj_ptr, p_ptr, h_ptr, h_ptr, in_norm_ptr, cnt_ptr, stamp_ptr, tile, idx, c0, n0, c1,
                               n1, gen, 5 * C + NH, H, eps, PROJ_ROWS, True, False, BLOCK_K, False, TIMELINE)
            elif kind == 2:  # KDA
                _kda_task(p_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, onorm_ptr, state_ptr, conv_ptr, o_ptr, cnt_ptr,
                          stamp_ptr, tile, idx, c0, n0, c1, n1, gen, q_scale, lower_bound, eps, C, D, KDA_BV,
                          TIMELINE)
            elif kind == 3:  # OPROJ
                _gemv_task(oproj_ptr, a_ptr, o_ptr, o_ptr, in_norm_ptr, cnt_ptr, stamp_ptr, tile, idx, c0, n0, c1,
                           n1, gen, H, C, eps, OPROJ_ROWS, False, False, BLOCK_K, False, TIMELINE)
            elif kind == 4:  # ROUTER
                if NORM_TASKS:
                    _gemv_task(router_ptr, logit_ptr, x2_ptr, x2_ptr, post_norm_ptr, cnt_ptr, stamp_ptr, tile, idx,
                               c0, n0, c1, n1, gen, E, H, eps, ROUTER_ROWS, False, False, BLOCK_K, True, TIMELINE)
                else:
                    _gemv_task(router_ptr, logit_ptr, h_ptr, a_ptr, post_norm_ptr, cnt_ptr, stamp_ptr, tile, idx, c0,
                               n0, c1, n1, gen, E, H, eps, ROUTER_ROWS, True, True, BLOCK_K, True, TIMELINE)
            elif kind == 5:  # SHARED_GU
                if NORM_TASKS:
                    _gate_up_task(gu_ptr, sgu_ptr, topk_i_ptr, act_ptr, x2_ptr, a_ptr, post_norm_ptr, cnt_ptr,
                                  stamp_ptr, tile, idx, c0, n0, c1, n1, gen, H, INTER, I_S, eps, limit, shared_limit,
                                  True, GU_ROWS, I_PAD, BLOCK_K, False, TIMELINE)
                else:
                    _gate_up_task(gu_ptr, sgu_ptr, topk_i_ptr, act_ptr, h_ptr, a_ptr, post_norm_ptr, cnt_ptr,
                                  stamp_ptr, tile, idx, c0, n0, c1, n1, gen, H, INTER, I_S, eps, limit, shared_limit,
                                  True, GU_ROWS, I_PAD, BLOCK_K, True, TIMELINE)
            elif kind == 6:  # ROUTE
                _route_task(logit_ptr, bias_ptr, topk_w_ptr, topk_i_ptr, wt_ptr, cnt_ptr, stamp_ptr, idx, c0, n0, gen,
                            E, scale, TOP_K, K_PAD, G, G_PAD, E // G, EPG_PAD, E_PAD, TOPK_GROUP, TIMELINE)
            elif kind == 7:  # EXPERT_GU
                if NORM_TASKS:
                    _gate_up_task(gu_ptr, sgu_ptr, topk_i_ptr, act_ptr, x2_ptr, a_ptr, post_norm_ptr, cnt_ptr,
                                  stamp_ptr, tile, idx, c0, n0, c1, n1, gen, H, INTER, I_S, eps, limit, shared_limit,
                                  False, GU_ROWS, I_PAD, BLOCK_K, False, TIMELINE)
                else:
                    _gate_up_task(gu_ptr, sgu_ptr, topk_i_ptr, act_ptr, h_ptr, a_ptr, post_norm_ptr, cnt_ptr,
                                  stamp_ptr, tile, idx, c0, n0, c1, n1, gen, H, INTER, I_S, eps, limit, shared_limit,
                                  False, GU_ROWS, I_PAD, BLOCK_K, True, TIMELINE)
            elif kind == 8:  # DOWN
                _down_task(dn_ptr, sdn_ptr, topk_w_ptr, topk_i_ptr, act_ptr, h_ptr, a_ptr, h1_ptr, out_ptr, cnt_ptr,
                           stamp_ptr, tile, idx, c0, n0, c1, n1, gen, H, INTER, I_S, DOWN_ROWS, TOP_K, I_PAD,
                           NORM_TASKS, TIMELINE)
            elif kind == 9:  # NORM
                if tile == 0:
                    _norm_task(h_ptr, h_ptr, in_norm_ptr, h1_ptr, x_ptr, cnt_ptr, stamp_ptr, idx, c0, n0, gen, H, eps,
                               False, H_PAD, TIMELINE)
                else:
                    _norm_task(h_ptr, a_ptr, post_norm_ptr, h1_ptr, x2_ptr, cnt_ptr, stamp_ptr, idx, c0, n0, gen, H,
                               eps, True, H_PAD, TIMELINE)
            tl.debug_barrier()  # every thread's stores before the release
            if sig >= 0:
                tl.atomic_add(cnt_ptr + sig, 1, sem="release", scope="gpu")
            _stamp(stamp_ptr, idx, 3, TIMELINE)
        kind, tile, c0, n0, c1, n1, sig, idx = n_kind, n_tile, n_c0, n_n0, n_c1, n_n1, n_sig, n_idx
    arrived = tl.atomic_add(cnt_ptr + DONE, 1, sem="acq_rel", scope="gpu")
    if arrived == gen * P - 1:  # the last program of this launch: the next launch waits for need * (gen + 1)
        tl.atomic_add(cnt_ptr + EPOCH, 1, sem="release", scope="gpu")


class Workspace(NamedTuple):
    """The kernel's scratch, shared by every layer's launch (they run in stream order) and allocated once, so a
    CUDA graph captured after it keeps valid addresses."""
    counters: torch.Tensor  # int32 [n_counters], never reset
    p: torch.Tensor
    o: torch.Tensor
    a: torch.Tensor
    logits: torch.Tensor
    wt: torch.Tensor
    topk_w: torch.Tensor
    topk_i: torch.Tensor
    act: torch.Tensor
    x: torch.Tensor  # the NORM tasks' outputs: the input norm, h + a, the post-attention norm
    h1: torch.Tensor
    x2: torch.Tensor
    stamps: torch.Tensor  # int64 [tasks, STAMPS] (the timeline; written only with timeline=True)


def workspace(schedule: Schedule, device, dtype=torch.bfloat16) -> Workspace:
    s = schedule.shape
    i_pad = triton.next_power_of_2(max(s.inter, s.shared_inter)) if triton is not None else max(s.inter, s.shared_inter)
    return Workspace(
        counters=torch.zeros(schedule.n_counters, dtype=torch.int32, device=device),
        p=torch.empty(s.proj_n, dtype=dtype, device=device), o=torch.empty(s.channels, dtype=dtype, device=device),
        a=torch.empty(s.hidden, dtype=dtype, device=device),
        logits=torch.empty(s.experts, dtype=torch.float32, device=device),
        wt=torch.empty(s.experts, dtype=torch.float32, device=device),
        topk_w=torch.empty(s.top_k, dtype=torch.float32, device=device),
        topk_i=torch.empty(s.top_k, dtype=torch.int32, device=device),
        act=torch.zeros(1 + s.top_k, i_pad, dtype=dtype, device=device),
        x=torch.empty(s.hidden, dtype=dtype, device=device), h1=torch.empty(s.hidden, dtype=dtype, device=device),
        x2=torch.empty(s.hidden, dtype=dtype, device=device),
        stamps=torch.zeros(len(schedule.tasks), STAMPS, dtype=torch.int64, device=device))


def persistent_layer(h: torch.Tensor, out: torch.Tensor, w: LayerWeights, state: torch.Tensor,
                     conv_state: torch.Tensor, schedule: Schedule, ws: Workspace, table: torch.Tensor | None = None,
                     timeline: bool = False, num_warps: int = 8) -> torch.Tensor:
    """The layer in one launch: h [1, H] (the residual stream) -> out [1, H]; state and conv_state updated in
    place. `table`: the schedule's task table on h's device (copied there once by the caller; default: here).
    timeline: every task writes its globaltimer stamps to ws.stamps (CUDA only)."""
    launch(h, out, w, state, conv_state, schedule, ws, table, timeline, num_warps)
    return out


def launch(h, out, w: LayerWeights, state, conv_state, schedule: Schedule, ws: Workspace, table=None,
           timeline: bool = False, num_warps: int = 8):
    """`persistent_layer`'s launch; returns Triton's compiled kernel (its registers and spills, for benchmarks)."""
    s = schedule.shape
    if schedule.local_route:
        raise ValueError("this kernel runs the ROUTE task; local_route schedules are the CUDA runner's")
    if h.shape != (1, s.hidden) or out.shape != h.shape:
        raise ValueError(f"h and out must be [1, {s.hidden}], got {tuple(h.shape)}, {tuple(out.shape)}")
    if state.shape != (s.heads, s.head_dim, s.head_dim) or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 [{s.heads}, {s.head_dim}, {s.head_dim}]")
    if table is None:
        table = schedule.table.to(h.device)
    i_pad = ws.act.shape[1]
    return _layer_kernel[(schedule.programs,)](
        table, ws.counters, ws.stamps, h, out,
        w.in_norm, w.proj, w.conv, w.a_log, w.dt_bias, w.o_norm, w.o_proj, w.post_norm,
        w.router, w.expert_bias, w.gate_up, w.down, w.shared_gate_up, w.shared_down, state, conv_state,
        ws.p, ws.o, ws.a, ws.logits, ws.wt, ws.topk_w, ws.topk_i, ws.act, ws.x, ws.h1, ws.x2,
        float(s.eps), s.head_dim ** -0.5, float(s.lower_bound), float(s.scale), float(s.limit), float(s.shared_limit),
        H=s.hidden, NH=s.heads, D=s.head_dim, E=s.experts, INTER=s.inter, I_S=s.shared_inter, I_PAD=i_pad,
        TOP_K=s.top_k, K_PAD=triton.next_power_of_2(s.top_k), G=s.n_group, G_PAD=triton.next_power_of_2(s.n_group),
        EPG_PAD=triton.next_power_of_2(s.experts // s.n_group), E_PAD=triton.next_power_of_2(s.experts),
        TOPK_GROUP=s.topk_group, PROJ_ROWS=s.proj_rows, OPROJ_ROWS=s.oproj_rows,
        ROUTER_ROWS=s.router_rows, GU_ROWS=s.gu_rows, DOWN_ROWS=s.down_rows, BLOCK_K=s.block_k,
        KDA_BV=s.kda_bv, MAX_TASKS=schedule.max_tasks, P=schedule.programs, EPOCH=schedule.epoch, DONE=schedule.done,
        NORM_TASKS=schedule.norm_tasks, H_PAD=triton.next_power_of_2(s.hidden),
        TIMELINE=timeline, num_warps=num_warps)
