"""`lingls serve`: an OpenAI-compatible HTTP API over one resident model, one request at a time.

Endpoints: POST /v1/completions (prompt, suffix, max_tokens, temperature, top_p, stop, seed, stream, and the
extensions token_healing: true, see lingls.engine.healing, and min_line_probability, the confidence gate of
lingls.engine.local.LineGate, which a server on a CPU applies),
GET /v1/models, GET /health, GET /metrics (Prometheus text).

Batch-1 policy: the model serves one request at a time, and a new completion request preempts the one
running: the older request stops within one decode step and ends with finish_reason "preempted" (an editor
only wants the completion for where the cursor is now). A client that disconnects, or a request whose
handler is cancelled, stops its generation within one decode step too. With --api-key every endpoint but
/health needs `Authorization: Bearer KEY`. The server binds 127.0.0.1 unless told otherwise.

A completion request is validated whole before any response starts, so every client error is a 4xx with an
OpenAI-style error body ({"error": {"message", "type", "param", "code"}}), in streaming mode too; a 503 means
the server itself failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from lingls.engine.protocol import EngineError, GenerateRequest

log = logging.getLogger("lingls.serve")

_TIME_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class Histogram:
    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self.counts = [0] * len(_TIME_BUCKETS)
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(_TIME_BUCKETS):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        lines += [f'{self.name}_bucket{{le="{b}"}} {c}' for b, c in zip(_TIME_BUCKETS, self.counts)]
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum:.6f}",
                  f"{self.name}_count {self.count}"]
        return lines


class Server:
    def __init__(self, engine, model_name: str, api_key: str | None = None):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.ttft = Histogram("lingls_ttft_seconds", "Time from request to first token.")
        self.tpot = Histogram("lingls_tpot_seconds", "Mean time per output token after the first, per request.")
        self.load_error: str | None = None
        self.loaded = False
        self._settled = asyncio.Event()  # set when loading has ended, well or not

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_json_errors, self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key and request.path != "/health":
            given = request.headers.get("Authorization", "")  # undecodable bytes arrive as surrogates
            if not given.isascii() or not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return _error(401, "missing or wrong API key (send Authorization: Bearer KEY)", "authentication_error",
                              code="invalid_api_key")
        return await handler(request)

    async def load(self) -> None:
        """Load the model in the background, logging progress, so /health answers meanwhile. A failure is
        logged as one line and kept in `load_error` (`lingls serve` then exits with status 1)."""
        t0 = time.perf_counter()
        task = asyncio.ensure_future(self.engine.start())
        last = None
        while not task.done():
            progress = self.engine.load_progress
            if progress != last:
                log.info("loading: %s (%.0f s)", progress, time.perf_counter() - t0)
                last = progress
            await asyncio.wait([task], timeout=2.0)
        try:
            task.result()
        except EngineError as e:
            self.load_error = str(e)
        except Exception as e:  # anything else the engine let through: still one line, as the LSP reports it
            self.load_error = f"could not start the engine for {self.model_name}: {type(e).__name__}: {e}"
        self._settled.set()
        if self.load_error is not None:
            log.error("%s", self.load_error)
            return
        self.loaded = True
        log.info("model %s %s", self.model_name, self.engine.load_progress)

    # ---- endpoints ---------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.load_error:
            return web.json_response({"status": "error", "error": self.load_error}, status=500)
        if not self.loaded:
            return web.json_response({"status": "loading", "progress": self.engine.load_progress}, status=503)
        return web.json_response({"status": "ok", "model": self.model_name})

    async def models(self, request: web.Request) -> web.Response:
        """The model, with its FIM template and how its card says to prompt it (`completion_prompt`: psm, or
        prefix for left to right), so a remote client renders prompts exactly as in-process."""
        entry = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "lingls",
                 "completion_prompt": self.engine.tokenizer.completion_prompt}
        fim = self.engine.tokenizer.fim
        if fim is not None:
            entry["fim"] = {"prefix": fim.prefix, "suffix": fim.suffix, "middle": fim.middle,
                            "file_sep": fim.file_sep, "eos": list(fim.eos)}
        return web.json_response({"object": "list", "data": [entry]})

    async def metrics(self, request: web.Request) -> web.Response:
        s = self.engine.stats
        runner = self.engine.runner
        cache = runner.cache.stats if runner is not None else None
        counters = [
            ("lingls_requests_total", "Completion requests received.", s.requests),
            ("lingls_cancelled_total", "Generations stopped early (disconnect, cancel or preemption).", s.cancelled),
            ("lingls_preempted_total", "Generations stopped because a newer request came.", s.extra["preempted"]),
            ("lingls_prompt_tokens_total", "Prompt tokens received.", s.prompt_tokens),
            ("lingls_generated_tokens_total", "Tokens generated.", s.generated_tokens),
            ("lingls_prefix_reuse_hits_total", "Prompts that reused a cached prefix.", cache.hits if cache else 0),
            ("lingls_prefix_tokens_saved_total", "Prompt tokens not prefilled thanks to prefix reuse.",
             cache.tokens_saved if cache else 0),
        ]
        spec = getattr(runner, "spec", None)
        if spec is not None:
            st = spec.stats
            counters += [
                ("lingls_spec_rounds_total", "Speculative rounds (one target verify step each).", st.rounds),
                ("lingls_spec_drafted_tokens_total", "Tokens drafted.", st.drafted),
                ("lingls_spec_accepted_tokens_total", "Drafted tokens accepted by the target.", st.accepted),
                ("lingls_spec_round_tokens_total", "Tokens produced by speculative rounds (accepted + one each).",
                 st.tokens),
                ("lingls_spec_draft_seconds_total", "Time spent drafting.", round(st.draft_s, 6)),
                ("lingls_spec_verify_seconds_total", "Time spent in target verify steps (with commit).",
                 round(st.verify_s, 6)),
            ]
        lines = []
        for name, help, value in counters:
            lines += [f"# HELP {name} {help}", f"# TYPE {name} counter", f"{name} {value}"]
        name = "lingls_running"
        lines += [f"# HELP {name} Generations running now (0 or 1: batch 1).", f"# TYPE {name} gauge",
                  f"{name} {int(self.engine.running)}"]
        if spec is not None:
            name = "lingls_spec_accept_length"
            lines += [f"# HELP {name} Mean tokens per verify step (accept length).", f"# TYPE {name} gauge",
                      f"{name} {spec.stats.accept_length:.4f}"]
        lines += self.ttft.render() + self.tpot.render()
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """Every client error is found here, before any response starts: 400 (or 415) with an OpenAI-style
        error body, in streaming mode too. 503 is left for the server's own failures."""
        # application/octet-stream is aiohttp's name for no header; x-www-form-urlencoded is what `curl -d` sends
        if request.content_type not in ("application/json", "application/octet-stream",
                                        "application/x-www-form-urlencoded"):
            return _error(415, f"Content-Type {request.content_type} is not supported: send application/json")
        try:
            body = _json_body(await request.read())
        except RequestError as e:
            return _error(400, str(e), param=e.param)
        if not await self._wait_loaded():
            return _error(503, f"the model is not loaded: {self.load_error}", "server_error")
        try:
            gen, prompt_ids, stream, include_usage = self._parse(body)
        except RequestError as e:
            return _error(400, str(e), param=e.param)
        except EngineError as e:  # the tokenizer cannot template the prompt (a model without FIM tokens)
            return _error(400, str(e), param="suffix")
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text: str, finish: str | None, usage: dict | None = None) -> dict:
            out = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
            if usage is not None:
                out["usage"] = usage
            return out

        chunks = self.engine.stream(gen, prompt_ids)
        try:
            first = await anext(chunks)  # a failure before the first token still gets its status code
        except EngineError as e:
            await chunks.aclose()
            return _error(503, str(e), "server_error")
        if not stream:
            texts, last = [first.text], first
            try:
                if not first.finish:
                    async for c in chunks:
                        texts.append(c.text)
                        last = c
            except EngineError as e:
                return _error(503, str(e), "server_error")
            finally:
                await chunks.aclose()
            self._observe(last)
            return web.json_response(chunk("".join(texts), last.finish, _usage(last)))

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            c = first
            while True:
                if c.finish:
                    self._observe(c)
                    await _send(response, chunk(c.text, c.finish, _usage(c) if include_usage else None))
                    break
                if c.text:
                    await _send(response, chunk(c.text, None))
                c = await anext(chunks)
            await response.write(b"data: [DONE]\n\n")
        except EngineError as e:  # the server failed mid-stream: the status is sent, the event says so
            await _send(response, {"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        except ConnectionError:
            log.info("client went away: generation stopped")
        finally:
            await chunks.aclose()  # stops the generation if the client left mid-stream
        return response

    async def _wait_loaded(self) -> bool:
        """Requests that come while the model loads wait for it (as they did in the engine); False if it failed."""
        await self._settled.wait()
        return self.load_error is None

    def _parse(self, body: dict) -> tuple[GenerateRequest, list[int] | None, bool, bool]:
        """(request, prompt token ids or None, stream, include_usage), or a RequestError naming the field."""
        unknown = sorted(set(body) - _FIELDS)
        if unknown:
            raise RequestError(f"unrecognized request argument: {unknown[0]}", unknown[0])
        for key in ("model", "user"):
            _optional_text(body, key)
        for key, neutral in _UNSUPPORTED.items():
            value = body.get(key)
            if value is not None and (value != neutral or isinstance(value, bool) != isinstance(neutral, bool)):
                raise RequestError(f"{key}: {json.dumps(value)[:40]} is not supported "
                                   f"(only {json.dumps(neutral)})", key)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        prompt_ids = None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.engine.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise RequestError(f"prompt: token ids must lie in [0, {vocab})", "prompt")
            prompt_ids, prompt = list(prompt), ""
        elif not isinstance(prompt, str):
            raise RequestError("prompt: must be a string, a list of one string, or a list of token ids", "prompt")
        suffix = _optional_text(body, "suffix")
        if suffix is not None:
            if prompt_ids is not None:
                raise RequestError("suffix: needs a string prompt", "suffix")
            prompt = self.engine.tokenizer.fim_prompt(prompt, suffix)
        elif prompt_ids is None and not prompt:
            raise RequestError("prompt: empty: nothing to complete", "prompt")
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestError("stop: must be a string or a list of strings", "stop")
        if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise RequestError(f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
        capacity = self.engine.runner.capacity
        max_tokens = _number(body, "max_tokens", 16, int, 0, capacity - 2,
                             f"the context of {capacity} tokens holds the completion and at least one prompt token")
        temperature = _number(body, "temperature", 1.0, float, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, float, 0.0, 1.0)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**63):
            raise RequestError("seed: must be a 64-bit integer", "seed")
        stream = _optional_flag(body, "stream")
        options = body.get("stream_options")
        include_usage = False
        if options is not None:
            if not stream:
                raise RequestError("stream_options: only allowed with stream: true", "stream_options")
            if not isinstance(options, dict) or set(options) - {"include_usage"}:
                raise RequestError('stream_options: must be an object with at most "include_usage"', "stream_options")
            include_usage = _optional_flag(options, "include_usage", "stream_options")
        # token healing changes which tokens come out, so the OpenAI API's clients get it only when they ask
        gate = _number(body, "min_line_probability", 0.0, float, 0.0, 0.999)
        req = GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              stop=tuple(stop), seed=seed, heal=_optional_flag(body, "token_healing"),
                              min_line_probability=gate)
        return req, prompt_ids, stream, include_usage

    def _observe(self, last) -> None:
        if last is None or last.usage is None:
            return
        if last.usage["ttft_s"] is not None:
            self.ttft.observe(last.usage["ttft_s"])
        if last.usage["tpot_s"] is not None:
            self.tpot.observe(last.usage["tpot_s"])


# the fields of a completion request (OpenAI's, token_healing and min_line_probability); others are refused as
# OpenAI does
_FIELDS = {"prompt", "suffix", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options",
           "token_healing", "min_line_probability", "model", "user", "n", "best_of", "echo", "logprobs",
           "presence_penalty", "frequency_penalty", "logit_bias"}
_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0,
                "logit_bias": {}}  # accepted only with their neutral value
MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 1024  # far beyond any useful stop string; keeps a request's matching cost small


class RequestError(ValueError):
    """A client error in a completion request; `param` names the field (None: the body as a whole)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _json_body(raw: bytes) -> dict:
    """The request body as a JSON object: UTF-8, standard JSON (no NaN or Infinity), not nested absurdly."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise RequestError("the body is not UTF-8 text") from None
    except RecursionError:
        raise RequestError("the body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer of more digits than Python converts
        raise RequestError(f"the body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _optional_text(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None:
        if not isinstance(value, str):
            raise RequestError(f"{key}: must be a string", key)
    return value


def _optional_flag(body: dict, key: str, param: str | None = None) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{key}: must be true or false", param or key)
    return bool(value)


def _number(body: dict, key: str, default, kind, low, high, why: str = ""):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise RequestError(f"{key}: must be {'an integer' if kind is int else 'a number'}", key)
    if not low <= value <= high:  # also refuses a float too large for JSON's double, which parses as infinity
        raise RequestError(f"{key}: must be in [{low}, {high}]" + (f" ({why})" if why else ""), key)
    return kind(value)


@web.middleware
async def _json_errors(request: web.Request, handler):
    """aiohttp's own refusals (404, 405, 413 for a body over 1 MiB, ...) with an OpenAI-style JSON body."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, e.reason if e.status != 413 else f"the body is too large ({e.text})",
                      "invalid_request_error" if e.status < 500 else "server_error")


def _usage(last) -> dict:
    u = last.usage or {}
    p, n = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": u.get("reused_tokens", 0)}}


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> web.Response:
    """An OpenAI-style error response."""
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)


class _MalformedRequests(logging.Filter):
    """aiohttp answers a malformed HTTP request (a control byte in a header, broken framing) with a 400 and
    logs a traceback for it: a client's mistake, logged here as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= exc.code < 500:
            why = (exc.message or type(exc).__name__).strip().splitlines()[0].rstrip(":")
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "a client"
            record.msg, record.args = f"refused a malformed HTTP request from {remote}: {why}", ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


# ---- the command ---------------------------------------------------------------------------------------------
async def serve(server: Server, host: str, port: int) -> None:
    """Listen, load the model, and answer until SIGTERM or SIGINT (Ctrl+C); then stop listening, end the running
    generation and close the engine, and with it every process it started."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):  # Windows: Ctrl+C stays a KeyboardInterrupt (main)
            loop.add_signal_handler(sig, stop.set)
    logging.getLogger("aiohttp.server").addFilter(_MalformedRequests())
    app_runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await app_runner.setup()
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        site = web.SockSite(app_runner, sock)
        await site.start()
        bound = sock.getsockname()[1]
        log.info("listening on http://%s:%d (model %s)", host, bound, server.model_name)
        loading = asyncio.ensure_future(server.load())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if server.load_error is None:  # loaded (or still loading): serve until a signal
            await stopping
            log.info("stopping")
        loading.cancel()
        stopping.cancel()
    finally:
        await app_runner.cleanup()
        await server.engine.close()


def _exit_when_idle(grace: float) -> None:
    """Return once the threads that would hold the interpreter's exit (the engine's worker: a step ends within
    milliseconds) have ended; if one is still busy after `grace` seconds (loading weights, or waiting on a rank
    that is gone), end the process here rather than hang."""
    deadline = time.monotonic() + grace
    busy = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    for t in busy:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in busy):
        log.info("stopped (the engine's worker was still busy)")
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="lingls serve: %(message)s", stream=sys.stderr)
    speculation = dict(draft=getattr(args, "draft", None) or "none", draft_k=getattr(args, "draft_k", None),
                       simulate_accept=getattr(args, "simulate_accept", None),
                       draft_vocab=getattr(args, "draft_vocab", None))
    try:
        if getattr(args, "tp", 1) > 1:
            from lingls.serve.tensor_parallel import TensorParallelEngine

            engine = TensorParallelEngine(args.model, args.tp, device=args.device, dtype=args.dtype, **speculation)
        else:
            from lingls.engine.local import LocalEngine

            engine = LocalEngine(args.model, device=args.device, dtype=args.dtype, **speculation)
    except EngineError as e:
        print(f"lingls serve: {e}", file=sys.stderr)
        return 2
    server = Server(engine, engine.name, args.api_key)
    try:
        asyncio.run(serve(server, args.host, args.port))
    except KeyboardInterrupt:  # before the loop's handler was in place
        pass
    except OSError as e:
        print(f"lingls serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    _exit_when_idle(grace=5.0)
    return 1 if server.load_error is not None else 0
