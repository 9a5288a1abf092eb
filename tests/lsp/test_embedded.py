"""End-to-end with the real in-process engine (LocalEngine): the default `lingls --stdio` with no test hooks.

The pipeline is checked end to end (capability, prompt, generation, clean-up, ranges, `lingls complete`)
whatever the model. Whether the completion is sensible depends on the embedded weights: without them
(LocalEngine then runs a random tiny stand-in) that check is skipped; with weights that miss the obvious
answer it is an expected failure that names the model, so the suite reports model quality without failing
on it (that is training's job, see lingls/assets/ling-nano/MODEL_CARD.md)."""

import subprocess
import sys
from pathlib import Path

import pytest
from lsprotocol import types as lsp

from lsp_harness import REPO, complete, open_doc, serve, server_env, stats

SPECIALS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>", "<|endoftext|>")
EMBEDDED = REPO / "lingls" / "assets" / "ling-nano"
HAVE_WEIGHTS = (EMBEDDED / "config.json").is_file() and any(EMBEDDED.glob("*.safetensors"))
SOURCE = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        "

pytestmark = pytest.mark.skipif(not (REPO / "lingls" / "engine" / "local.py").is_file(),
                                reason="lingls.engine.local (the in-process engine) is not in this checkout")


async def test_embedded_model_completes_python():
    async with serve(engine=None, options={"device": "cpu", "maxTokens": 16}) as client:
        assert client.init_result.capabilities.inline_completion_provider is not None
        open_doc(client, SOURCE + "\n")
        line, col = SOURCE.count("\n"), len(SOURCE.rsplit("\n", 1)[1])
        items = await complete(client, line, col)
        s = await stats(client)
        assert s["engine"]["requests"] >= 1 and s["counters"]["engine_calls"] == 1
        assert not client.messages, [m.message for m in client.messages]
        for item in items:
            assert not any(t in item.insert_text for t in SPECIALS)
            assert item.range == lsp.Range(lsp.Position(line, col), lsp.Position(line, col))
        if not HAVE_WEIGHTS:
            pytest.skip("ling-nano weights absent (random tiny stand-in): pipeline checked, quality not")
        shown = [i.insert_text for i in items]
        if not (shown and shown[0].split("\n")[0].strip() == "self.y = y"):
            pytest.xfail(f"the embedded ling-nano answered {shown!r} after `self.x = x` (expected self.y = y): "
                         "pipeline checked, model quality not there yet")


def test_complete_command_uses_the_same_pipeline(tmp_path: Path):
    path = tmp_path / "m.py"
    path.write_text(SOURCE + "\n")
    env = server_env(None, engine=None)
    line = SOURCE.count("\n") + 1
    col = len(SOURCE.rsplit("\n", 1)[1]) + 1
    run = subprocess.run([sys.executable, "-m", "lingls.cli", "complete", f"{path}:{line}:{col}", "--device", "cpu",
                          "--max-tokens", "8"], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode in (0, 1), run.stderr
    assert not any(t in run.stdout for t in SPECIALS)
    bad = subprocess.run([sys.executable, "-m", "lingls.cli", "complete", f"{path}:0:1"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and "1-based" in bad.stderr


async def test_complete_command_answers_as_typing_with_the_gate(tmp_path: Path):
    """`--typing` answers as an automatic request: the confidence gate applies (at a bar no line of the model
    reaches, nothing is shown); without it, as an Invoked request, the same cursor gets its completion."""
    import argparse

    from lingls.lsp.oneshot import complete_file

    if not HAVE_WEIGHTS:
        pytest.skip("ling-nano weights absent (random tiny stand-in)")
    path = tmp_path / "c.py"
    path.write_text("import os\n\n\ndef read_file(path):\n    with open(path) as f:\n        return \n")
    asked = await complete_file(path, 6, 16, argparse.Namespace(max_tokens=16, device="cpu"))
    typing = await complete_file(path, 6, 16, argparse.Namespace(max_tokens=16, device="cpu", typing=True,
                                                                 min_line_probability=0.999))
    assert asked and typing is None
    default = await complete_file(path, 6, 16, argparse.Namespace(max_tokens=16, device="cpu", typing=True))
    assert default is None or asked.startswith(default)  # the gate ends a completion at a line, never changes it
