"""`lingls serve`: an OpenAI-compatible HTTP API over one resident model, one request at a time.

Endpoints: POST /v1/completions (prompt, suffix, max_tokens, temperature, top_p, stop, seed, stream, and the
extension token_healing: true, see lingls.runtime.healing),
GET /v1/models, GET /health, GET /metrics (Prometheus text).

Batch-1 policy: the model serves one request at a time, and a new completion request preempts the one
running: the older request stops within one decode step and ends with finish_reason "preempted" (an editor
only wants the completion for where the cursor is now). A client that disconnects, or a request whose
handler is cancelled, stops its generation within one decode step too. With --api-key every endpoint but
/health needs `Authorization: Bearer KEY`. The server binds 127.0.0.1 unless told otherwise.
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

from lingls.runtime.engine import EngineError, GenerateRequest

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

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return _error(401, "missing or wrong API key (send Authorization: Bearer KEY)", "authentication_error")
        return await handler(request)

    async def load(self) -> None:
        """Load the model in the background, logging progress, so /health answers meanwhile."""
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
            log.error("%s", e)
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
                ("lingls_spec_round_tokens_total", "Tokens produced by speculative rounds (accepted + one each).", st.tokens),
                ("lingls_spec_draft_seconds_total", "Time spent drafting.", round(st.draft_s, 6)),
                ("lingls_spec_verify_seconds_total", "Time spent in target verify steps (with commit).", round(st.verify_s, 6)),
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
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body must be a JSON object")
        try:
            gen, prompt_ids, stream = self._parse(body)
        except ValueError as e:
            return _error(400, str(e))
        except EngineError as e:
            return _error(400, str(e))
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text: str, finish: str | None, usage: dict | None = None) -> dict:
            out = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
            if usage is not None:
                out["usage"] = usage
            return out

        chunks = self.engine.stream(gen, prompt_ids)
        if not stream:
            texts, last = [], None
            try:
                async for c in chunks:
                    texts.append(c.text)
                    last = c
            except EngineError as e:
                return _error(503, str(e), "server_error")
            self._observe(last)
            return web.json_response(chunk("".join(texts), last.finish, _usage(last)))

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        try:
            async for c in chunks:
                if c.finish:
                    self._observe(c)
                    await _send(response, chunk(c.text, c.finish, _usage(c) if include_usage else None))
                elif c.text:
                    await _send(response, chunk(c.text, None))
            await response.write(b"data: [DONE]\n\n")
        except EngineError as e:
            await _send(response, {"error": {"message": str(e), "type": "server_error"}})
        except (ConnectionResetError, ConnectionError):
            log.info("client went away: generation stopped")
        finally:
            await chunks.aclose()  # stops the generation if the client left mid-stream
        return response

    def _parse(self, body) -> tuple[GenerateRequest, list[int] | None, bool]:
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        if body.get("echo") or body.get("logprobs") not in (None, False, 0) or body.get("best_of") not in (None, 1):
            raise ValueError("echo, logprobs and best_of are not supported")
        if body.get("n", 1) != 1:
            raise ValueError("n: only 1 completion per request is supported (batch 1)")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        prompt_ids = None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.engine.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt: token ids must lie in [0, {vocab})")
            prompt_ids, prompt = list(prompt), ""
        elif not isinstance(prompt, str):
            raise ValueError("prompt: must be a string, a list of one string, or a list of token ids")
        suffix = body.get("suffix")
        if suffix is not None:
            if not isinstance(suffix, str) or prompt_ids is not None:
                raise ValueError("suffix: must be a string, with a string prompt")
            prompt = self.engine.tokenizer.fim_prompt(prompt, suffix)
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError("stop: must be a string or a list of strings")
        max_tokens = _number(body, "max_tokens", 16, int, 0)
        temperature = _number(body, "temperature", 1.0, float, 0.0)
        top_p = _number(body, "top_p", 1.0, float, 0.0)
        if top_p > 1.0:
            raise ValueError("top_p: must be in [0, 1]")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError("seed: must be an integer")
        # token healing changes which tokens come out, so the OpenAI API's clients get it only when they ask
        req = GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              stop=tuple(stop), seed=seed, heal=body.get("token_healing") is True)
        return req, prompt_ids, bool(body.get("stream", False))

    def _observe(self, last) -> None:
        if last is None or last.usage is None:
            return
        if last.usage["ttft_s"] is not None:
            self.ttft.observe(last.usage["ttft_s"])
        if last.usage["tpot_s"] is not None:
            self.tpot.observe(last.usage["tpot_s"])


def _number(body: dict, key: str, default, kind, low):
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ValueError(f"{key}: must be a {'integer' if kind is int else 'number'}")
    if value < low:
        raise ValueError(f"{key}: must be >= {low}")
    return kind(value)


def _usage(last) -> dict:
    u = last.usage or {}
    p, n = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": u.get("reused_tokens", 0)}}


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


# ---- the command ---------------------------------------------------------------------------------------------
async def serve(server: Server, host: str, port: int) -> None:
    """Listen, load the model, and answer until SIGTERM or SIGINT (Ctrl+C); then stop listening, end the running
    generation and close the engine, and with it every process it started."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):  # Windows: Ctrl+C stays a KeyboardInterrupt (main)
            loop.add_signal_handler(sig, stop.set)
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
        await stop.wait()
        log.info("stopping")
        loading.cancel()
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
            from lingls.runtime.distributed import TensorParallelEngine

            engine = TensorParallelEngine(args.model, args.tp, device=args.device, dtype=args.dtype, **speculation)
        else:
            from lingls.runtime.local import LocalEngine

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
    return 0
