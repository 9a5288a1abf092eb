"""`lingls serve --draft`: the engine decodes speculatively and /metrics reports accept length and times."""

from __future__ import annotations

import pytest

from lingls.engine.local import EMBEDDED, LocalEngine
from lingls.engine.protocol import EngineError, GenerateRequest
from lingls.serve.http_server import Server

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"


async def _complete(engine, **kw) -> str:
    return "".join([t async for t in engine.generate(GenerateRequest(prompt=PROMPT, max_tokens=24, **kw))])


async def test_metrics_report_speculation():
    plain = LocalEngine(str(EMBEDDED), device="cpu")
    engine = LocalEngine(str(EMBEDDED), device="cpu", draft="lookup+mtp", draft_k=3)
    try:
        assert await _complete(engine, temperature=0.0) == await _complete(plain, temperature=0.0)
        text = (await Server(engine, "ling-nano").metrics(None)).text
    finally:
        await engine.close()
        await plain.close()
    values = dict(line.split() for line in text.splitlines() if line.startswith("lingls_spec_"))
    assert int(values["lingls_spec_rounds_total"]) > 0
    assert 1.0 <= float(values["lingls_spec_accept_length"]) <= 4.0
    assert float(values["lingls_spec_verify_seconds_total"]) > 0


@pytest.mark.parametrize("draft, message", [("nonsense", "not none, mtp, lookup"),
                                            ("mtp+lookup", "lookup first")])
async def test_a_bad_draft_is_a_clear_error(draft, message):
    engine = LocalEngine(str(EMBEDDED), device="cpu", draft=draft)
    try:
        with pytest.raises(EngineError, match=message):
            await engine.start()
    finally:
        await engine.close()


async def test_serve_with_a_dspark_checkpoint(tmp_path, nano):
    """`lingls serve --model DIR --draft DSPARK_DIR` (and lookup+DSPARK_DIR): K defaults to the block size, the
    greedy text is the plain model's; a DSpark checkpoint for another target is refused by the engine, naming
    the key."""
    from .conftest import dspark_dir

    draft = dspark_dir(nano, tmp_path / "dspark")
    plain = LocalEngine(str(EMBEDDED), device="cpu")
    try:
        want = await _complete(plain, temperature=0.0)
        for spec in (str(draft), f"lookup+{draft}"):
            engine = LocalEngine(str(EMBEDDED), device="cpu", draft=spec)
            try:
                assert await _complete(engine, temperature=0.0) == want
                assert engine.runner.spec.k == 8 and engine.runner.spec.stats.rounds > 0
            finally:
                await engine.close()
    finally:
        await plain.close()
    import json

    raw = json.loads((draft / "config.json").read_text())
    raw["hidden_size"] = 128
    (draft / "config.json").write_text(json.dumps(raw))
    engine = LocalEngine(str(EMBEDDED), device="cpu", draft=str(draft))
    try:
        with pytest.raises(EngineError, match="hidden_size 128 does not match the target's 320"):
            await engine.start()
    finally:
        await engine.close()


async def test_weightless_checkpoints_serve_with_simulated_acceptance(tmp_path):
    """Benchmarks: a weightless target and a weightless DSpark drafter (random weights built at load time)
    serve end to end with --simulate-accept."""
    from lingls.engine.local import tiny_config_dict
    from lingls.model.config import LingConfig
    from lingls.model.random_checkpoint import main as random_checkpoint_main

    LingConfig.from_dict(tiny_config_dict(512)).save(tmp_path / "cfg.json")
    target = [str(tmp_path / "target"), "--config", str(tmp_path / "cfg.json"), "--weightless"]
    assert random_checkpoint_main(target) == 0
    assert random_checkpoint_main([str(tmp_path / "draft"), "--dspark", "--target", str(tmp_path / "target"),
                                   "--small", "--weightless"]) == 0
    engine = LocalEngine(str(tmp_path / "target"), device="cpu", draft=str(tmp_path / "draft"), simulate_accept=5)
    try:
        text = "".join([t async for t in engine.generate(GenerateRequest(prompt="t1 t2 t3", max_tokens=18))])
        st = engine.runner.spec.stats
        assert text and st.rounds > 0 and st.accepted == 5 * st.rounds
    finally:
        await engine.close()
