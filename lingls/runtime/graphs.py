"""CUDA graphs of fixed-shape bodies: each captured once per key, then replayed (the runner's decode and verify
steps, a prompt's padded first piece, its short pieces and staged tail, a speculative round's draft and verify
phases).

Capturing a body runs it twice: once eagerly on a side stream (so every kernel is compiled and autotuned before
the capture, which must not allocate or synchronise), then under capture. Both runs change what the body writes
(the model's states, the step's input and output buffers), so the caller names those tensors (`live`) and they
are saved before and restored after. The graphs of one set share a memory pool: an output a body returns lives
in that pool, so it must be read before another graph of the same set replays.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch


def capture(body: Callable[[], object], live: list[torch.Tensor], pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Capture `body` as a CUDA graph in memory pool `pool` (a `torch.cuda.graph_pool_handle()`, or None for one
    of its own), leaving the `live` tensors as they were. Returns (graph, what the captured body returned)."""
    saved = [x.clone() for x in live]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    for dst, src in zip(live, saved):
        dst.copy_(src)
    return graph, out


class GraphSet:
    """Bodies keyed by their shape, as graphs in one memory pool. (Where graphs are off, on a CPU or by choice,
    callers run the body itself instead.)"""

    def __init__(self, shares: GraphSet | None = None):
        """shares: another set whose memory pool this one's graphs use (a speculative round's phases, run in
        turn with the runner's steps: never two at once)."""
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Hashable, object] = {}
        self._shares = shares
        self._pool = None

    @property
    def pool(self):
        """The memory pool of this set's graphs (made on first use)."""
        if self._shares is not None:
            return self._shares.pool
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def __contains__(self, key: Hashable) -> bool:
        return key in self.graphs

    def capture(self, key: Hashable, body: Callable[[], object], live: list[torch.Tensor]) -> None:
        """Capture `body` under `key` now (`warmup`: before any request), unless it already is."""
        if key in self.graphs:
            return
        self.graphs[key], self.outputs[key] = capture(body, live, self.pool)

    def run(self, key: Hashable, body: Callable[[], object], live: list[torch.Tensor]):
        """Launch `body` as the replay of its graph (captured on first use). Returns what the captured body returned:
        its output tensors, rewritten by each replay."""
        self.capture(key, body, live)
        self.graphs[key].replay()
        return self.outputs[key]
