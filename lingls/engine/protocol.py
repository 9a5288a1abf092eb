"""The Engine protocol: what the language server asks of a model, wherever it runs.

The language server builds the prompt text (in the model's own FIM template, which it learns from
`Engine.fim`), then iterates `Engine.generate(request)`, an async stream of text chunks. Closing the
iterator early (`aclose()`, or cancelling the task that iterates it) must stop the engine's work for that
request within one decode step. Implementations: `engine.local.LocalEngine` (a model in this process, on a
worker thread) and `engine.remote.RemoteEngine` (HTTP `/v1/completions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, runtime_checkable


@dataclass(frozen=True)
class FimTemplate:
    """The special tokens of a model trained for fill-in-the-middle, as text."""

    prefix: str = "<|fim_prefix|>"
    suffix: str = "<|fim_suffix|>"
    middle: str = "<|fim_middle|>"
    file_sep: str | None = "<|file_sep|>"
    eos: tuple[str, ...] = ("<|endoftext|>",)
    order: str = "psm"  # psm: prefix, suffix, middle; spm: suffix, prefix, middle (the model's card says which)

    def special_tokens(self) -> tuple[str, ...]:
        """Every token that must never appear in a completion shown to a user."""
        own = (self.prefix, self.suffix, self.middle) + ((self.file_sep,) if self.file_sep else ())
        return own + self.eos


@dataclass(frozen=True)
class FimParts:
    """The pieces a prompt was built from, for servers that apply a FIM template themselves (llama.cpp's
    /infill): the text before and after the cursor, and context chunks (path, text) from other files."""

    prefix: str
    suffix: str
    context: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str  # rendered in the engine's `fim` template (or left to right when it has none)
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    parts: FimParts | None = None
    heal: bool = True  # token healing of the cursor's token (lingls.engine.healing), where the engine can
    # the confidence gate (engine.local.LineGate), where the engine can: each line of the completion only if the
    # model gave it at least this probability; the first line below it ends the completion. 0: off
    min_line_probability: float = 0.0


@dataclass
class EngineStats:
    """Counters the language server and benchmarks read; engines update them."""

    requests: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    extra: dict = field(default_factory=dict)


class EngineError(RuntimeError):
    """A failure the user should see once (model missing, server down); the message says what to do."""


@runtime_checkable
class Engine(Protocol):
    name: str
    fim: FimTemplate | None  # None: the model has no FIM tokens; prompt left-to-right
    stats: EngineStats

    def count_tokens(self, text: str) -> int:
        """Tokens `text` costs in a prompt (exact for local engines, an estimate for remote ones)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[str]:
        """Stream the completion's text. Raises EngineError when the engine cannot serve."""
        ...

    async def close(self) -> None: ...
