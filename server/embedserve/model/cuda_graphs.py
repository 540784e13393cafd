"""CUDA graphs of the forward pass, one per input shape, captured on first sight and replayed
after. A replay launches the whole model as one graph: the per-kernel launch cost, which
dominates small batches on a fast GPU, is paid once at capture. Static shapes (buckets × the
batch ladder, or packed rows' total-token ladder) keep the set of graphs small; all of them
share one memory pool, since the model worker runs one batch at a time. The forward takes
tensors (copied into a graph's static inputs at each replay) and plain values (fixed per
graph: part of its key)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import torch

log = logging.getLogger(__name__)

Forward = Callable[..., torch.Tensor]

# Eager runs before a capture: the first lazily initialises cuBLAS handles, workspaces and
# (under torch.compile) compiles; the second shows the allocator the steady-state pattern.
WARMUP_RUNS = 2


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple  # static inputs: a replay reads whatever was copied into the tensors here
    out: torch.Tensor  # static output: overwritten by the next replay of any graph in the pool


class CudaGraphs:
    """`graphs(*args)`: host (ideally pinned) tensors and plain values → the forward's output on
    the device. The result is valid until the next call: copy it out first."""

    def __init__(self, forward: Forward, device: torch.device):
        self._forward = forward
        self._device = device
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple, _Graph] = {}

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The first input's shape of each captured graph."""
        return sorted(tuple(key[0]) for key in self._graphs)

    def __call__(self, *args) -> torch.Tensor:
        key = tuple(a.shape if isinstance(a, torch.Tensor) else a for a in args)
        g = self._graphs.get(key) or self._capture(key, args)
        for static, a in zip(g.inputs, args):
            if isinstance(a, torch.Tensor):
                static.copy_(a, non_blocking=True)
        g.graph.replay()
        return g.out

    def _capture(self, key: tuple, args: tuple) -> _Graph:
        t0 = time.perf_counter()
        # The first batch of this shape is the capture's input: its warm-up runs compute on
        # real values (a packed stream's row bounds must be consistent, zeros would not be).
        inputs = tuple(a.to(self._device, copy=True) if isinstance(a, torch.Tensor) else a for a in args)
        # Warm-up off the default stream, as torch.cuda.graph requires of the captured work.
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(WARMUP_RUNS):
                self._forward(*inputs)
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this (the model worker's) thread must not make capture-unsafe calls.
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._forward(*inputs)
        g = self._graphs[key] = _Graph(graph, inputs, out)
        log.debug("captured a CUDA graph for %s in %.0f ms", key, (time.perf_counter() - t0) * 1000)
        return g
