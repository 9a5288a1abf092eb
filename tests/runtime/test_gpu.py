"""On a GPU (skipped elsewhere): the graph-replayed loop never synchronises and gives the eager loop's tokens;
speculative rounds in their captured graphs give plain greedy decoding's tokens and their eager rounds' tokens."""

import pytest
import torch

from lingls.engine.local import EMBEDDED
from lingls.engine.tokenizer import Tokenizer
from lingls.model import load_model
from lingls.runtime.runner import ModelRunner, Sampling
from lingls.runtime.spec.round import Speculator, attach

from ..spec.conftest import ScriptedDrafter
from ..spec.test_greedy import CODE
from .conftest import reference_greedy
from .test_cache import BASE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def gpu_model(tiny_dir):
    return load_model(tiny_dir, device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=3)])
def test_decode_loop_never_synchronises(gpu_model, graphs, sampling):
    r = ModelRunner(gpu_model, capacity=512, use_graphs=graphs)
    list(r.generate(BASE, 4, sampling))  # captures the graphs this test replays
    r.prefill(BASE + [5], sampling)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = list(r.decode(32, sampling.greedy))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(got) == 32


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=3)])
def test_graphs_equal_eager_and_the_reference(gpu_model, sampling):
    graph = list(ModelRunner(gpu_model, capacity=512, use_graphs=True).generate(BASE, 24, sampling))
    eager = list(ModelRunner(gpu_model, capacity=512, use_graphs=False).generate(BASE, 24, sampling))
    assert graph == eager
    if sampling.greedy:
        assert graph == reference_greedy(gpu_model, BASE, 24)


def test_prefix_reuse_equals_cold_on_gpu(gpu_model):
    warm = ModelRunner(gpu_model, capacity=512, prefill_chunk=32)
    list(warm.generate(BASE, 6))
    for prompt in (BASE[:-1] + [4242], BASE[:70] + [9] + BASE[71:], BASE + [1, 2]):
        cold = list(ModelRunner(gpu_model, capacity=512, prefill_chunk=32).generate(prompt, 12))
        assert list(warm.generate(prompt, 12)) == cold


def test_warmup_prefill_leaves_no_trace(gpu_model):
    """The warm-up's prefill (its kernels compiled before any request) is forgotten: the next request starts
    cold and gives what a fresh runner gives."""
    warm = ModelRunner(gpu_model, capacity=512, prefill_chunk=32)
    warm.warmup(greedy_only=True)
    assert warm.cache.tokens == []
    fresh = ModelRunner(gpu_model, capacity=512, prefill_chunk=32)
    assert list(warm.generate(BASE, 12)) == list(fresh.generate(BASE, 12))


@pytest.mark.parametrize("miss", [False, True])
def test_graphed_speculation_equals_plain_greedy(gpu_model, miss):
    """Rounds that accept every draft or none, on the fused kernels in captured graphs: the verify step's staging
    and the commit leave exactly the states that plain greedy decoding reaches."""
    want = list(ModelRunner(gpu_model, capacity=512).generate(BASE, 40))
    runner = ModelRunner(gpu_model, capacity=512)
    k = 5
    spec = Speculator(runner, ScriptedDrafter(k, want, len(BASE), miss, gpu_model.config.vocab_size, device="cuda"))
    assert list(runner.generate(BASE, 28)) == want[:28]
    assert spec.stats.accepted == (0 if miss else spec.stats.rounds * k)


def test_graphed_mtp_rounds_equal_eager_rounds():
    """The MTP drafter on the fused kernels: the captured draft and verify graphs give the tokens of the same
    rounds run eagerly."""
    nano = load_model(EMBEDDED, device="cuda", dtype=torch.float32)
    prompt = Tokenizer(EMBEDDED).encode(CODE)
    got = {}
    for graphs in (True, False):
        runner = ModelRunner(nano, capacity=512, use_graphs=graphs)
        attach(runner, "mtp", k=4)
        got[graphs] = list(runner.generate(prompt, 40))
    assert got[True] == got[False]


def test_tail_free_prefill_equals_the_staged_tail_on_gpu(gpu_model):
    """A cold prompt as one padded piece whose chunked recurrence also leaves the end-8 and end-1 snapshots (graph
    replays; the narrow state pass's snapshots where fla-core serves) against the staged tail's path: the same
    tokens, the snapshots to rounding, and edits that reuse them give a fresh runner's tokens."""
    prompt = (BASE * 4)[:300]
    n = len(prompt)
    runners = [ModelRunner(gpu_model, capacity=512, use_graphs=True, tail_free=free) for free in (True, False)]
    tokens = [list(r.generate(prompt, 16)) for r in runners]
    assert tokens[0] == tokens[1]
    new, old = runners
    assert new._tail_snapshots().ends.tolist() == [n - 8, n - 1] and old._snapshots is None
    for p in (n - 8, n - 1):
        for a, b in zip(*((r.cache._kda[r.cache._slots[p]], r.cache._conv[r.cache._slots[p]]) for r in runners)):
            assert ((a - b).norm() / b.norm()).item() < 1e-3, p
    for at in (n - 1, n - 3):
        edited = list(prompt)
        edited[at] = (edited[at] + 1) % 100
        fresh = ModelRunner(gpu_model, capacity=512, use_graphs=True, tail_free=False)
        assert list(new.generate(edited, 12)) == list(fresh.generate(edited, 12))
