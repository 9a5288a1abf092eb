"""The prefill path (issue 39) computes what the step before it computed: flash-form MLA over the expanded
latent == the absorbed form, the grouped Triton experts == their plain definition (under Triton's interpreter),
and a whole prompt through the runner == the benchmark's baseline (the path before issue 39)."""

import os

import pytest
import torch

from lingls.bench.prefix import legacy_prefill_step, slow_gates
from lingls.kernels import prefill_kda, prefill_kda_state, prefill_moe
from lingls.model.ling import LingForCausalLM
from lingls.runtime.runner import ModelRunner, Sampling
from tests.model.conftest import randomize, small_config


def build(**over):
    torch.manual_seed(0)
    model = LingForCausalLM(small_config(**over))
    model.init_weights()
    randomize(model, 0)
    return model.eval()


@pytest.mark.parametrize("end_aligned", [False, True])
def test_flash_form_mla_equals_absorbed(end_aligned):
    model = build(num_hidden_layers=2)
    attn = model.model.layers[1].attention
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=g)
    cache = torch.randn(64, attn.rank + attn.rope, generator=g)  # rows before the queries: an earlier prefix
    pos = torch.arange(24, 64)
    with torch.no_grad():
        cache[24:] = attn.latent(x, pos)
        want = attn.attend_latent(x[:16], pos[:16], cache, 64)  # the absorbed form (<= 16 queries) ...
        got = attn.attend_prefill(x, pos, cache, 64, end_aligned)
        assert (got[:16] - want).abs().max().item() < 1e-5
        for t in range(16, 40, 7):  # ... at every query
            assert (got[t:t + 1] - attn.attend_latent(x[t:t + 1], pos[t:t + 1], cache, 64)).abs().max().item() < 1e-5


@pytest.mark.parametrize("prompt", [70, 150])
def test_runner_prefill_equals_the_path_before(prompt):
    """Chunks of 64, tail pieces of 7 and 1 tokens, 64 experts (the grouped path): the same state and token."""
    model = build(num_experts=64, n_group=4, topk_group=2, num_experts_per_tok=4)
    ids = torch.randint(0, 96, (prompt,), generator=torch.Generator().manual_seed(2)).tolist()
    results = []
    for legacy in (True, False):
        runner = ModelRunner(model, capacity=256, prefill_chunk=64)
        if legacy:
            runner.prefill_step = legacy_prefill_step(model)
        runner.prefill(ids, Sampling())
        results.append((runner.state.clone(), runner.chosen()))
    (old, old_tok), (new, new_tok) = results
    assert old_tok == new_tok
    for a, b in ((new.kda, old.kda), (new.conv, old.conv), (new.latent[:, :prompt], old.latent[:, :prompt])):
        assert (a - b).abs().max().item() < 1e-4


def test_sort_pairs_pads_each_expert_to_whole_blocks():
    idx = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3]])
    rows, block_expert = prefill_moe.sort_pairs(idx, n_experts=5, block_m=2)
    assert rows.shape[0] == -(-(8 + 5 * 1) // 2) * 2 and block_expert.shape[0] == rows.shape[0] // 2
    assert rows.tolist()[:8] == [1, 4, 3, -1, 6, -1, 0, 2] and set(rows.tolist()[10:]) == {-1}
    assert block_expert.tolist() == [0, 1, 2, 3, 3, 5, 5]  # expert 3's pairs 0, 2, 5, 7 sorted: rows 6..9
    assert rows.tolist()[6:10] == [0, 2, 5, 7]


@pytest.mark.skipif(prefill_moe.triton is None, reason="needs Triton (its interpreter on a CPU)")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton kernels run on a GPU or under TRITON_INTERPRET=1")
@pytest.mark.parametrize("limit", [0.0, 0.5])
def test_grouped_kernels_equal_reference(limit):
    """fp32 operands: the same function to rounding (the interpreter rounds its bf16 casts by truncation, so
    bf16 agreement is checked on the GPU). On a GPU, tl.dot multiplies fp32 operands as TF32 (10-bit mantissas)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    n, k, e, h, inter = 37, 3, 8, 64, 24
    x = torch.randn(n, h, generator=g).to(dev)
    gate_up = (torch.randn(e, 2 * inter, h, generator=g) * 0.1).to(dev)
    down = (torch.randn(e, h, inter, generator=g) * 0.1).to(dev)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(dev)
    w = torch.rand(n, k, generator=g).to(dev)
    got = prefill_moe.moe_prefill_triton(x, w, idx, gate_up, down, inter, limit, block_m=16)
    want = prefill_moe.moe_prefill_reference(x, w, idx, gate_up, down, inter, limit)
    assert ((got - want).norm() / want.norm()).item() < (1e-5 if dev == "cpu" else 3e-3)


def test_padded_step_leaves_the_states_of_the_real_tokens():
    """A piece padded after its first n tokens (what a prefill graph runs): the real tokens' hidden states, the
    KDA and conv states and the MLA rows are those of the n tokens alone."""
    model = build(num_experts=64, n_group=4, topk_group=2, num_experts_per_tok=4)
    ids = torch.randint(0, 96, (128,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for n in (70, 127):
            alone, padded = model.new_state(160), model.new_state(160)
            want = model.step(ids[:n], alone, torch.arange(n), kv_len=n, prefill=True)
            valid = torch.arange(128) < n
            got = model.step(torch.where(valid, ids, 0), padded, torch.arange(128), kv_len=128, prefill=True,
                             valid=valid)
            assert (got[:n] - want).abs().max().item() < 1e-5
            for a, b in ((padded.kda, alone.kda), (padded.conv, alone.conv),
                         (padded.latent[:, :n], alone.latent[:, :n])):
                assert (a - b).abs().max().item() < 1e-5


def test_runner_with_prefill_graphs_prefills_the_same():
    """prefill_graphs: a cold prompt's first piece at its bucket's padded length (eager here, a graph on CUDA);
    the same state and first token as the plain path, and prefix reuse after it still works."""
    model = build(num_experts=64, n_group=4, topk_group=2, num_experts_per_tok=4)
    ids = torch.randint(0, 96, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    results = []
    for graphs in (False, True):
        runner = ModelRunner(model, capacity=300, prefill_chunk=512, prefill_graphs=graphs)
        assert runner.prefill_bucket(192) == 256 and runner.prefill_bucket(16) is None
        runner.prefill(ids, Sampling())
        assert (256 in runner._prefill_ids_buf) == graphs  # the first 192 tokens went through the padded step
        results.append((runner.state.clone(), runner.chosen()))
        edited = ids[:-1] + [(ids[-1] + 1) % 96]
        assert runner.prefill(edited, Sampling()) == 199  # the snapshot before the last token
    (plain, plain_tok), (padded, padded_tok) = results
    assert plain_tok == padded_tok
    for a, b in ((padded.kda, plain.kda), (padded.conv, plain.conv), (padded.latent[:, :200], plain.latent[:, :200])):
        assert (a - b).abs().max().item() < 1e-4


@pytest.mark.skipif(prefill_moe.triton is None, reason="needs Triton (its interpreter on a CPU)")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton kernels run on a GPU or under TRITON_INTERPRET=1")
@pytest.mark.parametrize("normalize", [False, True])
def test_route_kernel_chooses_as_the_reference(normalize):
    from lingls.kernels import reference as ref

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(6)
    for n, e, groups, keep, k in ((37, 64, 8, 4, 6), (5, 512, 8, 4, 8)):
        logits = torch.randn(n, e, generator=g).to(dev)
        bias = (torch.randn(e, generator=g) * 0.1).to(dev)
        w, idx = prefill_moe.route(logits, bias, k, groups, keep, normalize, 2.5)
        want_w, want_idx = ref.route_grouped_topk(logits, bias, k, groups, keep, normalize, 2.5)
        assert torch.equal(idx, want_idx)
        assert (w - want_w).abs().max().item() < 1e-6


@pytest.mark.skipif(prefill_moe.triton is None, reason="needs Triton (its interpreter on a CPU)")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton kernels run on a GPU or under TRITON_INTERPRET=1")
def test_sort_pairs_kernels_lay_out_the_pairs_as_the_torch_form():
    """The same blocks and block experts; inside each expert's run the same pairs (their order is free)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    for n, e, k, block in ((37, 8, 3, 16), (300, 64, 4, 16), (4, 5, 2, 2)):
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(dev)
        rows, block_expert = prefill_moe.sort_pairs_triton(idx, e, block)
        want_rows, want_block_expert = prefill_moe.sort_pairs(idx, e, block)
        assert torch.equal(block_expert, want_block_expert)
        assert rows.shape == want_rows.shape
        for x in range(e):
            mine = sorted(p for p in rows.tolist() if p >= 0 and idx.flatten()[p].item() == x)
            assert mine == sorted(p for p in want_rows.tolist() if p >= 0 and idx.flatten()[p].item() == x)
        placed = [p for p in rows.tolist() if p >= 0]
        assert sorted(placed) == list(range(n * k))
        for b, ex in enumerate(block_expert.tolist()):  # every pair sits in a block of its own expert
            for p in rows.view(-1, block)[b].tolist():
                if p >= 0:
                    assert idx.flatten()[p].item() == ex


@pytest.mark.skipif(prefill_moe.triton is None, reason="needs Triton (its interpreter on a CPU)")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton kernels run on a GPU or under TRITON_INTERPRET=1")
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("block", [prefill_kda.BLOCK, (16, 4), (1, 1)])
def test_kda_prefill_kernels_equal_the_torch_form(padded, block, monkeypatch):
    """The KDA layer of a prefill through `prefill_kda` (convolutions, norms, gate, beta, new conv state, gated
    output norm) == the torch form, from a non-zero state, with and without padded tokens at the end, at several
    programs' sizes (tokens a program; 37 tokens: a last block only partly filled); the snapshots after the first
    1, 9 and n - 1 tokens too (the conv states' kernel at several ends; the recurrence's by reruns on both sides)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(prefill_kda, "BLOCK", block)
    model = build(num_hidden_layers=2).to(dev)
    attn = model.model.layers[0].attention
    g = torch.Generator().manual_seed(8)
    t, c = 37, attn.heads * attn.d
    x = torch.randn(t, 32, generator=g).to(dev)
    conv_state = torch.randn(1, 3, c, 3, generator=g).to(dev)
    state = (torch.randn(1, attn.heads, attn.d, attn.d, generator=g) * 0.1).to(dev)
    valid = (torch.arange(t) < 30).to(dev) if padded else None
    from lingls.model import ling

    monkeypatch.setattr(ling, "_FLA", [None])  # the recurrence in torch on both sides: the kernels are the subject
    ends = torch.tensor([1, 9, (30 if padded else t) - 1], device=dev)
    snaps = [(ends, torch.zeros(3, attn.heads, attn.d, attn.d, device=dev), torch.zeros(3, 3, c, 3, device=dev))
             for _ in range(2)]
    with torch.no_grad():
        got = attn._prefill(x, conv_state[0], state.clone(), valid, snaps[0])
        monkeypatch.setenv("LINGLS_KERNELS", "0")  # the torch form on a GPU too
        want = attn.forward(x[None], conv_state, state.clone(), valid, snaps[1])
    for a, b in [*zip(got, want), *zip(snaps[0][1:], snaps[1][1:])]:
        assert ((a - b).norm() / b.norm()).item() < (1e-5 if dev == "cpu" else 1e-3)


def test_kda_snapshots_are_the_states_after_their_tokens():
    """The torch form's snapshots (a padded prefill's, by reruns) == the states of a prefill of the first ends[j]
    tokens alone, recurrent and conv."""
    model = build(num_hidden_layers=2)
    attn = model.model.layers[0].attention
    g = torch.Generator().manual_seed(11)
    t, c = 90, attn.heads * attn.d
    x = torch.randn(1, t, 32, generator=g)
    conv_state = torch.randn(1, 3, c, 3, generator=g)
    state = torch.randn(1, attn.heads, attn.d, attn.d, generator=g) * 0.1
    ends = torch.tensor([3, 64, 70, 81])
    kda_out, conv_out = torch.zeros(4, attn.heads, attn.d, attn.d), torch.zeros(4, 3, c, 3)
    valid = torch.arange(t) < 82
    with torch.no_grad():
        attn.forward(x, conv_state, state.clone(), valid, (ends, kda_out, conv_out))
        for j, end in enumerate(ends.tolist()):
            _, conv, rec = attn.forward(x[:, :end], conv_state, state.clone())
            assert _close(kda_out[j], rec[0]) and _close(conv_out[j], conv[0]), end


@pytest.mark.parametrize("prompt", [40, 75])
def test_tail_free_prefill_leaves_the_staged_tails_states(prompt):
    """A cold prompt in one padded piece with its end-8 and end-1 snapshots taken inside it (`tail_free`, eager on a
    CPU): the snapshots, the end states, the latent rows and the first token are those of the staged tail's path
    (a piece up to end-8, then the last 8 tokens as one staged step), to rounding; an edit of the last token and
    one a few tokens before it reuse those snapshots and choose what a fresh prefill of the edited prompt chooses."""
    from lingls.runtime.fused_step import FusedStep

    model = build(num_experts=64, n_group=4, topk_group=2, num_experts_per_tok=4)
    fused = FusedStep(model, kernels=False)
    ids = torch.randint(0, 96, (prompt,), generator=torch.Generator().manual_seed(12)).tolist()
    n = len(ids)

    def runner(tail_free: bool) -> ModelRunner:
        r = ModelRunner(model, capacity=300, prefill_chunk=512, prefill_graphs=True, tail_free=tail_free)
        r.fused = fused
        return r

    new, old = runner(True), runner(False)
    for r in (new, old):
        assert r.prefill(ids, Sampling()) == 0 and r.cache.snapshots == [n - 8, n - 1, n]
    assert list(new._prefill_ids_buf) == [256] and list(old._prefill_ids_buf) == [256]  # n and n - 8 tokens padded
    assert new._tail_snapshots().ends.tolist() == [n - 8, n - 1] and old._snapshots is None
    for p in (n - 8, n - 1, n):
        assert all(_close(x, y) for x, y in zip(_snapshot(new, p), _snapshot(old, p))), p
    assert _close(new.state.kda, old.state.kda) and _close(new.state.conv, old.state.conv)
    assert _close(new.state.latent[:, :n], old.state.latent[:, :n]) and new.chosen() == old.chosen()
    for at, reused in ((n - 1, n - 1), (n - 3, n - 8)):
        edited = list(ids)
        edited[at] = (edited[at] + 1) % 96
        assert new.prefill(edited, Sampling()) == reused
        fresh = runner(True)
        fresh.prefill(edited, Sampling())
        assert new.chosen() == fresh.chosen()
        assert _close(new.state.kda, fresh.state.kda) and _close(new.state.conv, fresh.state.conv)
        new.prefill(ids, Sampling())


def test_prefill_graphs_follow_cuda_graphs_by_default():
    """On by default where steps are graphs (CUDA), off where they are not (a CPU: nothing to replay)."""
    model = build(num_hidden_layers=2)
    assert not ModelRunner(model, capacity=64).prefill_graphs
    assert ModelRunner(model, capacity=64, use_graphs=True).prefill_graphs  # what a GPU runner gets
    assert not ModelRunner(model, capacity=64, use_graphs=True, prefill_graphs=False).prefill_graphs



def _snapshot(runner: ModelRunner, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    slot = runner.cache._slots[position]
    return runner.cache._kda[slot], runner.cache._conv[slot]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("prompt", [40, 75])
def test_staged_tail_leaves_what_the_two_tail_pieces_left(prompt):
    """A prompt's last 8 tokens as one staged fused step, settled at end-1 for its snapshot (`_staged_tail`, the
    fused step's torch references on a CPU): the end state, hidden state and first token are the 8-token step's
    bit for bit (the commits replay its recurrence); against the path before (a fused step of 7 tokens, then
    one of 1, which a swapped-in prefill step still takes) the end-8 snapshot is the same bits and the end-1
    and end states agree to rounding (a step of 8 rows rounds its matmuls as it rounds them, not as 7 and 1
    rows do), with the same first token; an edit of the last token and one a few tokens before it reuse the
    end-1 and end-8 snapshots and choose what a fresh prefill of the edited prompt chooses."""
    from lingls.runtime.fused_step import FusedStep

    model = build(num_experts=64, n_group=4, topk_group=2, num_experts_per_tok=4)
    fused = FusedStep(model, kernels=False)
    ids = torch.randint(0, 96, (prompt,), generator=torch.Generator().manual_seed(6)).tolist()
    n = len(ids)

    def runner(two_pieces: bool = False) -> ModelRunner:
        r = ModelRunner(model, capacity=128, prefill_chunk=512)
        r.fused = fused
        if two_pieces:
            r.prefill_step = lambda *args, **kw: r._prefill_step(*args, **kw)
        return r

    new, old = runner(), runner(two_pieces=True)
    for r in (new, old):
        assert r.prefill(ids, Sampling()) == 0
        assert r.cache.snapshots == [n - 8, n - 1, n]
    with torch.no_grad():  # the tail as one plain (unstaged) 8-token step from the end-8 snapshot
        state = model.new_state(128)
        state.kda.copy_(_snapshot(new, n - 8)[0])
        state.conv.copy_(_snapshot(new, n - 8)[1])
        state.latent.copy_(new.state.latent)
        h = fused.step(torch.tensor(ids[n - 8:]), state, torch.arange(n - 8, n), n)
    assert torch.equal(new.state.kda, state.kda) and torch.equal(new.state.conv, state.conv)
    assert torch.equal(_snapshot(new, n)[0], state.kda) and torch.equal(_snapshot(new, n)[1], state.conv)
    assert new.chosen() == int(fused.head(h[-1:]).argmax(-1))

    assert all(torch.equal(x, y) for x, y in zip(_snapshot(new, n - 8), _snapshot(old, n - 8)))
    for p in (n - 1, n):
        assert all(_close(x, y) for x, y in zip(_snapshot(new, p), _snapshot(old, p))), p
    assert _close(new.state.latent[:, :n], old.state.latent[:, :n])
    assert new.chosen() == old.chosen()

    for at, reused in ((n - 1, n - 1), (n - 3, n - 8)):
        edited = list(ids)
        edited[at] = (edited[at] + 1) % 96
        assert new.prefill(edited, Sampling()) == reused
        fresh = runner()
        fresh.prefill(edited, Sampling())
        assert new.chosen() == fresh.chosen()
        assert _close(new.state.kda, fresh.state.kda) and _close(new.state.conv, fresh.state.conv)
        new.prefill(ids, Sampling())  # back to the prompt (reusing its end-8 snapshot)
    appended = ids + [5, 7]  # two tokens typed after it: a staged tail of 2 from the end snapshot
    assert new.prefill(appended, Sampling()) == n and new.cache.snapshots[-2:] == [n + 1, n + 2]
    fresh = runner()
    fresh.prefill(appended, Sampling())
    assert new.chosen() == fresh.chosen() and _close(new.state.kda, fresh.state.kda)


class _Absorbed:
    """A speculative round as `ModelRunner.attach` sees it: the layers it keeps, and every piece it absorbs."""

    keep = (1, 3)

    def __init__(self):
        self.pieces = []

    def prefill(self, h, kept, ids, positions, start):
        self.pieces.append((positions.clone(), {i: x.clone() for i, x in kept.items()}, start))


def test_an_attached_round_absorbs_every_piece_and_the_tail_stays_two_pieces():
    """With a speculative round attached, its drafter absorbs every prefill piece with the residual streams after
    the layers it keeps: the long first piece (the model's prefill step, whose residual stream is updated in place:
    the kept ones are copies), the piece up to the end-1 snapshot and the last token (the tail stays two pieces:
    the staged tail's single step would hand the drafter no end-1 piece). The states and first token are those of
    the two-piece path without a round (keeping layers changes no arithmetic); the kept streams are those of one
    plain step over the whole prompt (to rounding)."""
    from lingls.runtime.fused_step import FusedStep

    model = build(num_experts=64, n_group=4, topk_group=2, num_experts_per_tok=4)
    fused = FusedStep(model, kernels=False)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    n = len(ids)
    spec, plain = ModelRunner(model, capacity=128, prefill_chunk=512), ModelRunner(model, capacity=128,
                                                                                   prefill_chunk=512)
    spec.fused = plain.fused = fused
    plain.prefill_step = lambda *args, **kw: plain._prefill_step(*args, **kw)  # the two tail pieces, no round
    absorbed = _Absorbed()
    spec.attach(absorbed)
    for r in (spec, plain):
        assert r.prefill(ids, Sampling()) == 0 and r.cache.snapshots == [n - 8, n - 1, n]
    assert torch.equal(spec.state.kda, plain.state.kda) and torch.equal(spec.state.conv, plain.state.conv)
    assert spec.chosen() == plain.chosen()

    assert [(int(p[0]), len(p), start) for p, _, start in absorbed.pieces] == [(0, n - 8, 0), (n - 8, 7, n - 8),
                                                                                (n - 1, 1, n - 1)]
    with torch.no_grad():
        _, whole = model.step(torch.tensor(ids), model.new_state(128), torch.arange(n), n, keep=spec.spec.keep)
    for positions, kept, _ in absorbed.pieces:
        assert sorted(kept) == [1, 3]
        for i in kept:
            assert (kept[i] - whole[i][positions]).abs().max().item() < 1e-4, (int(positions[0]), i)
    spec.attach(None)
    spec.cache.reset()
    spec.prefill(ids, Sampling())  # detached: the staged tail again, and nothing absorbed
    assert len(absorbed.pieces) == 3 and spec.chosen() == plain.chosen()


def _state_pass_inputs(t, heads, d, dv, dtype, device, seed):
    """Inputs of a KDA state pass as fla's intra stage makes them: gated keys and w of unit scale, gate cumsums
    (log2) restarting at every 64-token chunk, slow enough that the state carries across chunks."""
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=g)  # noqa: E731
    gates = slow_gates(rnd(1, t, heads, d), -5.0) * 1.4427  # log2
    gk = torch.cat([c.cumsum(1) for c in gates.split(64, 1)], 1)
    kg = (rnd(1, t, heads, d) * d ** -0.5).to(dtype)
    w = (rnd(1, t, heads, d) * d ** -0.5).to(dtype)
    u = rnd(1, t, heads, dv).to(dtype)
    return kg, w, u, gk, rnd(1, heads, d, dv) * 0.1


@pytest.mark.skipif(prefill_kda_state.triton is None, reason="needs Triton (its interpreter on a CPU)")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton kernels run on a GPU or under TRITON_INTERPRET=1")
@pytest.mark.parametrize("t, heads, d, columns, dtype", [(150, 2, 32, 16, torch.float32),
                                                         (128, 1, 64, 32, torch.float32),
                                                         (37, 2, 32, 32, torch.float32),
                                                         (37, 2, 32, 32, torch.bfloat16)])
def test_kda_state_pass_in_columns_is_its_definition(t, heads, d, columns, dtype):
    """The narrow state pass against `state_pass_reference` on fresh random inputs: a last chunk partly filled
    (150, 37 tokens), one whole chunk or two, one to two programs a head; the states entering every chunk, the new
    values and the final state (its update in bf16x3: near fp32; the first product in tf32 on a GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("Triton's interpreter multiplies bf16 operands wrongly (Triton 3.6, NumPy 2.4); bf16 on a GPU")
    kg, w, u, gk, h0 = _state_pass_inputs(t, heads, d, d, dtype, device, seed=t)
    h, v_new, final = prefill_kda_state.state_pass(kg, w, u, gk, h0, columns, stages=2)
    h_ref, v_ref, final_ref = prefill_kda_state.state_pass_reference(kg, w, u, gk, h0)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3 if device == "cuda" else 1e-4
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert h.shape == h_ref.shape and v_new.shape == v_ref.shape and final.dtype == torch.float32
    assert rel(h, h_ref) < tol and rel(v_new, v_ref) < tol and rel(final, final_ref) < tol


def _chunk_gated(k, gk):
    """fla's chunk-end-gated keys: k[r] 2^(gk[last] - gk[r]), last the final row of r's 64-token chunk."""
    t = k.shape[1]
    last = torch.clamp(torch.arange(t, device=k.device) // 64 * 64 + 63, max=t - 1)
    return (k.float() * torch.exp2(gk[:, last] - gk)).to(k.dtype)


@pytest.mark.skipif(prefill_kda_state.triton is None, reason="needs Triton (its interpreter on a CPU)")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton kernels run on a GPU or under TRITON_INTERPRET=1")
@pytest.mark.parametrize("t, ends", [(150, (1, 63, 64, 65, 142, 149, 150)), (37, (29, 36))])
def test_state_pass_snapshots_are_the_states_after_their_tokens(t, ends):
    """The narrow state pass with snapshot ends keeps the fp32 state entering each end's chunk, and `snapshots`
    finishes them: each equals the final state of a state pass over the first ends[s] rows alone (their chunk's
    keys gated to its new last row; w and u unchanged, the intra-chunk system being lower-triangular), at a chunk's
    first row, its last, the sequence's end; `snapshots_reference` is the same formula in torch."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    heads, d, columns = 2, 32, 16
    k, w, u, gk, h0 = _state_pass_inputs(t, heads, d, d, torch.float32, device, seed=t + 1)
    ends_t = torch.tensor(ends, device=device)
    h, v_new, final, entering = prefill_kda_state.state_pass(_chunk_gated(k, gk), w, u, gk, h0, columns, 2, ends_t)
    snaps = prefill_kda_state.snapshots(k, gk, v_new, entering, ends_t, columns=columns)
    tol = 5e-3 if device == "cuda" else 1e-4
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(snaps, prefill_kda_state.snapshots_reference(k, gk, v_new, entering, ends_t)) < tol
    for s, end in enumerate(ends):
        want = prefill_kda_state.state_pass_reference(_chunk_gated(k[:, :end], gk[:, :end]), w[:, :end], u[:, :end],
                                                      gk[:, :end], h0)[2][0]
        assert rel(snaps[s], want) < tol, end
    assert rel(snaps[-1], final[0]) < tol if ends[-1] == t else True


@pytest.mark.skipif(not torch.cuda.is_available() or not prefill_kda_state.available(),
                    reason="fla-core 0.6.0's kernels run on a GPU only (not under Triton's interpreter)")
@pytest.mark.parametrize("t, columns, dtype", [(1000, 16, torch.float32), (4096, 32, torch.float32),
                                               (300, 64, torch.float32), (8192, 16, torch.float32),
                                               (1000, 16, torch.bfloat16), (8192, 16, torch.bfloat16)])
def test_chunk_kda_with_the_narrow_state_pass_computes_what_fla_does(t, columns, dtype):
    """fla's chunk_kda with the narrow state pass: fla's own pass's states and values (to summation order), and
    the whole recurrence as close to the fp32 torch chunked form as fla's own (within twice its error), with q, k
    and v in fp32 or in bf16 (as a bf16 model's prefill hands them: the torch form then runs on the same values)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.kda import chunk_kda

    from lingls.kernels import reference as ref

    heads, d = 8, 128  # a TP=4 rank of Ling-3.0-flash
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    with torch.inference_mode():
        kg, w, u, gk, h0 = _state_pass_inputs(t, heads, d, d, torch.bfloat16, "cuda", seed=5)
        h, v_new, final = prefill_kda_state.state_pass(kg, w, u, gk, h0, columns)
        h1, v1, final1 = chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=gk, initial_state=h0,
                                                      output_final_state=True, chunk_size=64)
        assert rel(h, h1) < 1e-2 and rel(v_new, v1) < 1e-2 and rel(final, final1) < 1e-2

        g = torch.Generator(device="cuda").manual_seed(6)
        rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
        q = (ref.l2_normalize(rnd(1, t, heads, d)) * d ** -0.5).to(dtype)
        k = ref.l2_normalize(rnd(1, t, heads, d)).to(dtype)
        v, gate = rnd(1, t, heads, d).to(dtype), slow_gates(rnd(1, t, heads, d), -5.0)  # states carried on
        beta, s0 = torch.sigmoid(rnd(1, t, heads)), rnd(1, heads, d, d) * 0.05
        o, s = prefill_kda_state.chunk_kda(q, k, v, gate, beta, s0, columns)
        o1, s1 = chunk_kda(q=q, k=k, v=v, g=gate, beta=beta, scale=1.0, initial_state=s0, output_final_state=True,
                           use_qk_l2norm_in_kernel=False)
        o_ref, s_ref = ref.kda_chunked(q.float(), k.float(), v.float(), gate, beta, s0)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert rel(o, o1) < 1e-2 and rel(s, s1) < 1e-2
    assert rel(o, o_ref) < 2 * rel(o1, o_ref) + 1e-4 and rel(s, s_ref) < 2 * rel(s1, s_ref) + 1e-4


@pytest.mark.skipif(not torch.cuda.is_available() or not prefill_kda_state.available(),
                    reason="fla-core 0.6.0's kernels run on a GPU only (not under Triton's interpreter)")
@pytest.mark.parametrize("t", [200, 1000])
def test_bf16_prefill_hands_the_recurrence_bf16_inputs(t, monkeypatch):
    """A bf16 model's KDA layer in a prefill: q, k and v reach the chunked recurrence in bf16 (as fla's chunk_kda
    takes them in SGLang's KDA prefill), and the layer's output, conv state and recurrent state stay within bf16's
    rounding of the fp32-input form (`prefill_kda.FP32_INPUTS`) and of the torch form."""
    model = build(num_hidden_layers=2, head_dim=32, hidden_size=128).to("cuda", torch.bfloat16)
    attn = model.model.layers[0].attention
    assert prefill_kda_state.columns_for(t, attn.d)[0], "the narrow pass must take this layer"
    g = torch.Generator().manual_seed(9)
    c = attn.heads * attn.d
    x = torch.randn(t, 128, generator=g).to("cuda", torch.bfloat16)
    conv_state = torch.randn(1, 3, c, 3, generator=g).to("cuda", torch.bfloat16)
    state = (torch.randn(1, attn.heads, attn.d, attn.d, generator=g) * 0.1).to("cuda")
    seen = []
    real = prefill_kda_state.chunk_kda
    monkeypatch.setattr(prefill_kda_state, "chunk_kda", lambda q, *rest: seen.append(q.dtype) or real(q, *rest))
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    with torch.no_grad():
        got = attn._prefill(x, conv_state[0], state.clone(), None)
        monkeypatch.setattr(prefill_kda, "FP32_INPUTS", True)
        fp32_inputs = attn._prefill(x, conv_state[0], state.clone(), None)
        monkeypatch.setenv("LINGLS_KERNELS", "0")
        want = attn.forward(x[None], conv_state, state.clone())
    assert seen == [torch.bfloat16, torch.float32]
    for a, b, w in zip(got, fp32_inputs, want):
        assert a.dtype == b.dtype and rel(a, b) < 2e-2 and rel(a, w) < 3e-2, (rel(a, b), rel(a, w))


@pytest.mark.skipif(not torch.cuda.is_available() or not prefill_kda_state.available(),
                    reason="fla-core 0.6.0's kernels run on a GPU only (not under Triton's interpreter)")
@pytest.mark.parametrize("t", [1000, 8192])
def test_chunk_kda_snapshots_are_the_states_after_their_tokens_on_the_gpu(t):
    """At a TP=4 rank's heads with bf16 inputs: chunk_kda with snapshot ends gives the same output and final state
    bits as without, and each snapshot is the final state of chunk_kda over the first ends[s] tokens alone (to
    the rounding of the partial chunk's new values to bf16)."""
    from lingls.kernels import reference as ref

    heads, d = 8, 128
    g = torch.Generator(device="cuda").manual_seed(13)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    q = (ref.l2_normalize(rnd(1, t, heads, d)) * d ** -0.5).to(torch.bfloat16)
    k = ref.l2_normalize(rnd(1, t, heads, d)).to(torch.bfloat16)
    v, gate = rnd(1, t, heads, d).to(torch.bfloat16), slow_gates(rnd(1, t, heads, d), -5.0)
    beta, s0 = torch.sigmoid(rnd(1, t, heads)), rnd(1, heads, d, d) * 0.05
    ends = torch.tensor([64, 65, t - 8, t - 1, t], device="cuda")
    out = torch.empty(5, heads, d, d, device="cuda")
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    with torch.inference_mode():
        o, s = prefill_kda_state.chunk_kda(q, k, v, gate, beta, s0, 16, 3, ends, out)
        o1, s1 = prefill_kda_state.chunk_kda(q, k, v, gate, beta, s0, 16, 3)
        assert torch.equal(o, o1) and torch.equal(s, s1)
        for j, end in enumerate(ends.tolist()):
            _, want = prefill_kda_state.chunk_kda(q[:, :end], k[:, :end], v[:, :end], gate[:, :end], beta[:, :end],
                                                  s0, 16, 3)
            assert rel(out[j], want[0]) < 5e-3, (end, rel(out[j], want[0]))
