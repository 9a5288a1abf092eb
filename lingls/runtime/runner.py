"""ModelRunner: the batch-1 step loop over one resident sequence state.

- Prefill runs the prompt (after prefix reuse, `cache.py`) in chunks with host-known lengths, pausing at
  the cache's snapshot points, then samples the first token on the device. Pieces of up to 16 tokens run the
  fused step's kernels, longer ones the model's prefill step; a prompt's last piece and its last token (around
  the end-1 snapshot) run as one staged fused step, the snapshot settled from its staged KDA inputs (one weight
  stream, not two). On CUDA with graphs they are replays: a cold prompt's first piece of a graph padded to a
  token bucket (`prefill_graphs`), a short piece of a graph per (tokens, KV bucket, staged), so a cold prefill
  issues a few replays rather than thousands of launches.
- Decode steps (T = 1) and verify steps (T = K + 1) have fixed shapes: on CUDA each (T, KV bucket, greedy?)
  is captured once as a CUDA graph and replayed. The MLA keys read are bounded by a power-of-two bucket of
  the position (known on the host without asking the device); rows past the position are masked.
- The loop never reads a device value on the host. A decode step reads its input token and position from
  device buffers and writes the next ones back, so step j+1 is launched before step j's token is known.
  After each launch, the sampled token is copied into a pinned host buffer and an event is recorded; the
  host waits on the *previous* step's event (the GPU is busy with the step just launched) to stream text
  and apply stop rules one step late.
On CPU the same code runs eagerly (no graphs, no events).
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch

from lingls.kernels import accept, kda
from lingls.model.ling import LingForCausalLM, Snapshots
from lingls.runtime.cache import PrefixCache
from lingls.runtime.fused_step import MAX_TOKENS as FUSED_MAX_TOKENS
from lingls.runtime.fused_step import FusedStep
from lingls.runtime.graphs import GraphSet
from lingls.runtime.sampling import argmax_shards, chosen_logprob, sample

# the padded lengths of a cold prompt's first piece with prefill graphs (a piece runs at the smallest that holds it)
PREFILL_BUCKETS = (256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Fence:
    """A pinned host slot + event per in-flight step (CUDA), or a plain buffer (CPU, where copies are synchronous).
    int64 (token ids) or float32 (their log-probabilities) values."""

    def __init__(self, device: torch.device, slots: int, width: int, dtype: torch.dtype = torch.long):
        cuda = device.type == "cuda"
        self.host = torch.zeros(slots, width, dtype=dtype, pin_memory=cuda)
        # The same memory as a ctypes array (self.host keeps it alive), whose slice is a list of ints: a read costs
        # no torch op (~9 us a read on a CPU, against ~0.5 us) and needs no NumPy (not a dependency of lingls).
        ctype = {torch.long: ctypes.c_int64, torch.float32: ctypes.c_float}[dtype]
        self.view = (ctype * self.host.numel()).from_address(self.host.data_ptr())
        self.width = width
        self.events = [torch.cuda.Event() for _ in range(slots)] if cuda else None

    def post(self, slot: int, values: torch.Tensor) -> None:
        self.host[slot, : values.shape[0]].copy_(values, non_blocking=True)
        if self.events:
            self.events[slot].record()

    def read(self, slot: int, n: int = 1) -> list:
        """Wait for the step that posted into `slot` (polling: a blocking wait would hold the GIL) and read it."""
        if self.events:
            while not self.events[slot].query():
                time.sleep(0)
        return self.view[slot * self.width: slot * self.width + n]


def short_step(model: LingForCausalLM, lean_cpu: bool = False):
    """What runs decode and verify steps and a prompt's short pieces (up to its `max_tokens`; the model's own torch
    step runs longer ones): the fused Triton kernels on CUDA (`fused_step.FusedStep`, 5.8x faster than the torch
    ops on one H200 at Ling-3.0-flash shapes, bench/results/fused_step_shard42.json) unless LINGLS_KERNELS=0; with
    `lean_cpu`, the CPU step (`cpu_step.CpuStep`) where it serves the model (fp32, unsharded, on a CPU); else
    None (the model's own torch step)."""
    if model.lm_head.weight.device.type == "cuda":
        return FusedStep(model) if os.environ.get("LINGLS_KERNELS", "1") != "0" else None
    from lingls.runtime import cpu_step

    return cpu_step.CpuStep(model) if lean_cpu and cpu_step.supports(model) else None


class ModelRunner:
    """Runs one LingForCausalLM for one sequence at a time (batch 1), resident state and prefix cache included."""

    def __init__(self, model: LingForCausalLM, capacity: int = 4096, use_graphs: bool | None = None,
                 prefill_chunk: int | None = None, verify_sizes: tuple[int, ...] = (), min_bucket: int = 256,
                 max_snapshots: int = 24, prefill_graphs: bool | None = None, lean_cpu: bool = False,
                 scores: bool = False, tail_free: bool = True):
        """prefill_chunk: tokens per prefill step, and the spacing of the prefix cache's KDA snapshots. Default
        8192 on a GPU, where a step's fixed cost dominates: eager cold prefills of a Ling-3.0-flash TP=4 rank on
        an H200 took 377 / 717 ms at 4,096 / 8,192 tokens in 2048-token pieces and 181 / 256 ms in one piece
        (docs/kernel-log.md, sixteenth session), and one piece is one graph; the price is coarser snapshots, so an
        edit far above a long prompt's end re-prefills from further back. 512 on a CPU, where the work dominates
        and finer snapshots re-prefill less.

        prefill_graphs: a cold prompt's first piece runs as a fixed-shape step padded to a token bucket
        (`PREFILL_BUCKETS`), one CUDA graph per bucket, and with CUDA graphs the short pieces (<= 16 tokens)
        replay a graph per (tokens, KV bucket), so the host issues a few replays instead of thousands of
        launches (the eager prefill is bound by those: bench/results/prefix.json). Default: on with CUDA graphs
        (on a CPU, or without graphs, the padded first piece runs eagerly: tests set it to check that path).

        tail_free: a cold prompt that fits one padded piece runs as that piece alone, whose KDA recurrence also
        leaves the states at the tail snapshots (end-8, end-1: `model.ling.Snapshots`, out of the chunked
        recurrence by `prefill_kda_state.snapshots`), instead of a piece up to end-8 and a staged step of the
        last 8 tokens (`_staged_tail`: a second stream of every weight, 4.2 ms of a cold prefill of a Ling-3.0-flash
        TP=4 rank on an H200). Where the narrow state pass does not serve, the snapshots rerun the recurrence
        (`KimiDeltaAttention._rerun_snapshots`). On by default: a cold 8,192-token prefill of a TP=4 rank on an
        H100 took 97.1 ms this way against 105.3 with the staged tail (and the block form's down), its snapshot
        kernel 0.17 ms of it (`lingls bench prefix --previous`; docs/kernel-log.md).

        lean_cpu: decode steps and short prefill pieces of an fp32 model on a CPU run `cpu_step.CpuStep` (the
        model's step regrouped into few large ops; speculative decoding needs the model's own step there).

        scores: every plain decode step (and a prefill's first token) also computes the chosen token's
        log-probability, read with the token (`token_logprob`), for the engine's confidence gate. A
        log-softmax over the vocabulary per step (ling-nano's 8,192 ids: 77 us median on one core of the busy
        2-core VM); under tensor parallelism it gathers the logits, so the engine turns it on for CPU runners
        only. Speculative rounds do not report scores (`token_logprob` stays None)."""
        self.model = model
        self.device = model.lm_head.weight.device
        self.capacity = capacity
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if prefill_chunk is None:
            prefill_chunk = 8192 if self.device.type == "cuda" else 512
        self.prefill_chunk, self.min_bucket = prefill_chunk, min_bucket
        self.state = model.new_state(capacity)
        self.cache = PrefixCache(self.state, max_snapshots=max_snapshots, every=prefill_chunk)
        self.max_t = max((1, *verify_sizes))
        dev = self.device
        self.ids = torch.zeros(self.max_t, dtype=torch.long, device=dev)  # input tokens of the next step
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # position of ids[0]
        self.out = torch.zeros(self.max_t, dtype=torch.long, device=dev)  # tokens chosen by the last step
        self.arange = torch.arange(self.max_t, device=dev)
        self.no_drafts = torch.zeros(0, dtype=torch.long, device=dev)
        self.temperature = torch.ones(1, device=dev)
        self.top_p = torch.ones(1, device=dev)
        self.seed = torch.zeros(1, dtype=torch.long, device=dev)
        self.fence = Fence(dev, 2, self.max_t)
        self.scores = scores
        self.logprob = torch.zeros(1, device=dev)  # the chosen token's log-probability (with `scores`)
        self.score_fence = Fence(dev, 2, 1, torch.float32) if scores else None
        self.token_logprob: float | None = None  # of the token `decode` yielded last (with `scores`, plain decode)
        # decode and verify steps by (T, KV bucket, greedy?); an attached round's phases share their memory pool
        self.graphs = GraphSet()
        self.prefill_graphs = self.use_graphs if prefill_graphs is None else prefill_graphs
        self.tail_free = tail_free
        self._snapshots: Snapshots | None = None  # a tail-free piece's snapshot ends and states (`_tail_snapshots`)
        # a prompt's pieces, in a pool of their own (their hidden states are read after the replay): a cold first
        # piece's padded step by its bucket, a short piece's by (tokens, KV bucket, staged?)
        self.piece_graphs = GraphSet()
        self._prefill_ids_buf: dict[int, torch.Tensor] = {}  # bucket -> its graph's input ids
        self._tail_stage_buf: tuple[torch.Tensor, torch.Tensor] | None = None  # see `_tail_stage`
        self.piece_ids = torch.zeros(FUSED_MAX_TOKENS, dtype=torch.long, device=dev)  # a short piece's graph inputs
        self.piece_pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.arange_piece = torch.arange(FUSED_MAX_TOKENS, device=dev)
        self.real_tokens = torch.zeros((), dtype=torch.long, device=dev)  # how many of a padded piece are real
        self.arange_prefill = torch.arange(max(PREFILL_BUCKETS), device=dev)
        # what runs a prompt's pieces: the runner's own step; a benchmark swaps in its baseline here (a step
        # swapped in sees every piece: the tail then stays two pieces, see `prefill`)
        self.prefill_step = self._prefill_step
        self.spec = None  # a speculative round (`attach`)
        self.fused = short_step(model, lean_cpu)

    def attach(self, spec) -> None:
        """Decode by speculative rounds (`spec.round.Speculator`, or None for plain steps again): `decode` runs
        its rounds, and every prefill piece also keeps the residual streams after the layers `spec.keep` names
        and hands them with the piece's hidden states to `spec.prefill`, so its drafter sees the prompt."""
        if spec is not None and self.fused is not None and not isinstance(self.fused, FusedStep):
            raise ValueError("speculative decoding runs on the fused step or the model's own step, not on "
                             f"{type(self.fused).__name__} (build the runner with lean_cpu=False)")
        self.spec = spec

    # ---- one step ----------------------------------------------------------------------------------------
    def prefill_bucket(self, n: int) -> int | None:
        """The padded length a cold first piece of n tokens runs at, or None (too short: the fused step's; too
        long for every bucket this runner can hold)."""
        if n <= FUSED_MAX_TOKENS:
            return None
        return next((b for b in PREFILL_BUCKETS if n <= b <= min(self.prefill_chunk, self.capacity)), None)

    def _padded_body(self, bucket: int, snapshots: bool = False) -> torch.Tensor:
        """The fixed-shape prefill of the bucket's ids buffer at positions 0..bucket-1, of which the first
        `real_tokens` are the prompt's (the rest pad it: they leave the KDA states alone, and their MLA rows lie
        past the sequence); with `snapshots`, also the states after the first `_tail_snapshots().ends` tokens.
        Returns the hidden states [bucket, hidden]."""
        ids = self._prefill_ids(bucket)
        positions = self.arange_prefill[:bucket]
        valid = positions < self.real_tokens
        return self.model.step(ids, self.state, positions, kv_len=bucket, prefill=True, valid=valid,
                               snapshots=self._tail_snapshots() if snapshots else None)

    def _padded_piece(self, ids: torch.Tensor, n: int, bucket: int, ends: tuple[int, ...] = ()) -> torch.Tensor:
        """A cold prompt's first n tokens (ids [n] on the device) through the bucket's padded step: a graph
        replay on CUDA with graphs (captured on first use), else eagerly; with `ends` (one or two positions in
        1..n), the states after them go to `_tail_snapshots()`. Returns the n real hidden states."""
        buf = self._prefill_ids(bucket)
        buf[:n].copy_(ids)
        buf[n:].zero_()
        self.real_tokens.fill_(n)
        if ends:
            snapshot_ends = self._tail_snapshots().ends
            for j in range(snapshot_ends.shape[0]):  # fills, not a copy from pageable memory (which would wait)
                snapshot_ends[j].fill_(ends[min(j, len(ends) - 1)])
        key = (bucket, bool(ends))
        if not self.use_graphs:
            return self._padded_body(*key)[:n]
        return self.piece_graphs.run(key, partial(self._padded_body, *key), self._piece_live())[:n]

    def _tail_snapshots(self) -> Snapshots:
        """The tail-free piece's snapshot buffers (allocated on first use): ends [2] and the KDA and conv states
        after them, as `Snapshots` holds them."""
        if self._snapshots is None:
            kda_state, conv = self.state.kda, self.state.conv
            self._snapshots = Snapshots(
                ends=torch.ones(len(self.cache.tail), dtype=torch.long, device=self.device),
                kda=torch.zeros(kda_state.shape[0], len(self.cache.tail), *kda_state.shape[1:],
                                dtype=kda_state.dtype, device=self.device),
                conv=torch.zeros(conv.shape[0], len(self.cache.tail), *conv.shape[1:], dtype=conv.dtype,
                                 device=self.device))
        return self._snapshots

    def _prefill_ids(self, bucket: int) -> torch.Tensor:
        """The bucket's input ids buffer (the padded step's, and its graph's, input)."""
        if bucket not in self._prefill_ids_buf:
            self._prefill_ids_buf[bucket] = torch.zeros(bucket, dtype=torch.long, device=self.device)
        return self._prefill_ids_buf[bucket]

    def _piece_live(self) -> list[torch.Tensor]:
        """What a piece's capture changes (`graphs.capture` restores it): the KDA and conv states (the MLA rows
        its runs write are the ones its replay writes)."""
        return [self.state.kda, self.state.conv]

    def forward(self, ids: torch.Tensor, state, positions: torch.Tensor, kv_len: int, prefill: bool = False,
                **options):
        """The target's step over ids at positions (`LingForCausalLM.step`'s contract and options: `keep`,
        `normed`, and `stage` for a speculative verify or a staged tail): through `fused` (the fused kernels, the
        lean CPU step, or the fused step's torch references) up to its `max_tokens`, through the model's torch
        step (large GEMMs, chunked KDA, flash MLA) beyond, told with `prefill` that the positions end at kv_len."""
        if self.fused is not None and ids.shape[0] <= self.fused.max_tokens:
            return self.fused.step(ids, state, positions, kv_len, **options)
        return self.model.step(ids, state, positions, kv_len=kv_len, prefill=prefill, **options)

    def _prefill_step(self, ids: torch.Tensor, state, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One piece of a prompt: a short one (a warm prompt's few new tokens; with a swapped-in prefill step,
        the tail's pieces around the end-1 snapshot) through the fused decode kernels, as a verify step runs (a
        graph replay on CUDA with graphs: eagerly its ~400 launches cost the host more than a cold prompt's
        whole first piece takes the GPU), a long one through the model's prefill step (large GEMMs, chunked
        KDA, flash MLA), told that its positions end at kv_len. With a speculative round attached (`attach`),
        the piece runs eagerly and keeps the layers `spec.keep` names, and its drafter absorbs it."""
        if self.spec is not None:
            h, kept = self.forward(ids, state, positions, kv_len, prefill=True, keep=self.spec.keep)
            self.spec.prefill(h, kept, ids, positions, kv_len - ids.shape[0])
            return h
        if (isinstance(self.fused, FusedStep) and ids.shape[0] <= FUSED_MAX_TOKENS and self.use_graphs
                and self.prefill_graphs and state is self.state):
            return self._short_piece(ids, positions, kv_len)
        return self.forward(ids, state, positions, kv_len, prefill=True)

    def _short_piece(self, ids: torch.Tensor, positions: torch.Tensor, kv_len: int,
                     staged: bool = False) -> torch.Tensor:
        """A piece of t <= 16 tokens through its (t, KV bucket, staged) graph (captured on first use): the fused
        step over `piece_ids` at `piece_pos`.., reading the bucket's MLA rows (those past a position are masked,
        as in a decode step); `staged`: the KDA states are left alone and every position's inputs go to
        `_tail_stage(t)`. Returns the t hidden states (the graph's output buffer: read before the next piece)."""
        t = ids.shape[0]
        key = (t, self.bucket(kv_len), staged)
        self.piece_ids[:t].copy_(ids)
        self.piece_pos.copy_(positions[:1])
        return self.piece_graphs.run(key, partial(self._piece_body, *key), self._piece_live())

    def _piece_body(self, t: int, kv_bucket: int, staged: bool) -> torch.Tensor:
        return self.fused.step(self.piece_ids[:t], self.state, self.piece_pos + self.arange_piece[:t], kv_bucket,
                               stage=self._tail_stage(t) if staged else None)

    def _tail_stage(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage buffers for a staged piece of t tokens: ([n_kda, t, H, STAGE_ROWS, D] fp32, [n_kda, t, 3, C]), as
        `kda.commit` takes them (contiguous), viewed from the front of one pair of flat buffers sized for
        FUSED_MAX_TOKENS (allocated once, so the graphs of every t write where the commits read)."""
        kda_state, conv = self.state.kda, self.state.conv
        n, heads, d = kda_state.shape[0], kda_state.shape[1], kda_state.shape[-1]
        kda_shape, conv_shape = (n, t, heads, kda.STAGE_ROWS, d), (n, t, *conv.shape[1:3])
        if self._tail_stage_buf is None:
            per_token = (heads * kda.STAGE_ROWS * d, conv.shape[1] * conv.shape[2])
            self._tail_stage_buf = (
                torch.zeros(n * FUSED_MAX_TOKENS * per_token[0], dtype=torch.float32, device=self.device),
                torch.zeros(n * FUSED_MAX_TOKENS * per_token[1], dtype=conv.dtype, device=self.device))
        flat_kda, flat_conv = self._tail_stage_buf
        return (flat_kda[: math.prod(kda_shape)].view(kda_shape), flat_conv[: math.prod(conv_shape)].view(conv_shape))

    def _staged_tail(self, ids: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """A prompt's last t (2..16) tokens as one fused step with its KDA inputs staged (a graph replay on
        CUDA with graphs), then the KDA and conv states settled at the last token but one, as a speculative
        round settles an accept of t - 1 (`kda.commit`: the staged recurrence replayed over those positions,
        the conv windows rebuilt from the staged inputs). One weight stream instead of the two that a piece up
        to the end-1 snapshot and a one-token piece after it read. Returns the t hidden states; the caller
        snapshots, then `_commit_last_token` brings the states to the prompt's end."""
        t = ids.shape[0]
        if self.use_graphs and self.prefill_graphs:
            h = self._short_piece(ids, positions, kv_len, staged=True)
        else:
            h = self.fused.step(ids, self.state, positions, kv_len, stage=self._tail_stage(t))
        stage_kda, stage_conv = self._tail_stage(t)
        kda.commit(self.arange_piece[t - 2: t - 1], self.state.kda, stage_kda, self.state.conv, stage_conv)
        return h

    def _commit_last_token(self, t: int) -> None:
        """After `_staged_tail` of t tokens (and the snapshot before the last): the states advanced through its
        last staged position (the same recurrence and windows a commit of all t positions would give)."""
        stage_kda, stage_conv = self._tail_stage(t)
        kda.commit(self.arange_piece[:1], self.state.kda, stage_kda[:, t - 1:].contiguous(), self.state.conv,
                   stage_conv[:, t - 1:].contiguous())

    def bucket(self, end: int) -> int:
        """KV rows a step ending at position `end` (exclusive) reads: the next power of two >= min_bucket, so that
        a CUDA graph or a compiled kernel serves many positions; on a CPU, where neither exists, exactly `end`
        (a power-of-two bucket read up to 33% more latent rows there: 2,048 for a 1,537-token sequence)."""
        if self.device.type == "cpu":
            return min(end, self.capacity)
        b = self.min_bucket
        while b < end:
            b *= 2
        return min(b, self.capacity)

    def _body(self, t: int, kv_len: int, greedy: bool) -> None:
        """The fixed-shape step: consume ids[:t] at pos.., choose a token after each into out[:t].

        A decode step (t == 1) also chains: its token becomes the next input and the position advances, in one
        launch with the output's (`kernels.accept.settle_round`, a round without drafts)."""
        positions = self.pos if t == 1 else self.pos + self.arange[:t]  # pos advances only at the step's end
        h, normed = self.forward(self.ids[:t], self.state, positions, kv_len, normed=True)
        local = (self.fused or self.model).head(h, normed)  # this rank's vocab shard
        if greedy:
            tok = argmax_shards(local, self.model.par)
        else:
            tok = sample(self.model.par.all_gather_last(local), positions + 1, False, self.temperature, self.top_p,
                         self.seed)
        if t == 1 and self.scores:
            self.logprob.copy_(chosen_logprob(self.model.par.all_gather_last(local), tok))
        if t == 1:
            accept.settle(tok, self.no_drafts, (self.out[:1], self.ids[:1]), self.pos)
        else:
            self.out[:t].copy_(tok)

    def run_step(self, t: int, kv_len: int, greedy: bool) -> None:
        """Launch one step (a graph replay on CUDA); returns at once, nothing is read back."""
        if not self.use_graphs:
            self._body(t, kv_len, greedy)
            return
        self.graphs.run((t, kv_len, greedy), partial(self._body, t, kv_len, greedy), self.live())

    def live(self) -> list[torch.Tensor]:
        """The tensors a step changes, which a graph capture's runs must leave as they were (`graphs.capture`)."""
        return [self.state.kda, self.state.conv, self.ids, self.pos, self.out, self.logprob]

    @torch.inference_mode()
    def warmup(self, greedy_only: bool = False) -> None:
        """Capture the decode graphs of every KV bucket up front, and run one prefill of a chunk and a bit (then
        forget it), so no request pays for a capture, or for compiling the prefill's kernels (with fla-core,
        for its first-use autotuning: 92 s on an H200, which an editor's first request would not survive)."""
        if not self.use_graphs:
            return
        self.prefill([0] * min(self.prefill_chunk + 16, self.capacity - 1), Sampling())
        self.cache.reset()
        if self.prefill_graphs:
            if self.tail_free:
                self._tail_snapshots()  # its buffers before the captures (an allocation in one would be replayed)
            for bucket in PREFILL_BUCKETS:
                if bucket <= min(self.prefill_chunk, self.capacity):
                    key = (bucket, self.tail_free)
                    self.piece_graphs.capture(key, partial(self._padded_body, *key), self._piece_live())
            self.cache.reset()
        b = self.bucket(1)
        while True:
            for greedy in (True,) if greedy_only else (True, False):
                self.graphs.capture((1, b, greedy), partial(self._body, 1, b, greedy), self.live())
            if isinstance(self.fused, FusedStep):  # the staged tail every cold prompt ends with (`_staged_tail`)
                self.piece_graphs.capture((8, b, True), partial(self._piece_body, 8, b, True), self._piece_live())
            if b >= self.capacity:
                break
            b = self.bucket(b + 1)
        self.cache.reset()
        torch.cuda.synchronize()

    def set_sampling(self, s: Sampling) -> None:
        """Per-request sampling values into the graphs' input buffers (host-to-device, no read back)."""
        self.temperature.fill_(max(s.temperature, 1e-5))
        self.top_p.fill_(s.top_p)
        self.seed.fill_(s.seed & 0xFFFFFFFF)

    # ---- a request ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt: list[int], sampling: Sampling, allowed: torch.Tensor | None = None) -> int:
        """Bring the state to `prompt` (reusing the cached prefix) and choose the first new token on the device
        (into ids[0]; pos = len(prompt)), among the `allowed` tokens ([vocab] bool) when given (token healing).
        Returns how many prompt tokens were reused."""
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.capacity:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of {self.capacity}")
        cache = self.cache
        start = cache.begin(prompt)
        try:
            if len(prompt) - start == 1 and self.spec is None and allowed is None:  # a keystroke after a snapshot
                self.set_sampling(sampling)
                self.ids[:1].fill_(prompt[-1])
                self.pos.fill_(start)
                self.run_step(1, self.bucket(len(prompt)), sampling.greedy)
                cache.tokens.append(prompt[-1])
                cache.snapshot(len(prompt))
                return start
            bounds = sorted(set(cache.snapshot_points(start, len(prompt))
                                + list(range(start + self.prefill_chunk, len(prompt), self.prefill_chunk))
                                + [len(prompt)]))
            # the ids cross to the device once: a copy from pageable memory waits for the stream, so one per
            # piece would make the host wait for every piece before launching the next
            ids = torch.tensor(prompt[start:], dtype=torch.long).to(self.device, non_blocking=True)
            positions = torch.arange(start, len(prompt), device=self.device)
            end = len(prompt)
            own_step = self.prefill_step == self._prefill_step
            first = self.prefill_bucket(end) if self.prefill_graphs and start == 0 and self.spec is None else None
            if (self.tail_free and own_step and first is not None
                    and len(bounds) - 1 <= self._tail_snapshots().ends.shape[0]):
                # a cold prompt in one padded piece, its tail snapshots taken inside it (`tail_free`)
                h = self._padded_piece(ids, end, first, tuple(bounds[:-1]))
                cache.tokens.extend(prompt)
                snaps = self._tail_snapshots()
                for j, p in enumerate(bounds[:-1]):
                    cache.snapshot(p, snaps.kda[:, j], snaps.conv[:, j])
                cache.snapshot(end)
            else:
                # the last piece before the end-1 snapshot and the one token after it as one staged step of the
                # fused kernels; where every piece must be seen (an attached speculative round's drafter absorbs
                # each piece's kept layers; a benchmark's swapped-in step), the tail stays two pieces
                tail = bounds[-3] if len(bounds) >= 3 else start
                staged_tail = (isinstance(self.fused, FusedStep) and self.spec is None and own_step
                               and bounds[-2:] == [end - 1, end] and end - tail <= FUSED_MAX_TOKENS)
                a = start
                for b in bounds[:-2] if staged_tail else bounds:
                    bucket = self.prefill_bucket(b) if self.prefill_graphs and a == 0 and self.spec is None else None
                    if bucket is not None:
                        h = self._padded_piece(ids[:b], b, bucket)
                    else:
                        h = self.prefill_step(ids[a - start:b - start], self.state, positions[a - start:b - start],
                                              kv_len=b)
                    cache.tokens.extend(prompt[a:b])
                    cache.snapshot(b)  # the prompt's end too: the next keystroke usually appends to it
                    a = b
                if staged_tail:
                    h = self._staged_tail(ids[a - start:], positions[a - start:], kv_len=end)
                    cache.tokens.extend(prompt[a:end - 1])
                    cache.snapshot(end - 1)
                    self._commit_last_token(end - a)
                    cache.tokens.append(prompt[-1])
                    cache.snapshot(end)
            self.set_sampling(sampling)
            logits = self.model.par.all_gather_last(self.model.head(h[-1:]))
            if allowed is not None:
                allowed = allowed.to(logits.device, non_blocking=True)[: logits.shape[-1]]
                logits = logits.masked_fill(~allowed, float("-inf"))
            self.pos.fill_(len(prompt))
            self.ids[:1].copy_(sample(logits, self.pos, sampling.greedy, self.temperature, self.top_p, self.seed))
            if self.scores:
                self.logprob.copy_(chosen_logprob(logits, self.ids[:1]))
        except BaseException:
            cache.reset()
            raise
        return start

    def chosen(self) -> int:
        """The token `prefill` chose, read on the host (a sync: for token healing, before the decode loop)."""
        return int(self.ids[0])

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new: int, sampling: Sampling = Sampling()) -> Iterator[int]:
        """Yield up to `max_new` new tokens, each one step late. Stop early by closing the iterator: at most
        the one step already launched runs on (and its token, already in the state, is counted)."""
        self.prefill(prompt, sampling)
        yield from self.decode(max_new, sampling.greedy)

    @torch.inference_mode()
    def decode(self, max_new: int, greedy: bool) -> Iterator[int]:
        """The step loop after `prefill`: launch step j, then read token j (chosen by the step before); with
        `scores`, its log-probability is `token_logprob` when it is yielded."""
        self.token_logprob = None
        if self.spec is not None:
            yield from self.spec.decode(max_new, greedy)
            return
        cache = self.cache
        position = len(cache.tokens)  # host-side mirror of self.pos
        max_new = min(max_new, self.capacity - position)
        self._post(0, self.ids[:1])
        if self.device.type == "cpu":  # steps run synchronously: launching the next one first only delays a token
            yield from self._decode_in_turn(max_new, greedy, position)
            return
        try:
            for j in range(max_new):
                if j + 1 < max_new:  # the last token needs no step after it
                    self.run_step(1, self.bucket(position + 1), greedy)
                    self._post((j + 1) % 2, self.out[:1])
                token = self._read(j % 2)
                if j + 1 < max_new:
                    cache.tokens.append(token)  # the step just launched consumes it
                    position += 1
                yield token
        except GeneratorExit:  # closed by the consumer: the state matches cache.tokens
            raise
        except BaseException:
            cache.reset()
            raise

    def _post(self, slot: int, token: torch.Tensor) -> None:
        """Copy a chosen token (and with `scores` its log-probability) toward the host, to be read one step late."""
        if self.score_fence is not None:
            self.score_fence.post(slot, self.logprob)
        self.fence.post(slot, token)

    def _read(self, slot: int) -> int:
        """The token posted into `slot`, once its step is done (its log-probability into `token_logprob`)."""
        (token,) = self.fence.read(slot)
        if self.score_fence is not None:
            (self.token_logprob,) = self.score_fence.read(slot)
        return token

    def _decode_in_turn(self, max_new: int, greedy: bool, position: int) -> Iterator[int]:
        """`decode` where a step computes before it returns (the CPU): token j is handed over as soon as it
        exists, and the step that consumes it runs when token j + 1 is asked for (none after the last one read)."""
        cache = self.cache
        try:
            for j in range(max_new):
                token = self._read(j % 2)
                yield token
                if j + 1 < max_new:  # token j + 1 is asked for: the step that consumes token j chooses it
                    self.run_step(1, self.bucket(position + 1), greedy)
                    cache.tokens.append(token)
                    position += 1
                    self._post((j + 1) % 2, self.out[:1])
        except GeneratorExit:  # closed by the consumer: the state matches cache.tokens
            raise
        except BaseException:
            cache.reset()
            raise
