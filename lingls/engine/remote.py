"""RemoteEngine: completions from a server over HTTP (`lingls serve`, SGLang, vLLM, llama.cpp's server).

The editor runs on a laptop, the model on a GPU box. One aiohttp session per engine keeps connections alive
between keystrokes. A request streams server-sent events; when the language server stops a generation (the
user typed on, or the request was cancelled) the stream's connection is closed at once, which is how every
one of these servers learns to stop generating.

Failures never reach the editor as anything but an EngineError (the language server shows one message and
answers empty). Connection failures before any text arrives (refused, reset) are retried briefly with backoff;
a time-out is not: a server that took the request and stays silent would cost another read timeout per retry.
After that, or when the stream breaks or stalls past the read timeout, the server is marked down: the next
requests probe `/health` first (briefly) and fail fast while it does not answer, and a background probe keeps
checking, so completions resume by themselves as soon as the server is back.

Profiles say how to talk to each kind of server (`auto`, the default, tells them apart from GET /v1/models'
`owned_by`, and /props for llama.cpp):
- `lingls`: POST /v1/completions with the prompt rendered client-side in the server model's FIM template,
  exactly as the in-process engine renders it. The template comes from the /v1/models entry's `fim` object;
  a server that does not report one but serves the embedded ling-nano gets ling-nano's template (this
  package ships its tokenizer), any other model the OpenAI `suffix` field (the server applies its template;
  context chunks from other files are then left out). An entry with `completion_prompt: prefix` gets
  left-to-right prompts, and requests ask for token healing, both as in-process.
- `openai` (SGLang, vLLM, others): POST /v1/completions. FIM as configured (`fim`): a client-side template
  given as its tokens, `suffix` for servers that template FIM themselves (SGLang with --completion-template),
  or none: left-to-right prompts (the default; vLLM rejects `suffix`).
- `llama.cpp`: POST /infill with input_prefix / input_suffix / input_extra; the server applies its model's
  FIM template and file separators.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp

from lingls.engine.protocol import EngineError, EngineStats, FimTemplate, GenerateRequest

PROFILES = ("auto", "lingls", "openai", "llama.cpp")
SUFFIX = "suffix"  # fim mode: send the OpenAI `suffix` field and let the server apply its template
NO_FIM = "none"


@dataclass
class RemoteSettings:
    connect_timeout: float = 3.0  # seconds to open a connection
    read_timeout: float = 10.0  # seconds without a byte from the server (before the first token or mid-stream)
    retries: int = 2  # connection attempts after the first, before any text arrived
    backoff: float = 0.2  # first retry delay; doubles
    probe_wait: float = 0.5  # how long a request waits for a /health probe while the server is down
    probe_interval: float = 1.0  # background /health probe delay while down; doubles up to probe_max
    probe_max: float = 5.0


def parse_fim(value: str | None) -> FimTemplate | str | None:
    """The `fim` setting: None or "auto" (what the profile finds), "none", "suffix", or the template's tokens
    separated by commas: prefix,suffix,middle[,file_sep[,eos]]."""
    if value is None or value.strip() in ("", "auto"):
        return None
    value = value.strip()
    if value in (NO_FIM, SUFFIX):
        return value
    tokens = [t.strip() for t in value.split(",")]
    if len(tokens) < 3 or len(tokens) > 5 or not all(tokens):
        raise EngineError(f"fim setting {value!r}: expected auto, none, suffix or "
                          "PREFIX,SUFFIX,MIDDLE[,FILE_SEP[,EOS]] tokens (see the model's tokenizer_config.json)")
    file_sep = tokens[3] if len(tokens) > 3 else None
    eos = (tokens[4],) if len(tokens) > 4 else FimTemplate().eos
    return FimTemplate(tokens[0], tokens[1], tokens[2], file_sep, eos)


class RemoteEngine:
    """The Engine protocol over HTTP. Construct it off the event loop: it asks the server what it is."""

    @classmethod
    def from_env(cls, endpoint: str, api_key: str | None, model: str | None, env) -> "RemoteEngine":
        """An engine for `endpoint` with the options that editors cannot send yet, from `env`:
        LINGLS_API_KEY (when `api_key` is None), LINGLS_SERVER_PROFILE (one of PROFILES), LINGLS_FIM (see
        parse_fim), LINGLS_READ_TIMEOUT (seconds without a byte from the server before it counts as down)."""
        settings = RemoteSettings()
        if timeout := env.get("LINGLS_READ_TIMEOUT"):
            try:
                settings.read_timeout = float(timeout)
            except ValueError:
                raise EngineError(f"LINGLS_READ_TIMEOUT={timeout!r} is not a number of seconds") from None
        return cls(endpoint, api_key=api_key or env.get("LINGLS_API_KEY") or None, model=model,
                   profile=env.get("LINGLS_SERVER_PROFILE") or "auto", fim=parse_fim(env.get("LINGLS_FIM")),
                   settings=settings)

    def __init__(self, endpoint: str, api_key: str | None = None, profile: str = "auto", model: str | None = None,
                 fim: FimTemplate | str | None = None, settings: RemoteSettings | None = None):
        if profile not in PROFILES:
            raise EngineError(f"unknown server profile {profile!r} (one of {', '.join(PROFILES)})")
        if fim not in (None, NO_FIM, SUFFIX) and not isinstance(fim, FimTemplate):
            raise EngineError(f"fim must be a FimTemplate, {NO_FIM!r} or {SUFFIX!r}, not {fim!r}")
        self.base = endpoint.strip().rstrip("/")
        for tail in ("/v1/completions", "/v1", "/infill", "/completion"):
            if self.base.endswith(tail):
                self.base = self.base[: -len(tail)]
        if not self.base.startswith(("http://", "https://")):
            raise EngineError(f"endpoint {endpoint!r} is not an http:// or https:// URL")
        self.api_key, self.model, self.settings = api_key, model, settings or RemoteSettings()
        self.profile = profile
        self.name = f"remote {self.base}"
        self.stats = EngineStats()
        self.stats.extra.update(retries=0, outages=0, recoveries=0)
        self._fim_setting = fim
        self.fim: FimTemplate | None = fim if isinstance(fim, FimTemplate) else None
        self._send_suffix = fim == SUFFIX  # the server applies the FIM template (OpenAI `suffix`)
        self._tokenizer = None  # the model's tokenizer when this package has it: exact prompt budgets
        self._discovered = False
        self._down_reason: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._probe: asyncio.Task | None = None
        self._kick: asyncio.Event | None = None
        self._up: asyncio.Event | None = None
        if not self._discover():
            self._down_reason = f"cannot reach the completion server at {self.base}"
            self.stats.extra["outages"] += 1

    # ---- discovery (blocking: at construction on a worker thread, and after an outage) -------------------
    def _get_json(self, path: str) -> tuple[int | None, object]:
        """(HTTP status or None when unreachable, parsed JSON body or None)."""
        req = urllib.request.Request(self.base + path, headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=self.settings.connect_timeout) as r:
                status, body = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, body = e.code, b""
        except (urllib.error.URLError, OSError):
            return None, None
        try:
            return status, json.loads(body.decode("utf-8", "replace"))
        except ValueError:
            return status, None

    def _discover(self) -> bool:
        """Learn the server's kind, model name and FIM template. False when the server is unreachable."""
        status, models = self._get_json("/v1/models")
        if status is None:
            return False
        data = models.get("data") if isinstance(models, dict) else None
        entry = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        owner = entry.get("owned_by")
        if self.profile == "auto":
            if owner == "lingls" or isinstance(entry.get("fim"), dict):
                self.profile = "lingls"
            elif owner == "llamacpp" or (status == 404 and isinstance(self._get_json("/props")[1], dict)):
                self.profile = "llama.cpp"
            else:
                self.profile = "openai"
        if status in (401, 403):
            return True  # reachable; requests will say the key is wrong
        self.model = self.model or (entry.get("id") if isinstance(entry.get("id"), str) else None)
        self._tokenizer = _known_tokenizer(self.model)
        if self.profile == "lingls" and self._fim_setting is None:
            self.fim = _fim_from(entry.get("fim")) or (self._tokenizer.fim if self._tokenizer else None)
            self._send_suffix = self.fim is None
            if entry.get("completion_prompt") == "prefix":  # as LocalEngine: the model's card asks for it
                self.fim, self._send_suffix = None, False
        self._discovered = True
        return True

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def count_tokens(self, text: str) -> int:
        """Exact with the model's tokenizer when this package has it (ling-nano); else an estimate: code
        averages ~3.5 UTF-8 bytes per token."""
        if self._tokenizer is not None:
            return len(self._tokenizer.encode(text))
        return max(1, (len(text.encode("utf-8", "surrogatepass")) * 2 + 6) // 7) if text else 0

    # ---- generation --------------------------------------------------------------------------------------
    def _body(self, request: GenerateRequest) -> tuple[str, dict]:
        common = {"temperature": request.temperature, "top_p": request.top_p, "stream": True}
        if request.seed is not None:
            common["seed"] = request.seed
        if request.stop:
            common["stop"] = list(request.stop)
        parts = request.parts
        if self.profile == "llama.cpp":
            if parts is None:
                return "/completion", {**common, "prompt": request.prompt, "n_predict": request.max_tokens,
                                       "cache_prompt": True}
            extra = [{"filename": path, "text": text} for path, text in parts.context]
            return "/infill", {**common, "input_prefix": parts.prefix, "input_suffix": parts.suffix,
                               "input_extra": extra, "n_predict": request.max_tokens, "cache_prompt": True}
        body = {**common, "prompt": request.prompt, "max_tokens": request.max_tokens,
                "stream_options": {"include_usage": True}}
        if self._send_suffix and parts is not None:
            body["prompt"], body["suffix"] = parts.prefix, parts.suffix
        if self.profile == "lingls" and request.heal:
            body["token_healing"] = True  # lingls serve heals as the in-process engine does
        if self.profile == "lingls" and request.min_line_probability > 0:
            body["min_line_probability"] = request.min_line_probability  # and gates (on a CPU)
        if self.model:
            body["model"] = self.model
        return "/v1/completions", body

    async def generate(self, request: GenerateRequest) -> AsyncIterator[str]:
        await self._ensure_up()
        self.stats.requests += 1
        path, body = self._body(request)
        resp = await self._post(path, body)
        complete = False
        try:
            async for text in self._texts(resp):
                yield text
            complete = True
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise self._went_down(f"the completion server at {self.base} broke off the stream ({_why(e)})") from None
        except ValueError as e:  # aiohttp's reader refuses a line too long to be an event
            raise EngineError(f"the completion server at {self.base} sent a malformed stream ({e})") from None
        except (asyncio.CancelledError, GeneratorExit):
            self.stats.cancelled += 1
            raise
        finally:
            if complete:
                resp.release()  # the whole body was read: the connection goes back to the pool
            else:
                resp.close()  # stopped early: dropping the connection is how the server learns to stop

    async def _post(self, path: str, body: dict) -> aiohttp.ClientResponse:
        session = self._get_session()
        delay, last = self.settings.backoff, ""
        for attempt in range(self.settings.retries + 1):
            if attempt:
                self.stats.extra["retries"] += 1
                await asyncio.sleep(delay)
                delay *= 2
            try:
                resp = await session.post(self.base + path, json=body, headers=self._headers())
            except asyncio.TimeoutError as e:  # first: aiohttp's time-outs are ClientConnectionErrors too
                # not retried: a server that took the request and stays silent would cost another read timeout
                raise self._went_down(f"the completion server at {self.base} did not answer in time "
                                      f"({_why(e)})") from None
            except aiohttp.ClientConnectionError as e:  # refused, reset, or a kept-alive connection gone stale
                last = _why(e)
                continue
            if resp.status == 200:
                return resp
            try:
                detail = _error_detail(await resp.text())
            except (aiohttp.ClientError, asyncio.TimeoutError):
                detail = ""
            finally:
                resp.release()
            raise self._refused(resp.status, detail)
        raise self._went_down(f"cannot reach the completion server at {self.base} ({last})")

    def _refused(self, status: int, detail: str) -> EngineError:
        said = f"HTTP {status}" + (f": {detail}" if detail else "")
        if status in (401, 403):
            return EngineError(f"the completion server at {self.base} refused the API key ({said}); "
                               "set apiKey (or LINGLS_API_KEY)")
        if status in (502, 503, 504):  # loading, overloaded, or a proxy without its backend: wait for /health
            return self._went_down(f"the completion server at {self.base} is unavailable ({said})")
        if status >= 500:
            return EngineError(f"the completion server at {self.base} failed ({said})")
        return EngineError(f"the completion server at {self.base} rejected the request ({said})")

    async def _texts(self, resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
        """The text pieces of a streamed (server-sent events) or plain JSON completion. The body is read to
        its end, so the connection can be reused; a stream that ends before its last event is an error."""
        if resp.content_type == "application/json":  # a server that ignored `stream`
            text, _ = self._event(await resp.json())
            if text:
                yield text
            return
        done = False
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if done or not line.startswith("data:"):
                continue  # blank lines, comments, `event:` lines, and whatever follows the last event
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            try:
                event = json.loads(data)
            except ValueError:
                raise EngineError(f"the completion server at {self.base} sent a malformed event: "
                                  f"{data[:80]!r}") from None
            text, done = self._event(event)
            if text:
                self.stats.generated_tokens += 1
                yield text
        if not done:
            raise aiohttp.ClientPayloadError("the stream ended before its last event")

    def _event(self, event) -> tuple[str, bool]:
        """(text, last) of one event of an OpenAI-style or llama.cpp completion."""
        if isinstance(event, dict) and "error" in event:
            raise EngineError(f"the completion server at {self.base} reported an error: {_error_detail(event)}")
        try:
            if self.profile == "llama.cpp":
                text, last = event["content"], bool(event.get("stop"))
            else:
                if isinstance(event.get("usage"), dict):
                    self._count_usage(event["usage"])
                if not event["choices"]:  # the usage-only event that ends some streams
                    return "", True
                choice = event["choices"][0]
                text, last = choice.get("text") or "", bool(choice.get("finish_reason"))
        except (KeyError, IndexError, TypeError, AttributeError):
            raise EngineError(f"the completion server at {self.base} sent an event of unknown shape: "
                              f"{json.dumps(event)[:80]}") from None
        if not isinstance(text, str):
            raise EngineError(f"the completion server at {self.base} sent non-text content: {text!r:.80}")
        return text, last

    def _count_usage(self, usage: dict) -> None:
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int):
            self.stats.prompt_tokens += prompt

    # ---- health ------------------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._down_reason is None

    def _went_down(self, reason: str) -> EngineError:
        if self._down_reason is None:
            self.stats.extra["outages"] += 1
        self._down_reason = reason
        self._watch()
        return EngineError(f"{reason}; completions are off until it answers again (lingls keeps checking)")

    def _watch(self) -> None:
        """Make sure the background probe runs (it ends when the server is back)."""
        if self._kick is None:
            self._kick, self._up = asyncio.Event(), asyncio.Event()
        self._up.clear()
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_until_up())

    async def _ensure_up(self) -> None:
        """While the server is down: probe it now and wait briefly; raise EngineError if it is still down."""
        if self._down_reason is None:
            return
        self._watch()
        self._kick.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._up.wait()), self.settings.probe_wait)
        except asyncio.TimeoutError:
            raise EngineError(f"{self._down_reason}; completions are off until it answers again "
                              "(lingls keeps checking)") from None

    async def _probe_until_up(self) -> None:
        delay = self.settings.probe_interval
        while self._down_reason is not None:
            if await self._answers():
                if not self._discovered:
                    await asyncio.to_thread(self._discover)
                self._down_reason = None
                self.stats.extra["recoveries"] += 1
                self._up.set()
                return
            self._kick.clear()
            try:
                await asyncio.wait_for(self._kick.wait(), delay)
            except asyncio.TimeoutError:
                delay = min(delay * 2, self.settings.probe_max)

    async def _answers(self) -> bool:
        """GET /health is 200 (servers without /health: /v1/models is 200)."""
        timeout = aiohttp.ClientTimeout(total=max(self.settings.connect_timeout, 1.0))
        try:
            for path in ("/health", "/v1/models"):
                async with self._get_session().get(self.base + path, headers=self._headers(), timeout=timeout) as r:
                    if r.status != 404:
                        return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        return False

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=None, connect=self.settings.connect_timeout,
                                            sock_read=self.settings.read_timeout)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(
                limit=8, keepalive_timeout=60))
        return self._session

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        if self._session is not None:
            await self._session.close()


def _fim_from(info) -> FimTemplate | None:
    """A FimTemplate from a /v1/models entry's `fim` object, if it is a complete one."""
    if not isinstance(info, dict) or not all(isinstance(info.get(k), str) and info[k]
                                             for k in ("prefix", "suffix", "middle")):
        return None
    eos = info.get("eos")
    eos = tuple(e for e in eos if isinstance(e, str)) if isinstance(eos, list) else FimTemplate().eos
    file_sep = info.get("file_sep") if isinstance(info.get("file_sep"), str) else None
    return FimTemplate(info["prefix"], info["suffix"], info["middle"], file_sep, eos)


def _known_tokenizer(model_id: str | None):
    """The tokenizer of a model this package ships (the embedded ling-nano), by the id a server reports."""
    from lingls.engine.local import EMBEDDED

    if model_id != EMBEDDED.name or not (EMBEDDED / "tokenizer.json").is_file():
        return None
    from lingls.engine.tokenizer import Tokenizer

    return Tokenizer(EMBEDDED)


def _error_detail(body) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body's start."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return body.strip()[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"][:200]
    if isinstance(error, str):
        return error[:200]
    return json.dumps(body)[:200]


def _why(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):  # aiohttp's say which: "Connection timeout to host ..." or a read
        return str(e) or "no data within the read timeout"
    return str(e) or type(e).__name__

