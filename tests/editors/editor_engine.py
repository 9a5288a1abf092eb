"""A deterministic Engine for the editor tests, loaded by the real `lingls --stdio` through the server's test hook
(`LINGLS_TEST_ENGINE=tests.editors.editor_engine:make_engine`, with the repository on PYTHONPATH:
`scripted_env()` sets both).

It writes a fixed Python completion, chunk by chunk, so tests can compare what an editor shows with what it
inserts. Environment knobs:
- LINGLS_SCRIPT_DELAY: seconds to wait before each chunk (a slow model, to cancel a request mid-way);
- LINGLS_SCRIPT_LOG: a file that gets one line per generation: `start`, then `done` or `stopped`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import AsyncIterator

from lingls.engine.protocol import EngineStats, GenerateRequest

# What the "model" writes; an Invoked request's extra samples (seeds 1 and 2) get the other texts.
TEXT = "total = combine(alpha, beta)\n    return total\n"
SAMPLES = {1: "values = sorted(alpha)\n    return values\n", 2: "return alpha + beta\n"}


def _chunks(text: str) -> list[str]:
    """Split like a tokenizer would: words, punctuation and whitespace apart."""
    out: list[str] = []
    for ch in text:
        if out and (ch.isalnum() or ch == "_") and (out[-1][-1].isalnum() or out[-1][-1] == "_"):
            out[-1] += ch
        else:
            out.append(ch)
    return out


class ScriptedEngine:
    name = "scripted"
    fim = None  # left-to-right prompts: the script ignores the prompt anyway

    def __init__(self) -> None:
        self.stats = EngineStats()
        self._delay = float(os.environ.get("LINGLS_SCRIPT_DELAY", "0"))
        self._log = os.environ.get("LINGLS_SCRIPT_LOG")

    def _note(self, event: str) -> None:
        if self._log:
            with open(self._log, "a") as f:
                f.write(event + "\n")

    def count_tokens(self, text: str) -> int:
        return max(1, len(text) // 4)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[str]:
        self.stats.requests += 1
        self._note("start")
        finished = False
        try:
            for chunk in _chunks(SAMPLES.get(request.seed, TEXT)):
                await asyncio.sleep(self._delay)
                self.stats.generated_tokens += 1
                yield chunk
            finished = True
        finally:
            if not finished:
                self.stats.cancelled += 1
            self._note("done" if finished else "stopped")

    async def close(self) -> None:
        return None


def make_engine(settings) -> ScriptedEngine:
    return ScriptedEngine()


def scripted_env(**extra: str) -> dict[str, str]:
    """Environment that makes a `lingls --stdio` started with it run this engine instead of a model."""
    repo = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    return {"LINGLS_TEST_ENGINE": f"{__name__}:make_engine", "PYTHONPATH": path, **extra}
