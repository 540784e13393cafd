"""The batching engine: token rows in, embeddings out. Rows wait in length buckets; one asyncio
task (the batcher) drains them by priority into the model worker's queue; results come back
from the worker thread and are routed to each request's rows, in order."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import numpy as np
import torch

from embedserve.batching import choose_bucket, fit_length, ladder_size, length_ladder, next_drain, select_rows
from embedserve.errors import ModelFailure
from embedserve.estimator import Estimator
from embedserve.queues import Batch, BucketQueues, Chunk, PendingRequest, assemble
from embedserve.worker import ModelWorker, Runner, WarmupPlan, WarmupResult

log = logging.getLogger(__name__)

# Consecutive failed batches after which the server reports itself unhealthy (a wedged device
# should be restarted by its liveness probe); one good batch clears it.
FAILING_AFTER = 3



class Engine:
    def __init__(
        self,
        plan: WarmupPlan,
        load: Callable[[], Runner],
        estimator: Estimator,
        deadline_s: float,
        worker_queue_size: int,
        lookahead: int = 2,
        clock: Callable[[], float] = time.monotonic,
        on_batch: Callable[[Batch, float], None] = lambda batch, busy_s: None,
        on_failing: Callable[[bool], None] = lambda failing: None,
    ):
        self.plan = plan
        self.on_batch = on_batch
        self.on_failing = on_failing  # called when consecutive failures cross FAILING_AFTER, and back
        self.estimator = estimator
        self.deadline_s = deadline_s
        self.clock = clock
        self.queues = BucketQueues(plan.buckets)
        self.lengths = length_ladder(plan.buckets)  # static shapes' padded lengths
        # Batches formed ahead of the running one. A GPU wants two (the host prepares while the
        # device computes); a CPU has nothing to overlap, and a batch formed later is fuller.
        self.lookahead = lookahead
        self.worker = ModelWorker(load, plan, self._report_from_worker, max(worker_queue_size, lookahead + 1))
        self.caps: dict[int, int] = {}
        self.warmup: WarmupResult | None = None
        self.dim = 0
        self.in_worker = 0  # batches submitted and not yet reported
        self.failed_batches = 0  # consecutive; reset by a good batch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def failing(self) -> bool:
        return self.failed_batches >= FAILING_AFTER

    @property
    def ready(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Load and warm up the model on the worker thread, then start batching."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.worker.start()
        await self._loop.run_in_executor(None, self.worker.started.wait)
        if self.worker.failure is not None:
            raise self.worker.failure
        self.warmup = self.worker.warmup
        self.caps = self.warmup.caps
        self.dim = self.worker.runner.dim
        self.estimator.seed_service_rate(self.warmup.service_rate)
        log.info("batch caps per bucket: %s", self.caps)
        self._task = asyncio.create_task(self._batcher(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop, 10.0)

    def submit(self, ids: torch.Tensor, lengths: np.ndarray) -> PendingRequest:
        """Queue one request's rows (ids [n, w] int32, right-padded; lengths <= largest bucket).
        Await `.future` for the [n, dim] float32 result."""
        request = PendingRequest(len(lengths), self.dim, self._loop.create_future())
        now = self.clock()
        added = 0
        for bucket, positions in split_by_bucket(lengths, self.plan.buckets):
            width = min(ids.shape[1], bucket)
            if positions[-1] - positions[0] + 1 == len(positions):  # contiguous: a view, no copy
                rows = ids[positions[0] : positions[-1] + 1, :width]
            else:
                rows = ids[torch.from_numpy(positions), :width]
            chunk = Chunk(request, rows, lengths[positions], positions)
            request.chunks.append(chunk)
            added += self.queues.add(bucket, chunk, now)
        self.estimator.enqueued(added)
        self._wake.set()
        return request

    def drop(self, request: PendingRequest) -> None:
        """Forget a request that ended early (cancelled, deadline, failed): its queued rows never
        reach the model and leave the backlog now."""
        freed = self.queues.drop(request)
        if freed:
            self.estimator.dequeued(freed)

    async def _batcher(self) -> None:
        while True:
            self._wake.clear()
            timeout = self._form_batches()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _form_batches(self) -> float | None:
        """Submit batches while the decision says so; → seconds until the next look (None:
        wait for news)."""
        while self.in_worker <= self.lookahead:
            now = self.clock()
            drain = next_drain(self.queues.views(self.caps), now, self.deadline_s, self.in_worker == 0)
            if drain.bucket is None:
                return None if drain.wake_at is None else max(0.0, drain.wake_at - now)
            self.worker.submit(self._form(drain.bucket))
            self.in_worker += 1
        return None

    def _form(self, bucket: int) -> Batch:
        static = self.plan.static
        lengths = [r.length for r in self.queues.rows[bucket]]
        chosen = select_rows(lengths, self.caps[bucket], self.plan.max_tokens_per_batch, bucket if static else None)
        taken = self.queues.take(bucket, chosen)
        if not static:
            return assemble(taken, self.plan.pad_id, None, None)
        width = fit_length(max(r.length for r in taken), self.lengths)
        return assemble(taken, self.plan.pad_id, width, ladder_size(len(taken)))

    def _report_from_worker(self, batch: Batch, out, busy_s: float) -> None:
        self._loop.call_soon_threadsafe(self._deliver, batch, out, busy_s)

    def _deliver(self, batch: Batch, out, busy_s: float) -> None:
        self.in_worker -= 1
        self.estimator.computed(batch.real_tokens, busy_s)
        self.on_batch(batch, busy_s)
        if isinstance(out, BaseException):
            self.failed_batches += 1
            if self.failed_batches == FAILING_AFTER:
                self.on_failing(True)
            for request, _, _ in batch.routes:
                request.fail(ModelFailure(f"model failed on this request's batch: {out}"))
                self.drop(request)
        else:
            if self.failed_batches >= FAILING_AFTER:
                self.on_failing(False)
            self.failed_batches = 0
            for request, positions, rows in batch.routes:
                request.deliver(positions, out[rows])
        self._wake.set()


def split_by_bucket(lengths: np.ndarray, buckets) -> list[tuple[int, np.ndarray]]:
    """Group a request's rows by the smallest bucket that holds each (positions ascending)."""
    if len(lengths) == 1:  # the usual request: numpy's per-call cost is most of the work
        return [(choose_bucket(int(lengths[0]), buckets), np.zeros(1, dtype=np.int64))]
    index = np.minimum(np.searchsorted(buckets, lengths, side="left"), len(buckets) - 1)
    if index.min() == index.max():  # texts of one size class: no grouping
        return [(buckets[int(index[0])], np.arange(len(lengths)))]
    return [(buckets[k], np.flatnonzero(index == k)) for k in np.unique(index)]
