"""Server settings an editor can send (initializationOptions, workspace/didChangeConfiguration).

Settings arrive either flat (`{"maxTokens": 32}`) or under a `lingls` section (`{"lingls": {...}}`, the
shape VS Code and Neovim's `settings` use). A value of the wrong type is ignored with a warning: an editor's
typo never stops completions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

# camelCase key sent by editors -> (field name, accepted types, check)
_KEYS = {
    "enable": ("enable", (bool,)),
    "languages": ("languages", (list,)),
    "endpoint": ("endpoint", (str, type(None))),
    "apiKey": ("api_key", (str, type(None))),
    "model": ("model", (str, type(None))),
    "device": ("device", (str, type(None))),
    "maxTokens": ("max_tokens", (int,)),
    "maxLines": ("max_lines", (int,)),
    "debounceMs": ("debounce_ms", (int, float)),
    "promptTokens": ("prompt_tokens", (int,)),
    "contextChunks": ("context_chunks", (int,)),
    "minLineProbability": ("min_line_probability", (int, float)),
}

# Settings that decide which engine runs; changing one restarts the engine.
ENGINE_FIELDS = ("endpoint", "api_key", "model", "device")


@dataclass(frozen=True)
class Settings:
    enable: bool = True
    languages: tuple[str, ...] = ("*",)
    endpoint: str | None = None
    api_key: str | None = None
    model: str | None = None
    device: str | None = None
    max_tokens: int = 64
    max_lines: int = 12
    debounce_ms: float = 0
    prompt_tokens: int = 1536
    context_chunks: int = 16
    # automatic suggestions: a line only if the model gave it at least this probability (engines that report
    # token probabilities: the in-process engine on a CPU, lingls serve on a CPU); 0 shows every line
    min_line_probability: float = 0.02

    def language_enabled(self, language_id: str) -> bool:
        return self.enable and ("*" in self.languages or language_id in self.languages)

    def engine_key(self) -> tuple:
        return tuple(getattr(self, name) for name in ENGINE_FIELDS)

    def merged(self, raw: Any) -> tuple["Settings", list[str]]:
        """These settings updated from an editor's object; also the warnings for values that were ignored."""
        if not isinstance(raw, dict):
            return self, ([] if raw is None else [f"settings must be an object, got {type(raw).__name__}"])
        if isinstance(raw.get("lingls"), dict):
            raw = raw["lingls"]
        changes: dict[str, Any] = {}
        warnings = []
        for key, value in raw.items():
            if key not in _KEYS:
                warnings.append(f"unknown setting {key!r} ignored")
                continue
            name, types = _KEYS[key]
            ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
            if ok and name == "languages":
                ok = all(isinstance(v, str) for v in value)
                value = tuple(value)
            if ok and isinstance(value, (int, float)) and not isinstance(value, bool):
                ok = value >= (1 if name in ("max_tokens", "max_lines", "prompt_tokens") else 0)
                ok = ok and (name != "min_line_probability" or value < 1)
            if not ok:
                warnings.append(f"setting {key!r}: invalid value {value!r} ignored")
                continue
            changes[name] = value
        return replace(self, **changes), warnings


# Environment variables read at start (after the defaults, before the command line and the editor's settings).
ENV = {"LINGLS_ENDPOINT": "endpoint", "LINGLS_MODEL": "model", "LINGLS_DEVICE": "device"}


def from_cli(args: Any, environ: Mapping[str, str] = os.environ) -> Settings:
    """Defaults, overridden by LINGLS_ENDPOINT / LINGLS_MODEL / LINGLS_DEVICE, overridden by the command line
    (`--endpoint`, `--model`, `--device`, `--max-tokens`); the editor's settings come on top of these."""
    from_env = {name: environ[var] for var, name in ENV.items() if environ.get(var)}
    names = {f.name for f in fields(Settings)}
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    return replace(Settings(), **{**from_env, **given})
