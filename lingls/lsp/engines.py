"""Which Engine serves completions, created once, lazily and off the event loop.

`endpoint` set: `engine.remote.RemoteEngine` (`model` then names the server's model; its other options come
from LINGLS_* variables, see `RemoteEngine.from_env`); otherwise `engine.local.LocalEngine` (the embedded ling-nano
unless `model` names a directory). Loading a model takes seconds, so it runs on a worker thread while the
server keeps answering; a failure is reported once and not retried on every keystroke, only after the
settings change.

Tests and benchmarks only: `LINGLS_TEST_ENGINE=module:factory` makes the server call `factory(settings)`
instead, so the end-to-end tests can run a scripted engine inside the real stdio server process (and
`lingls bench lsp --engine instant` one that answers at once).
"""

from __future__ import annotations

import asyncio
import importlib
import os

from lingls.engine.protocol import Engine, EngineError
from lingls.lsp.settings import Settings

TEST_ENGINE_ENV = "LINGLS_TEST_ENGINE"


def make_engine(settings: Settings) -> Engine:
    """Build the engine the settings ask for (blocking: may load a model)."""
    if spec := os.environ.get(TEST_ENGINE_ENV):
        module, _, attr = spec.partition(":")
        return getattr(importlib.import_module(module), attr or "make_engine")(settings)
    if settings.endpoint:
        from lingls.engine.remote import RemoteEngine

        return RemoteEngine.from_env(settings.endpoint, settings.api_key, settings.model, os.environ)
    from lingls.engine.local import LocalEngine

    engine = LocalEngine(model_dir=settings.model, device=settings.device)
    engine.load()  # weights now, on this worker thread, rather than in the first completion
    return engine


def describe_failure(exc: BaseException, settings: Settings) -> str:
    """The one message a user sees when no engine could start."""
    if isinstance(exc, EngineError):
        return f"lingls: {exc}"
    if isinstance(exc, ImportError):
        return f"lingls: the {'remote' if settings.endpoint else 'in-process'} engine is unavailable ({exc})"
    where = settings.endpoint or settings.model or "the embedded model"
    return f"lingls: could not start the engine for {where}: {type(exc).__name__}: {exc}"


class EngineHolder:
    """The engine for the current settings, loaded once on a worker thread.

    A failed load stays failed (awaiting it raises the same error at once) until the engine settings change,
    so a missing model costs one message, not one attempt per keystroke."""

    def __init__(self, factory=make_engine):
        self._factory = factory
        self._task: asyncio.Future | None = None
        self._key: tuple | None = None

    def start(self, settings: Settings) -> asyncio.Future:
        """Begin loading unless the engine for these settings is loaded or loading."""
        if self._task is None or self._key != settings.engine_key():
            self._retire()
            self._key = settings.engine_key()
            self._task = asyncio.ensure_future(asyncio.to_thread(self._factory, settings))
        return self._task

    async def get(self, settings: Settings) -> Engine:
        """The engine (raises what loading raised); a cancelled caller does not cancel the loading."""
        return await asyncio.shield(self.start(settings))

    @property
    def loaded(self) -> Engine | None:
        t = self._task
        return t.result() if t is not None and t.done() and not t.cancelled() and t.exception() is None else None

    def _retire(self) -> None:
        old, self._task = self._task, None
        if old is not None:
            old.add_done_callback(_close_loaded)

    async def close(self) -> None:
        engine = self.loaded
        self._task = None
        if engine is not None:
            await engine.close()


def _close_loaded(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        asyncio.ensure_future(task.result().close())
