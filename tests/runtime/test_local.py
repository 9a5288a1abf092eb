"""LocalEngine: the Engine protocol over the runner on a worker thread."""

import asyncio
import json
import math

import pytest
import torch

from lingls.engine.healing import strip_tail
from lingls.engine.local import LineGate, LocalEngine, StopMatcher
from lingls.engine.protocol import Engine, EngineError, GenerateRequest

from .conftest import reference_greedy


@pytest.fixture
def engine(tiny_dir):
    return LocalEngine(str(tiny_dir), device="cpu")


async def collect(engine, request):
    return [c async for c in engine.stream(request)]


async def test_protocol_and_greedy_text(engine, tiny_model):
    assert isinstance(engine, Engine) and engine.tokenizer.fim.prefix == "<|fim_prefix|>"
    assert engine.tokenizer.completion_prompt == "prefix" and engine.fim is None  # ling-nano's card: left to right
    prompt = "def add(a, b):\n    return"
    ids = engine.tokenizer.encode(prompt)
    assert engine.count_tokens(prompt) == len(ids)
    text = "".join([t async for t in engine.generate(GenerateRequest(prompt, max_tokens=12, heal=False))])
    want = reference_greedy(tiny_model, ids, 12)
    cut = [i for i, t in enumerate(want) if t in engine.tokenizer.eos_ids]
    assert text == engine.tokenizer.decode(want[: cut[0]] if cut else want)
    assert engine.stats.requests == 1 and engine.stats.generated_tokens >= 1


async def test_healed_generation_rechooses_the_cursor_token(engine, tiny_model):
    """With healing the prompt loses its last token; tokens are then chosen among those that agree with its
    text until one covers it (a chosen piece of it joins the prompt), and the completion starts after it."""
    tok = engine.tokenizer
    texts = tok.candidates().texts
    for prompt in ("def add(a, b):\n    ", "def add(a, b):\n    return a +"):
        healed, tail = tok.heal(tok.encode(prompt))
        assert tail and tok.decode(healed) + tail == prompt
        while True:
            with torch.no_grad():
                logits = tiny_model.logits(torch.tensor(healed))[-1]
            first = int(logits.masked_fill(~tok.candidates().mask(tail), float("-inf")).argmax())
            if texts[first].startswith(tail):
                break
            healed, tail = healed + [first], tail[len(texts[first]):]
        want = [first] + reference_greedy(tiny_model, healed + [first], 11)
        cut = [i for i, t in enumerate(want) if t in tok.eos_ids]
        text = "".join([t async for t in engine.generate(GenerateRequest(prompt, max_tokens=12))])
        assert text == strip_tail(tok.decode(want[: cut[0]] if cut else want), tail)


async def test_closing_the_stream_stops_within_one_step(engine):
    stream = engine.generate(GenerateRequest("x = 1\n", max_tokens=200))
    await stream.__anext__()
    await stream.aclose()
    await asyncio.sleep(0.5)
    runner = engine.runner
    consumed = len(runner.cache.tokens)
    await asyncio.sleep(0.3)
    assert len(runner.cache.tokens) == consumed  # nothing runs on
    assert consumed < len(engine.tokenizer.encode("x = 1\n")) + 10
    assert engine.stats.cancelled == 1


async def test_a_new_request_preempts_the_running_one(engine):
    first = engine.stream(GenerateRequest("a = [", max_tokens=400))
    await first.__anext__()
    second = asyncio.create_task(collect(engine, GenerateRequest("b = ", max_tokens=3)))
    rest = [c async for c in first]
    assert rest[-1].finish == "preempted" and rest[-1].usage["completion_tokens"] < 400
    done = await second
    assert done[-1].finish in ("length", "stop")
    assert engine.stats.extra["preempted"] == 1


async def test_cancelling_the_task_stops_generation(engine):
    """The task is cancelled as soon as its first piece arrives: a fixed sleep let the tiny model finish all
    400 tokens first on a fast machine, and then there was nothing to cancel."""
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate(GenerateRequest("while True:", max_tokens=400, heal=False)):
            started.set()
    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.5)
    consumed = len(engine.runner.cache.tokens)
    await asyncio.sleep(0.3)
    assert len(engine.runner.cache.tokens) == consumed


def test_the_line_gate_passes_likely_lines_and_ends_at_the_first_unlikely_one():
    log_half = math.log(0.5)
    gate = LineGate(0.2)  # two tokens at 1/2 pass, three do not
    assert gate.feed("a = ", log_half) == ("", False)  # held until its line ends
    assert gate.feed("1\n  b", log_half) == ("a = 1\n", False)  # the newline's token counts in the line it ends
    assert gate.feed(" = 2", log_half) == ("", False)
    assert gate.feed(" + 3", log_half) == ("", False)
    assert gate.feed("", log_half, final=True) == ("", True) and gate.refused  # "  b = 2 + 3" and its end: 1/8
    gate = LineGate(0.2)
    assert gate.feed("x\n\ny", log_half) == ("x\n\n", False)  # the empty line after it costs nothing
    assert gate.feed("", 0.0, final=True) == ("y", False) and not gate.refused
    gate = LineGate(0.9)
    assert gate.feed("z\n", log_half) == ("", True) and gate.refused
    gate = LineGate(0.3)  # a line is refused as soon as it falls below, before its end
    assert gate.feed("ok\na", 0.0) == ("ok\n", False)
    assert gate.feed("b", log_half) == ("", False)
    assert gate.feed("c", log_half) == ("", True) and gate.refused


async def test_the_engine_gates_a_completion_on_its_probability(engine, tiny_model):
    """A line passes when the model gave it at least min_line_probability, by the model's own logits."""
    prompt = "def add(a, b):\n    return"
    ids = engine.tokenizer.encode(prompt)
    want = reference_greedy(tiny_model, ids, 6)
    text = engine.tokenizer.decode(want)
    assert "\n" not in text and not set(want) & set(engine.tokenizer.eos_ids)  # one line: one product
    with torch.no_grad():
        logits = tiny_model.logits(torch.tensor(ids + want))[len(ids) - 1:-1].float()
    line = math.exp(float(logits.log_softmax(-1).gather(-1, torch.tensor(want)[:, None]).sum()))

    async def run(bar):
        return "".join([t async for t in engine.generate(GenerateRequest(prompt, max_tokens=6, heal=False,
                                                                        min_line_probability=bar))])
    assert await run(line * 0.99) == text and engine.stats.extra["unsure_lines"] == 0
    assert await run(min(line * 1.01, 0.999)) == "" and engine.stats.extra["unsure_lines"] == 1
    assert await run(0.0) == text


def test_stop_strings_cut_and_hold_back():
    m = StopMatcher(["\n\n", "END"])
    assert m.feed("abc\n") == ("abc", False)
    assert m.feed("x") == ("\nx", False)
    assert m.feed("EN") == ("", False)
    assert m.feed("D tail") == ("", True)
    assert StopMatcher([]).feed("a\n\n") == ("a\n\n", False)


def test_broken_model_directories(tmp_path, tiny_dir):
    with pytest.raises(EngineError, match="does not exist"):
        LocalEngine(str(tmp_path / "nope"))
    with pytest.raises(EngineError, match="lacks config.json, tokenizer.json, \\*.safetensors"):
        LocalEngine(str(tmp_path))


async def test_a_corrupt_checkpoint_fails_the_request_with_a_clear_error(tmp_path, tiny_dir):
    for f in tiny_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = LocalEngine(str(tmp_path), device="cpu")
    with pytest.raises(EngineError, match="cannot load the model"):
        await collect(engine, GenerateRequest("x"))


async def test_the_embedded_model_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a random stand-in, if needed, goes here
    engine = LocalEngine(device="cpu")
    assert engine.tokenizer.fim is not None and engine.count_tokens("def f():\n    pass\n") > 0
    chunks = [c async for c in engine.stream(GenerateRequest("def add(a, b):\n    return", max_tokens=4))]
    assert chunks[-1].finish in ("length", "stop") and chunks[-1].usage["completion_tokens"] >= 1


def test_simulated_acceptance_needs_a_drafter_and_fits_k(tiny_dir):
    """--simulate-accept (benchmarks at random weights) is refused clearly without a drafter or beyond K."""
    with pytest.raises(EngineError, match="needs a drafter"):
        LocalEngine(str(tiny_dir), device="cpu", simulate_accept=1).load()
    with pytest.raises(EngineError, match="must be 0..2"):
        LocalEngine(str(tiny_dir), device="cpu", draft="lookup", draft_k=2, simulate_accept=5).load()
