"""A scripted Engine for the LSP tests, loaded by the real stdio server through LINGLS_TEST_ENGINE (test-only).

The script (JSON in LINGLS_SCRIPT) says what to stream: `rules` is a list of [end of prefix, completion]
pairs (the first whose key ends the prompt's prefix part wins), else `default`; `chunk` characters per
chunk, `delay` seconds before each; `seeds` maps a request's seed to another answer (sampled candidates);
`fail_first` N: the first N generations raise; `fail_load`: loading raises; `load_delay`: seconds loading
takes; `fim`: false for a model without FIM tokens; `tokenizer`: a model directory whose real tokenizer
counts tokens (else a cheap estimate). An empty prompt raises, as the in-process engine's does. Its stats
say how often it was called, how many streams were closed early and how many are still running, so tests
can count model calls over the wire, and the last prompts and confidence gates (min_line_probability) it
was asked for.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from lingls.engine.protocol import EngineError, EngineStats, FimTemplate, GenerateRequest


class ScriptedEngine:
    name = "scripted"

    def __init__(self, script: dict):
        self.rules = script.get("rules", [])
        self.default = script.get("default", "")
        self.chunk = script.get("chunk", 4)
        self.delay = script.get("delay", 0.0)
        self.fail_first = script.get("fail_first", 0)
        self.seeds = script.get("seeds", {})
        self.fim = FimTemplate() if script.get("fim", True) else None
        self.stats = EngineStats(extra={"active": 0, "prompts": []})
        self.tokenizer = None
        if script.get("tokenizer"):
            from lingls.engine.tokenizer import Tokenizer

            self.tokenizer = Tokenizer(script["tokenizer"])

    def count_tokens(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text))
        return len(text) // 4 + 1

    def _answer(self, prompt: str) -> str:
        head = prompt.split(self.fim.suffix)[0] if self.fim else prompt
        for key, text in self.rules:
            if head.endswith(key):
                return text
        return self.default

    async def generate(self, request: GenerateRequest):
        self.stats.requests += 1
        self.stats.extra["prompts"] = (self.stats.extra["prompts"] + [request.prompt])[-5:]
        self.stats.extra["gates"] = (self.stats.extra.get("gates", []) + [request.min_line_probability])[-5:]
        if self.stats.requests <= self.fail_first:
            raise EngineError(f"scripted failure {self.stats.requests}")
        if not request.prompt:
            raise EngineError("empty prompt: nothing to complete")
        text = self.seeds.get(str(request.seed)) or self._answer(request.prompt)
        self.stats.extra["active"] += 1
        try:
            for i in range(0, len(text), self.chunk):
                await asyncio.sleep(self.delay)
                self.stats.generated_tokens += 1
                yield text[i : i + self.chunk]
        except (GeneratorExit, asyncio.CancelledError):
            self.stats.cancelled += 1
            raise
        finally:
            self.stats.extra["active"] -= 1

    async def close(self) -> None:
        pass


def make_engine(settings) -> ScriptedEngine:
    script = json.loads(os.environ.get("LINGLS_SCRIPT", "{}"))
    time.sleep(script.get("load_delay", 0))  # on the server's loading thread, as a model's weights take time
    if script.get("fail_load"):
        raise EngineError(script["fail_load"])
    return ScriptedEngine(script)
