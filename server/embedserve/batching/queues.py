"""Requests in flight, their rows waiting in length buckets, and the batch those rows become.

A request's rows that share a bucket arrive pre-stacked as one tensor (a Chunk); a batch is
concatenated from slices of chunks. Everything here runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Iterable

import numpy as np
import torch

from embedserve.batching.decisions import BucketView
from embedserve.model.batches import Batch
from embedserve.model.states_rows import StatesRows


class PendingRequest:
    """One request's future and, when its rows come back in pieces, the buffer they land in."""

    __slots__ = ("rows", "dim", "out", "remaining", "future", "chunks", "tokens", "trace", "norms", "states")

    def __init__(self, rows: int, dim: int, future: asyncio.Future, trace=None):
        self.rows, self.dim = rows, dim
        self.trace = trace  # a traced request's stamps (embedserve.tracing.Recorder), else None
        self.out: np.ndarray | list | None = None  # allocated at a first delivery of only some rows (ragged: the pieces)
        self.remaining = rows
        self.future = future
        self.chunks: list[Chunk] = []  # its rows' chunks, as queued (BucketQueues.add)
        self.tokens = 0  # real tokens queued (usage), known once its rows are
        # A windowed request's (embedserve.batching.windows): each row's norm before the model's
        # Normalize, filled as its rows come back from a model that reports them (Batch.norms).
        self.norms: np.ndarray | None = None
        # It asked for its rows' token states (TEI's /embed_all: embedserve.model.states_rows).
        self.states = False

    @property
    def done(self) -> bool:
        return self.future.done()

    def deliver(self, positions: np.ndarray, values: np.ndarray) -> None:
        """Rows `positions` (ascending) computed as `values`, a view of a batch's output (a
        runner returns a new array per batch). All of a request's rows at once, the usual
        case, are its result as they are: no buffer, no copy."""
        if self.future.done():  # cancelled or failed meanwhile: nobody is waiting
            return
        if isinstance(values, StatesRows):  # an embed batch some of whose rows asked for token states
            values = values.side(self.states)
        if len(positions) == self.rows:
            self.remaining = 0
            self.future.set_result(values)
            return
        if not isinstance(values, np.ndarray):
            # Ragged rows (SPLADE's SparseRows, multi-vector TokenRows, ...): the pieces stay as
            # they came until the last one, then the type gathers them in the request's order.
            self.out = (self.out or []) + [(positions, values)]
            self.remaining -= len(positions)
            if self.remaining == 0:
                self.future.set_result(type(values).gather(self.out, self.rows, values.dim))
            return
        if self.out is None:
            self.out = np.empty((self.rows, self.dim), dtype=np.float32)
        self.out[positions] = values
        self.remaining -= len(positions)
        if self.remaining == 0:
            self.future.set_result(self.out)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


@dataclasses.dataclass(eq=False)
class Chunk:
    """Rows of one request that fall in one bucket: ids[i, :lengths[i]] is row positions[i]."""

    request: PendingRequest
    ids: np.ndarray  # [n, width] int32, right-padded
    lengths: np.ndarray  # [n] int
    positions: np.ndarray  # [n] row index in the request's output
    bucket: int = 0  # where its rows queue (BucketQueues.add)
    queued_rows: int = 0  # of its rows, still in the queue (not taken into a batch, not dropped)
    queued_tokens: int = 0
    dropped: bool = False  # its request ended early: its rows left the count, the queue drops them lazily


class QueuedRow:
    __slots__ = ("chunk", "index", "length", "enqueued")

    def __init__(self, chunk: Chunk, index: int, length: int, enqueued: float):
        self.chunk, self.index, self.length, self.enqueued = chunk, index, length, enqueued


class BucketQueues:
    """FIFO row queues per bucket length, with the queued (real) token count kept exact. A dropped
    request's rows leave the count at once and the queue at the next look (`views`): one pass per
    look, however many requests were cancelled since (one pass per cancellation was quadratic
    under mass cancellation on a deep queue)."""

    def __init__(self, buckets: Iterable[int]):
        self.rows: dict[int, list[QueuedRow]] = {b: [] for b in buckets}
        self.queued_tokens = 0
        self._dead: set[int] = set()  # buckets whose lists still hold rows of dropped requests

    def add(self, bucket: int, chunk: Chunk, now: float) -> int:
        """Queue a chunk's rows as of `now`; returns their real tokens. A queue's times never
        decrease (the drain and the reorder window read its first row as its oldest): rows
        stamped earlier than the last one queued (admitted, then tokenized later with others)
        take its time."""
        q = self.rows[bucket]
        if q and q[-1].enqueued > now:
            now = q[-1].enqueued
        lengths = chunk.lengths.tolist()
        q.extend(QueuedRow(chunk, i, n, now) for i, n in enumerate(lengths))
        added = sum(lengths)
        chunk.bucket, chunk.queued_rows, chunk.queued_tokens = bucket, len(lengths), added
        chunk.request.chunks.append(chunk)  # how `drop` finds its rows
        self.queued_tokens += added
        return added

    def purge(self) -> None:
        """Rows of dropped requests leave the lists: `rows` holds live ones until the next drop."""
        for b in self._dead:
            self.rows[b] = [r for r in self.rows[b] if not r.chunk.dropped]
        self._dead.clear()

    def views(self, caps: dict[int, int]) -> list[BucketView]:
        """Each bucket as the batcher decides on it (purged first)."""
        self.purge()
        return [
            BucketView(b, len(q), q[0].enqueued if q else 0.0, caps[b]) for b, q in self.rows.items()
        ]

    def head(self, bucket: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, enqueue times) of the bucket's first `limit` rows, oldest first."""
        q = self.rows[bucket][:limit]
        return np.fromiter((r.length for r in q), np.int64, len(q)), np.fromiter((r.enqueued for r in q), np.float64, len(q))

    def take(self, bucket: int, indices: list[int]) -> list[QueuedRow]:
        q = self.rows[bucket]
        keep = set(indices)
        taken = [q[i] for i in indices]
        self.rows[bucket] = [r for i, r in enumerate(q) if i not in keep]
        for r in taken:
            r.chunk.queued_rows -= 1
            r.chunk.queued_tokens -= r.length
        self.queued_tokens -= sum(r.length for r in taken)
        return taken

    def drop(self, request: PendingRequest) -> int:
        """Forget a finished (cancelled, failed) request's queued rows; returns the tokens freed.
        Its own chunks only: no scan of the queues."""
        freed = 0
        for chunk in request.chunks:
            if chunk.queued_rows and not chunk.dropped:
                chunk.dropped = True
                self._dead.add(chunk.bucket)
                freed += chunk.queued_tokens
                chunk.queued_rows = chunk.queued_tokens = 0
        self.queued_tokens -= freed
        return freed


def assemble(taken: list[QueuedRow], pad_id: int, pad_to: int | None, batch_to: int | None) -> Batch:
    """Concatenate the taken rows into one padded batch; rows of one chunk are copied with one
    indexed slice. `pad_to`/`batch_to` fix the shape for captured graphs; otherwise the batch
    pads to its own longest row and has no dummy rows. Runs on the event loop, once per chunk:
    numpy here, since a torch op costs ~10x a numpy one on tensors this small (a batch of 256
    single-text requests took 18 ms with torch ops, bench in the commit that changed it)."""
    width = pad_to or max(r.length for r in taken)
    n = len(taken)
    total = batch_to or n
    ids = np.full((total, width), pad_id, dtype=np.int64)
    lengths = [1] * total  # dummy rows attend to one token: none fully masked
    routes = []
    groups: dict[int, list[QueuedRow]] = {}
    for r in taken:
        groups.setdefault(id(r.chunk), []).append(r)
    pos = 0
    for rows in groups.values():
        chunk, k = rows[0].chunk, len(rows)
        w = min(width, chunk.ids.shape[1])
        if k == 1:  # a single-text request: basic slicing, no index arrays
            i = rows[0].index
            ids[pos, :w] = chunk.ids[i, :w]
            positions = chunk.positions[i : i + 1]
        else:
            idx = [r.index for r in rows]
            ids[pos : pos + k, :w] = chunk.ids[idx, :w]
            positions = chunk.positions[idx]
        lengths[pos : pos + k] = [r.length for r in rows]
        routes.append((chunk.request, positions, slice(pos, pos + k)))
        pos += k
    mask = np.arange(width) < np.array(lengths)[:, None]
    ids[~mask] = pad_id
    return Batch(torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64)), n, sum(r.length for r in taken),
                 routes)
