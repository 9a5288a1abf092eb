"""`lingls serve --draft`: the engine decodes speculatively and /metrics reports accept length and times."""

from __future__ import annotations

import pytest

from lingls.runtime.engine import EngineError, GenerateRequest
from lingls.runtime.local import EMBEDDED, LocalEngine
from lingls.runtime.server import Server

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
