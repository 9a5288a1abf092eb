"""LocalEngine: a Ling model in this process, generating on one worker thread (batch 1).

The language server (and `lingls serve`) iterate `generate()` / `stream()` on the event loop; the worker
thread runs the ModelRunner's step loop and hands text back through the loop. Policy: one generation at a
time, and a new request preempts the running one, which stops within one decode step (as does one whose
iterator is closed or whose task is cancelled).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import AsyncIterator

from lingls.engine.healing import TailStripper
from lingls.engine.protocol import EngineError, EngineStats, GenerateRequest
from lingls.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

EMBEDDED = Path(__file__).resolve().parent.parent / "assets" / "ling-nano"
# torch threads for a model on the CPU, unless LINGLS_THREADS says otherwise. A batch-1 step is a few hundred
# small ops and matrix-vector products bound by memory: more threads add OpenMP barriers and gain little, and
# when any other process holds a core the barriers wait on it. Measured on a 2-core machine at load 5-8
# (lingls bench prefix --model nano): 2 threads took 1.6 s to a first token after a one-line edit and 5.5 s to a
# one-line completion, where one thread took tens of milliseconds.
CPU_THREADS = 1


# ---- model directories ----------------------------------------------------------------------------------
def tiny_config_dict(vocab_size: int) -> dict:
    """A small Ling-3.0 layout (KDA, MLA, dense and MoE layers) that runs fast on a CPU."""
    return {
        "vocab_size": vocab_size, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
        "head_dim": 32, "layer_group_size": 2, "first_k_dense_replace": 1, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1,
        "n_group": 2, "topk_group": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
        "v_head_dim": 16, "max_position_embeddings": 4096, "num_nextn_predict_layers": 0,
    }


def write_tiny_checkpoint(out_dir: str | Path, tokenizer_dir: str | Path = EMBEDDED, seed: int = 0,
                          std: float = 0.5, mtp: bool = False) -> Path:
    """A random tiny model with `tokenizer_dir`'s tokenizer (and an MTP layer with `mtp`), written atomically into
    `out_dir`.

    `std` is large so that logits are peaked: greedy choices are then far from ties and stable under the
    rounding differences between the step, chunked and full-sequence forms."""
    import torch

    from lingls.model import LingConfig, LingForCausalLM, save_checkpoint

    out_dir = Path(out_dir)
    tok = Tokenizer(tokenizer_dir)
    cfg = LingConfig.from_dict({**tiny_config_dict(tok.vocab_size), "num_nextn_predict_layers": int(mtp)})
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))
    try:
        model = LingForCausalLM(cfg)
        model.init_weights(std=std, generator=torch.Generator().manual_seed(seed))
        save_checkpoint(model, tmp, dtype=torch.float32)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy(Path(tokenizer_dir) / name, tmp / name)
        try:
            tmp.rename(out_dir)
        except OSError:  # another process wrote it first
            if not (out_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def has_weights(path: Path) -> bool:
    """Safetensors files, plain or packed (`lingls.model.packed`, as the embedded ling-nano ships), without
    importing torch."""
    return any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.zlib"))


def default_model_dir() -> Path:
    """The embedded ling-nano when its weights are present, else a random tiny stand-in (cached on disk)."""
    if (EMBEDDED / "config.json").is_file() and has_weights(EMBEDDED):
        return EMBEDDED
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lingls" / "random-tiny-v1"
    if not (cache / "config.json").is_file():
        log.warning("ling-nano weights are not installed: using a random tiny model (completions are noise)")
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_checkpoint(cache)
    return cache


def cpu_threads() -> int:
    """The torch threads a model on the CPU runs with: LINGLS_THREADS, else CPU_THREADS."""
    raw = os.environ.get("LINGLS_THREADS", "").strip()
    if not raw:
        return CPU_THREADS
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise EngineError(f"LINGLS_THREADS={raw!r}: a whole number of threads >= 1 is needed")
    return n


def check_model_dir(path: Path) -> None:
    """Fail early, with what is missing, on a directory that cannot be a model."""
    if not path.is_dir():
        raise EngineError(f"model directory {path} does not exist")
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    # a weightless benchmark checkpoint (lingls.model.random_checkpoint) has random_weights.json instead
    if not has_weights(path) and not (path / "random_weights.json").is_file():
        missing.append("*.safetensors")
    if missing:
        raise EngineError(f"model directory {path} lacks {', '.join(missing)} (a Ling-3.0 checkpoint in "
                          "safetensors with its tokenizer.json is needed)")


# ---- the engine ---------------------------------------------------------------------------------------------
@dataclass
class Chunk:
    """A piece of a completion. The last chunk of a stream has `finish` set: "stop" (EOS or a stop string),
    "length" (max_tokens or the context is full), "cancelled" or "preempted"."""

    text: str
    tokens: int = 0  # new tokens behind this text
    finish: str | None = None
    usage: dict | None = None  # on the last chunk: prompt_tokens, completion_tokens, reused_tokens, ttft_s, tpot_s


@dataclass
class _Job:
    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    prompt_ids: list[int] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    reason: str = "cancelled"
    submitted: float = field(default_factory=time.perf_counter)

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed (the engine was shut down): nobody is listening
            pass

    def stop(self, reason: str) -> None:
        if not self.cancel.is_set():
            self.reason = reason
            self.cancel.set()


def attach_drafter(runner, draft: str | None, draft_k: int | None, simulate_accept: int | None = None,
                   draft_vocab: str | None = None) -> None:
    """Speculative decoding on `runner` with the drafter(s) of a --draft string (nothing for none); draft_vocab:
    a --draft-vocab file (the MTP head's reduced vocabulary, `draft_vocab`).

    simulate_accept (benchmarks only): every round accepts that many drafts whatever they are, so a checkpoint
    with random weights, whose drafts are never accepted, shows the time of real acceptance lengths. The text
    it produces is not the model's."""
    if not draft or draft == "none":
        if simulate_accept is not None:
            raise EngineError("--simulate-accept needs a drafter (--draft)")
        if draft_vocab is not None:
            raise EngineError("--draft-vocab needs a drafter (--draft mtp)")
        return
    import torch

    from lingls.runtime.spec.round import attach

    try:  # draft_k None: a block drafter's block size, else round.default_k
        spec = attach(runner, draft, draft_k, draft_vocab)
    except ValueError as e:
        raise EngineError(str(e)) from None
    if simulate_accept is not None and not 0 <= simulate_accept <= spec.k:
        raise EngineError(f"--simulate-accept {simulate_accept}: must be 0..{spec.k} (the drafted tokens per round)")
    if simulate_accept is not None:
        log.warning("--simulate-accept %d: every round accepts %d drafts; the output is NOT the model's",
                    simulate_accept, simulate_accept)
        spec.force_accept = torch.full((1,), simulate_accept, dtype=torch.long, device=runner.device)


class LocalEngine:
    """The Engine protocol over a ModelRunner on a worker thread."""

    def __init__(self, model_dir: str | None = None, device: str | None = None, dtype: str | None = None,
                 capacity: int | None = None, use_graphs: bool | None = None, draft: str | None = None,
                 draft_k: int | None = None, simulate_accept: int | None = None, draft_vocab: str | None = None):
        self.model_dir = Path(model_dir) if model_dir else default_model_dir()
        check_model_dir(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        # a model whose card says it completes best from the prefix alone gets left-to-right prompts from the
        # language server, though it knows the FIM tokens; one whose card says spm gets the suffix first
        how = self.tokenizer.completion_prompt
        fim = self.tokenizer.fim
        self.fim = None if how == "prefix" or fim is None else replace(fim, order="spm") if how == "spm" else fim
        self.name = self.model_dir.name
        self.stats = EngineStats()
        self.stats.extra.update(reused_requests=0, reused_tokens=0, preempted=0, truncated=0, unsure_lines=0)
        self.device, self.dtype, self.capacity, self.use_graphs = device, dtype, capacity, use_graphs
        # speculative decoding: a --draft string (`runtime.spec`), and for benchmarks a forced accept count
        self.draft, self.draft_k, self.simulate_accept = draft, draft_k, simulate_accept
        self.draft_vocab = draft_vocab
        self.runner = None
        self.load_progress = "not loaded"
        self._load_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lingls-runner")
        self._current: _Job | None = None

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    @property
    def running(self) -> bool:
        """Whether a generation holds the runner now."""
        return self._current is not None

    # ---- loading (on the worker thread) ------------------------------------------------------------------
    def load(self) -> None:
        """Load the weights and build the runner (idempotent). Raises EngineError with what went wrong."""
        with self._load_lock:
            if self.runner is not None:
                return
            import torch

            from lingls.model import CheckpointError, ConfigError, load_model
            from lingls.runtime.runner import ModelRunner

            device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
            if device == "cpu":
                torch.set_num_threads(cpu_threads())
            dtype = (getattr(torch, self.dtype) if self.dtype
                     else torch.bfloat16 if device.startswith("cuda") else torch.float32)
            t0 = time.perf_counter()
            def progress(done: int, total: int) -> None:
                self.load_progress = (f"loading weights from {self.model_dir} to {device}: "
                                      f"{done / max(total, 1):.0%} of {total / 1e9:.2f} GB")

            progress(0, 0)
            try:
                model = load_model(self.model_dir, device=device, dtype=dtype, progress=progress)
            except (CheckpointError, ConfigError) as e:
                raise EngineError(f"cannot load the model: {e}") from None
            except (OSError, RuntimeError) as e:
                raise EngineError(f"cannot load the model from {self.model_dir}: {e}") from None
            cfg = model.config
            capacity = self.capacity or min(cfg.max_position_embeddings, 32768 if device.startswith("cuda") else 4096)
            self.load_progress = "capturing decode graphs"
            # fp32 on a CPU without a drafter: the lean step for decode and edits; on a CPU every token's
            # probability for the confidence gate (on a GPU the gate is off: it would add a vocabulary-wide
            # reduction, gathered across ranks, to every captured step)
            runner = ModelRunner(model, capacity=capacity, use_graphs=self.use_graphs,
                                 lean_cpu=not self.draft or self.draft == "none", scores=device == "cpu")
            runner.warmup(greedy_only=True)
            attach_drafter(runner, self.draft, self.draft_k, self.simulate_accept, self.draft_vocab)
            self.runner = runner
            self.load_progress = f"ready ({time.perf_counter() - t0:.1f} s)"

    async def start(self) -> None:
        """Load in the background without blocking the event loop."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self.load)

    # ---- generation ----------------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[str]:
        async for chunk in self.stream(request):
            if chunk.text:
                yield chunk.text

    async def stream(self, request: GenerateRequest, prompt_ids: list[int] | None = None) -> AsyncIterator[Chunk]:
        """Chunks of the completion of `request` (or of the token ids `prompt_ids`, when given)."""
        loop = asyncio.get_running_loop()
        job = _Job(request, loop, asyncio.Queue(), prompt_ids)
        if self._current is not None:
            self._current.stop("preempted")
        self._current = job
        self.stats.requests += 1
        loop.run_in_executor(self._executor, self._run, job)
        try:
            while True:
                item = await job.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish:
                    return
        finally:
            job.stop("cancelled")  # no-op when it already finished
            if self._current is job:
                self._current = None

    def _run(self, job: _Job) -> None:
        """The worker: one request's step loop. Every outcome ends with a Chunk(finish=...) or an exception."""
        if job.cancel.is_set():  # preempted while queued
            self._finish(job, Chunk("", finish=job.reason))
            return
        try:
            self.load()
            self._generate(job)
        except EngineError as e:
            job.post(e)
        except Exception as e:
            log.exception("generation failed")
            job.post(EngineError(f"generation failed: {type(e).__name__}: {e}"))

    def _generate(self, job: _Job) -> None:
        from lingls.runtime.runner import Sampling

        req, tok, runner = job.request, self.tokenizer, self.runner
        ids = job.prompt_ids if job.prompt_ids is not None else tok.encode_prompt(req.prompt)
        if not ids:
            raise EngineError("empty prompt: nothing to complete")
        max_new = max(0, req.max_tokens)
        room = runner.capacity - 1 - max_new
        if len(ids) > room:  # keep the end of the prompt: it is what the completion continues
            if room < 1:
                raise EngineError(f"max_tokens={max_new} leaves no room for a prompt in the context of "
                                  f"{runner.capacity}")
            log.info("prompt of %d tokens truncated to its last %d", len(ids), room)
            ids = ids[-room:]
            self.stats.extra["truncated"] += 1
        self.stats.prompt_tokens += len(ids)
        if max_new == 0:
            self._finish(job, Chunk("", finish="length"), len(ids), 0, 0, None, None)
            return
        sampling = Sampling(req.temperature, req.top_p, req.seed if req.seed is not None else 0)
        ids, tail = tok.heal(ids) if req.heal and job.prompt_ids is None else (ids, "")
        reused = runner.prefill(ids, sampling, tok.candidates().mask(tail) if tail else None)
        while tail and not job.cancel.is_set():
            # healing: until a chosen token covers the tail, a chosen piece of it joins the prompt and the next
            # token is chosen among those that agree with the rest (rarely more than two rounds)
            chosen = runner.chosen()  # one host read per round, before the decode loop
            piece = tok.candidates().texts[chosen]
            if piece.startswith(tail):
                break
            ids, tail = ids + [chosen], tail[len(piece):]
            runner.prefill(ids, sampling, tok.candidates().mask(tail))
        if reused:
            self.stats.extra["reused_requests"] += 1
            self.stats.extra["reused_tokens"] += reused
        detok, healed, stops = tok.detokenizer(), TailStripper(tail), StopMatcher(req.stop)
        # the confidence gate, where the runner reports each token's probability (plain decode with scores)
        gate = (LineGate(req.min_line_probability)
                if req.min_line_probability > 0 and runner.scores and runner.spec is None else None)
        steps = runner.decode(max_new, sampling.greedy)
        n, finish, ttft, t_first = 0, "length", None, None
        unposted = 0  # tokens read whose text no chunk has carried yet

        def emit(text: str, final: bool = False, tokens: int = 0, scored: bool = True) -> bool:
            """Post text through the gate (with the token just read, unless not `scored`: the flush at the
            end adds no token); True when the gate ended the completion."""
            nonlocal unposted
            ended, unposted = False, unposted + tokens
            if gate is not None:
                text, ended = gate.feed(text, runner.token_logprob if scored else 0.0, final)
            if text:
                job.post(Chunk(text, tokens=unposted))
                unposted = 0
            return ended

        try:
            for token in steps:
                if job.cancel.is_set():
                    finish = job.reason
                    break
                n += 1
                if n == 1:
                    t_first = time.perf_counter()
                    ttft = t_first - job.submitted
                if token in tok.eos_ids:
                    finish = "stop"
                    emit(stops.feed(healed.feed(detok.flush()), final=True)[0], final=True)
                    break
                text, hit = stops.feed(healed.feed(detok.push(token)))
                if emit(text, final=hit, tokens=1) or hit:
                    finish = "stop"
                    break
            else:
                text, _ = stops.feed(healed.feed(detok.flush()), final=True)
                if emit(text, final=True, scored=False):
                    finish = "stop"
        finally:
            steps.close()
        if gate is not None and gate.refused:
            self.stats.extra["unsure_lines"] += 1
        self.stats.generated_tokens += n
        tpot = (time.perf_counter() - t_first) / (n - 1) if n > 1 else None
        self._finish(job, Chunk("", finish=finish), len(ids), n, reused, ttft, tpot)

    def _finish(self, job: _Job, chunk: Chunk, prompt=0, n=0, reused=0, ttft=None, tpot=None) -> None:
        if chunk.finish == "preempted":
            self.stats.extra["preempted"] += 1
        if chunk.finish in ("cancelled", "preempted"):
            self.stats.cancelled += 1
        chunk.usage = {"prompt_tokens": prompt, "completion_tokens": n, "reused_tokens": reused,
                       "ttft_s": ttft, "tpot_s": tpot}
        job.post(chunk)

    async def close(self) -> None:
        if self._current is not None:
            self._current.stop("cancelled")
        self._executor.shutdown(wait=False, cancel_futures=True)


class LineGate:
    """The confidence gate: a completion passes a line at a time, and only a line the model gave at least
    `min_probability` (the product of its tokens' probabilities; a token that ends a line, a newline or the
    end of text, counts in the line it ends). The first line below it ends the completion without that line, as
    soon as its probability so far falls below (no need to decode the rest of it): no suggestion rather than an
    unlikely one.

    Why: the embedded model's greedy line is wrong at most cursors, and its probability says which. On code
    it never saw, at 1% (docs/performance.md, `python -m training.heldout_cpu --gate`), two thirds of the wrong
    lines went and all 72 right ones stayed. Text is held back until its line ends, which costs a
    language server nothing: it answers at a line's end (mid-line) or a block's."""

    def __init__(self, min_probability: float):
        self.bar = math.log(min_probability)
        self.held, self.logprob, self.refused = "", 0.0, False

    def feed(self, text: str, logprob: float, final: bool = False) -> tuple[str, bool]:
        """The text of the next token (`logprob`: that token's), or with `final` the last text of the
        completion; returns (text to emit, whether the completion ends here because a line fell short)."""
        self.logprob += logprob
        self.held += text
        out = ""
        while (end := self.held.find("\n")) >= 0 or (final and self.held):
            if self.logprob < self.bar:
                break
            cut = len(self.held) if end < 0 else end + 1
            out, self.held, self.logprob = out + self.held[:cut], self.held[cut:], 0.0
        if self.logprob < self.bar:  # a line's probability only falls as it goes on: refused without its end
            self.held, self.refused = "", True
            return out, True
        return out, False


class StopMatcher:
    """Cuts a text stream at the first stop string, holding back a tail that could still begin one.

    The held tail is shorter than the longest stop string, and only it and the new text are searched, so a
    feed costs the same however much text came before it."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = [s for s in stops if s]
        self._longest = max(map(len, self.stops), default=0)
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached)."""
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return buf[:cut], True
        keep = 0 if final else self._open_tail(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def _open_tail(self, buf: str) -> int:
        """The length of the longest end of `buf` that begins a stop string (more text may complete it)."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[len(buf) - k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stops):
                return k
        return 0
