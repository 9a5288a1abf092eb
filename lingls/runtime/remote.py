"""RemoteEngine: completions from a server over HTTP (`lingls serve`, SGLang, vLLM, llama.cpp's server).

The editor runs on a laptop, the model on a GPU box. One aiohttp session per engine keeps connections alive
between keystrokes. A request streams server-sent events; when the language server cancels it, the stream is
closed at once (the server sees the disconnect and stops generating). Connection failures before any text
arrives are retried with backoff within the request's time; after that the server is marked down: requests
fail fast with an EngineError (the editor shows one message, completions are empty) while a background
probe of `/health` waits for the server to come back, and then completions resume by themselves.

Profiles say how to talk to each kind of server:
- `lingls`: POST /v1/completions with the prompt rendered in the server model's FIM template, which the
  server reports in GET /v1/models (`fim`).
- `openai` (SGLang, vLLM and other OpenAI-compatible servers): POST /v1/completions; FIM tokens only if the
  user configures them (`fim` setting), else left-to-right prompts.
- `llama.cpp`: POST /infill with input_prefix / input_suffix / input_extra; the server applies its model's
  FIM template.
`auto` (the default) asks the server: `lingls serve` answers /v1/models with `fim`, llama.cpp answers /props.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp

from lingls.runtime.engine import EngineError, EngineStats, FimTemplate, GenerateRequest

PROFILES = ("auto", "lingls", "openai", "llama.cpp")


@dataclass
class RemoteSettings:
    connect_timeout: float = 3.0  # seconds to open a connection
    read_timeout: float = 15.0  # seconds without a byte from the server mid-request
    retries: int = 2  # connection attempts after the first, before any text arrived
    backoff: float = 0.2  # first retry delay; doubles
    probe_interval: float = 1.0  # first /health probe delay while the server is down; doubles up to 10 s


class RemoteEngine:
    def __init__(self, endpoint: str, api_key: str | None = None, profile: str = "auto", model: str | None = None,
                 fim: FimTemplate | None = None, settings: RemoteSettings | None = None):
        if profile not in PROFILES:
            raise EngineError(f"unknown server profile {profile!r} (one of {', '.join(PROFILES)})")
        self.base = endpoint.rstrip("/")
        for suffix in ("/v1/completions", "/v1", "/infill"):
            if self.base.endswith(suffix):
                self.base = self.base[: -len(suffix)]
        if not self.base.startswith(("http://", "https://")):
            raise EngineError(f"endpoint {endpoint!r} is not an http:// or https:// URL")
        self.api_key, self.model, self.settings = api_key, model, settings or RemoteSettings()
        self.stats = EngineStats()
        self.fim = fim
        self.profile = profile
        self.name = f"remote {self.base}"
        self._session: aiohttp.ClientSession | None = None
        self._down_reason: str | None = None
        self._probe: asyncio.Task | None = None
        if profile in ("auto", "lingls"):
            self._discover()

    # ---- discovery (blocking; the language server builds engines on a worker thread) ----------------------
    def _get_json(self, path: str) -> dict | None:
        req = urllib.request.Request(self.base + path, headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=self.settings.connect_timeout) as r:
                return json.loads(r.read().decode())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def _discover(self) -> None:
        """Learn the server's kind, model name and FIM template; a server that is down now is probed later."""
        models = self._get_json("/v1/models")
        if models is not None:
            entry = (models.get("data") or [{}])[0] if isinstance(models, dict) else {}
            self.model = self.model or entry.get("id")
            if isinstance(entry.get("fim"), dict):
                self.profile = "lingls"
                if self.fim is None:
                    f = entry["fim"]
                    self.fim = FimTemplate(f["prefix"], f["suffix"], f["middle"], f.get("file_sep"),
                                           tuple(f.get("eos") or ()))
            elif self.profile == "auto":
                self.profile = "openai"
            return
        if self.profile == "auto" and self._get_json("/props") is not None:
            self.profile = "llama.cpp"
            return
        self._down_reason = f"the server at {self.base} is not answering"

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def count_tokens(self, text: str) -> int:
        """An estimate (the tokenizer lives on the server): code averages ~3.5 UTF-8 bytes per token."""
        return max(1, (len(text.encode("utf-8", "surrogatepass")) * 2 + 6) // 7) if text else 0

    # ---- generation --------------------------------------------------------------------------------------
    def _body(self, request: GenerateRequest) -> tuple[str, dict]:
        common = {"temperature": request.temperature, "top_p": request.top_p, "stream": True}
        if request.seed is not None:
            common["seed"] = request.seed
        if request.stop:
            common["stop"] = list(request.stop)
        if self.profile == "llama.cpp" and request.parts is not None:
            p = request.parts
            return "/infill", {**common, "input_prefix": p.prefix, "input_suffix": p.suffix, "n_predict": request.max_tokens,
                               "input_extra": [{"filename": path, "text": text} for path, text in p.context],
                               "cache_prompt": True}
        if self.profile == "llama.cpp":
            return "/completion", {**common, "prompt": request.prompt, "n_predict": request.max_tokens, "cache_prompt": True}
        body = {**common, "prompt": request.prompt, "max_tokens": request.max_tokens}
        if self.model:
            body["model"] = self.model
        return "/v1/completions", body

    async def generate(self, request: GenerateRequest) -> AsyncIterator[str]:
        if self._down_reason is not None:
            self._watch()
            raise EngineError(f"{self._down_reason}; retrying in the background")
        self.stats.requests += 1
        path, body = self._body(request)
        resp = await self._post(path, body)
        finished = False
        try:
            async for text, done in self._events(resp):
                if text:
                    self.stats.generated_tokens += 1
                    yield text
                if done:
                    break
            finished = True
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise self._went_down(f"the server at {self.base} dropped the stream ({_why(e)})") from None
        except (asyncio.CancelledError, GeneratorExit):
            self.stats.cancelled += 1
            raise
        finally:
            if finished:
                resp.release()
            else:  # cancelled or failed mid-stream: drop the connection so the server stops generating
                resp.close()

    async def _post(self, path: str, body: dict) -> aiohttp.ClientResponse:
        session = self._get_session()
        delay, last = self.settings.backoff, ""
        for attempt in range(self.settings.retries + 1):
            try:
                resp = await session.post(self.base + path, json=body, headers=self._headers())
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                last = _why(e)
                if attempt < self.settings.retries:
                    await asyncio.sleep(delay)
                    delay *= 2
                continue
            if resp.status == 200:
                return resp
            detail = (await resp.text())[:200].strip()
            resp.release()
            if resp.status in (401, 403):
                raise EngineError(f"the server at {self.base} refused the API key (HTTP {resp.status})")
            if resp.status >= 500:
                raise self._went_down(f"the server at {self.base} failed (HTTP {resp.status}: {detail})")
            raise EngineError(f"the server at {self.base} rejected the request (HTTP {resp.status}: {detail})")
        raise self._went_down(f"cannot reach the server at {self.base} ({last})")

    async def _events(self, resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, bool]]:
        """(text, done) for each server-sent event of an OpenAI-style or llama.cpp stream."""
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line or line.startswith(":") or not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                yield "", True
                return
            try:
                event = json.loads(data)
                if "choices" in event:
                    choice = event["choices"][0]
                    yield choice.get("text") or "", bool(choice.get("finish_reason"))
                else:
                    yield event.get("content") or "", bool(event.get("stop"))
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                raise EngineError(f"the server at {self.base} sent a malformed event: {data[:80]!r}") from None

    # ---- health ------------------------------------------------------------------------------------------
    def _went_down(self, reason: str) -> EngineError:
        self._down_reason = reason
        self._watch()
        return EngineError(reason)

    def _watch(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_until_healthy())

    async def _probe_until_healthy(self) -> None:
        delay = self.settings.probe_interval
        while self._down_reason is not None:
            await asyncio.sleep(delay)
            try:
                async with self._get_session().get(self.base + "/health", headers=self._headers()) as r:
                    if r.status == 200:
                        if self.profile in ("auto", "lingls") and self.fim is None:
                            await asyncio.to_thread(self._discover)
                        self._down_reason = None
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            delay = min(delay * 2, 10.0)

    @property
    def healthy(self) -> bool:
        return self._down_reason is None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=None, connect=self.settings.connect_timeout,
                                            sock_read=self.settings.read_timeout)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=8,
                                                  keepalive_timeout=60))
        return self._session

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        if self._session is not None:
            await self._session.close()


def _why(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__


def wait_until_up(endpoint: str, timeout: float = 60.0) -> bool:
    """Block until GET /health answers 200 (for scripts and tests that start a server)."""
    deadline = time.monotonic() + timeout
    url = endpoint.rstrip("/") + "/health"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    return False
