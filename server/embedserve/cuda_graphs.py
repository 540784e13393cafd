"""CUDA graphs of the forward pass, one per input shape, captured on first sight and replayed
after. A replay launches the whole model as one graph: the per-kernel launch cost, which
dominates small batches on a fast GPU, is paid once at capture. Static shapes (buckets × the
batch ladder) keep the set of graphs small; all of them share one memory pool, since the model
worker runs one batch at a time."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import torch

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Eager runs before a capture: the first lazily initialises cuBLAS handles, workspaces and
# (under torch.compile) compiles; the second shows the allocator the steady-state pattern.
WARMUP_RUNS = 2


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # static inputs: a replay reads whatever was copied here
    mask: torch.Tensor
    out: torch.Tensor  # static output: overwritten by the next replay of any graph in the pool


class CudaGraphs:
    """`graphs(ids, mask)` with host (ideally pinned) int64 tensors → the forward's output on
    the device. The result is valid until the next call: copy it out first."""

    def __init__(self, forward: Forward, device: torch.device):
        self._forward = forward
        self._device = device
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], _Graph] = {}

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        g = self._graphs.get(tuple(ids.shape)) or self._capture(tuple(ids.shape))
        g.ids.copy_(ids, non_blocking=True)
        g.mask.copy_(mask, non_blocking=True)
        g.graph.replay()
        return g.out

    def _capture(self, shape: tuple[int, int]) -> _Graph:
        t0 = time.perf_counter()
        ids = torch.zeros(shape, dtype=torch.int64, device=self._device)
        mask = torch.ones(shape, dtype=torch.int64, device=self._device)
        # Warm-up off the default stream, as torch.cuda.graph requires of the captured work.
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(WARMUP_RUNS):
                self._forward(ids, mask)
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this (the model worker's) thread must not make capture-unsafe calls.
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._forward(ids, mask)
        g = self._graphs[shape] = _Graph(graph, ids, mask, out)
        log.debug("captured a CUDA graph for %s in %.0f ms", shape, (time.perf_counter() - t0) * 1000)
        return g
