"""The batching engine: token rows in, embeddings out. Rows wait in length buckets; the batcher
(a callback on the event loop, run once per turn in which rows arrived or a batch finished, and
at the oldest row's deadline) drains them by priority into the model worker's queue; results
come back from the worker thread and are routed to each request's rows, in order. Padded rows: a batch
takes one bucket's rows; packed rows (a runner of `attention = "packed"`): a batch takes the
oldest rows of every bucket up to a token budget."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from typing import Callable

import numpy as np

from embedserve.batching.decisions import choose_bucket, next_drain, next_packed_drain, pack_rows, reorder_window, room, select_rows, within_window
from embedserve.model.shapes import fit_length, ladder_size, length_ladder
from embedserve.errors import DeviceUnresponsive, ModelFailure, NotReady
from embedserve.admission.estimator import Estimator
from embedserve.batching.packing import assemble_packed
from embedserve.model.batches import PackedBatch
from embedserve.model.states_rows import asked
from embedserve.batching.queues import BucketQueues, Chunk, PendingRequest, assemble
from embedserve.model.batches import Batch
from embedserve.threads import in_daemon_thread
from embedserve.model.device import Device
from embedserve.model.worker import ModelWorker, Runner, Warm, WarmupPlan, WarmupResult, Watchdog, warm_up

log = logging.getLogger(__name__)

# Consecutive failed batches after which the server reports itself unhealthy (a wedged device
# should be restarted by its liveness probe); one good batch clears it.
FAILING_AFTER = 3
# While the worker is full, requests waiting to be tokenized (embedserve.batching.intake) are queued this
# long after the first of them, together: off the path between two batches (where the device
# would wait for it), and still several per call of the tokenizer at a busy server's rates.
FEED_DELAY_S = 0.001



class Engine:
    def __init__(
        self,
        plan: WarmupPlan,
        load: Callable[[], Runner],
        estimator: Estimator,
        deadline_s: float,
        worker_queue_size: int,
        max_drain_s: float = math.inf,
        lookahead: int = 2,
        clock: Callable[[], float] = time.monotonic,
        on_batch: Callable[[Batch, float], None] = lambda batch, busy_s: None,
        on_failing: Callable[[bool], None] = lambda failing: None,
        on_lost: Callable[[], None] = lambda: None,
        watchdog: Watchdog = Watchdog(),
        feed_delay_s: float = FEED_DELAY_S,
        warm: Warm = warm_up,
        device: Device | None = None,
    ):
        self.plan = plan
        self.watchdog = watchdog
        self.on_batch = on_batch
        self.on_failing = on_failing  # called when consecutive failures cross FAILING_AFTER, and back
        # Called once this engine serves nothing more (`lost`), what waited failed: callers held
        # for booked room (gate.Gate) are woken then to be refused, not at a moment no batch brings.
        self.on_lost = on_lost
        self.estimator = estimator
        self.deadline_s = deadline_s
        self.max_drain_s = max_drain_s  # the admission budget the reorder window is held back from
        self.window_s = deadline_s  # batching.decisions.reorder_window, sized by the warm-up
        self.clock = clock
        self.queues = BucketQueues(plan.buckets)
        self.lengths = length_ladder(plan.buckets)  # static shapes' padded lengths
        # Batches formed ahead of the running one. A GPU wants two (the host prepares while the
        # device computes); a CPU has nothing to overlap, and a batch formed later is fuller.
        self.lookahead = lookahead
        self.device = device  # shared with other models' engines (MODELS), else None
        self.worker = ModelWorker(load, plan, self._report_from_worker, max(worker_queue_size, lookahead + 1),
                                  warm, device)
        self.caps: dict[int, int] = {}
        self.warmup: WarmupResult | None = None
        self.dim = self.states_dim = 0
        self.in_worker = 0  # batches submitted and not yet reported
        self.failed_batches = 0  # consecutive; reset by a good batch
        self.hung = False  # a batch outran the watchdog: the device is lost until a restart
        self.broken: str | None = None  # what failed for good (the batcher, the worker): served no more
        self._loop: asyncio.AbstractEventLoop | None = None
        # The batcher is a loop callback, not a task: a task waiting on an event with a timeout
        # costs a future and a timer per wake, and it woke once per request.
        self._batching = False  # started, not stopped, not broken
        self._looking = False  # a look at the queues is scheduled for this turn of the loop
        self._timer: asyncio.TimerHandle | None = None  # the next deadline's look
        self._timer_at: float | None = None  # ... at this time of self.clock
        self._watch: asyncio.Task | None = None
        self._forming: list = []  # rows taken for the batch being formed (failed with the rest if that fails)
        # Called before each batch is formed, to queue the rows of requests that wait to be
        # tokenized together (embedserve.batching.intake, which reports them with `arriving`).
        self.feed: Callable[[], None] = lambda: None
        self._arriving = [0, 0.0]  # rows and estimated tokens fed since the last look
        self._feeding: asyncio.TimerHandle | None = None  # the feed `arriving` scheduled
        self.feed_delay_s = feed_delay_s
        self._room = (0, 0.0)  # rows and tokens that may arrive before a bucket could be full
        self._batch_ids = itertools.count(1)  # a batch's id, as its requests' traces name it

    @property
    def failing(self) -> bool:
        return self.hung or self.broken is not None or self.failed_batches >= FAILING_AFTER

    @property
    def lost(self) -> NotReady | None:
        """What every request gets once this engine serves nothing more until a restart (None:
        it serves, or will once started)."""
        if self.hung:
            return DeviceUnresponsive("the model's device stopped responding; this server will be restarted")
        if self.broken is not None:
            return NotReady(f"{self.broken}; this server will be restarted")
        return None

    @property
    def packing(self):
        """How packed batches are shaped (a PackSpec), or None for padded rows; known after start."""
        return self.warmup.packing if self.warmup else None

    @property
    def attention(self) -> str:
        """The layout the model runs ("packed" or "padded"), as /health reports it."""
        return "packed" if self.packing else "padded"

    @property
    def ready(self) -> bool:
        return self._batching

    async def start(self) -> None:
        """Load and warm up the model on the worker thread, then start batching."""
        self._loop = asyncio.get_running_loop()
        self.worker.start()
        await in_daemon_thread(self.worker.started.wait, name="warm-up-wait")
        if self.worker.failure is not None:
            raise self.worker.failure
        self.warmup = self.worker.warmup
        self.dim = self.worker.runner.dim
        # Each token state's width, where a row may ask for them (TEI's /embed_all; else 0).
        self.states_dim = getattr(self.worker.runner, "states_dim", 0)
        self.estimator.seed_service_rate(self.warmup.service_rate)
        # No drain budget (throughput admission off): no bound to keep, batches choose freely.
        self.window_s = (reorder_window(self.deadline_s, self.max_drain_s, self.warmup.largest_batch_s)
                         if math.isfinite(self.max_drain_s) else math.inf)
        log.info("reorder window %.0f ms: no batch carries a row admitted later than that after its oldest",
                 1000 * self.window_s)
        if self.deadline_s > self.window_s:
            log.warning("DEADLINE_WAIT_MS (%.0f) is above half of MAX_DRAIN_TIME_MS: accepted requests may take "
                        "up to %.0f ms longer than the drain budget and their batch", 1000 * self.deadline_s,
                        1000 * (self.deadline_s - self.window_s))
        if self.packing:  # any row may join a batch: every bucket is "full" at the row cap
            self.caps = {b: self.packing.max_rows for b in self.plan.buckets}
        else:
            self.caps = self.warmup.caps
            log.info("batch caps per bucket: %s", self.caps)
        self._batching = True
        self._watch = asyncio.create_task(self._watchdog(), name="watchdog")

    async def stop(self) -> None:
        started, self._batching = self._watch is not None, False
        self._set_timer(None)
        if self._feeding is not None:
            self._feeding.cancel()
            self._feeding = None
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if started and not self.hung:  # a worker warming up or hung is not waited for
            await in_daemon_thread(self.worker.stop, 10.0, name="worker-stop")

    def submit(self, ids: np.ndarray, lengths: np.ndarray, trace=None) -> PendingRequest:
        """Queue one request's rows (ids [n, w] int32, right-padded; lengths <= largest bucket).
        Await `.future` for the [n, dim] float32 result. `trace`: its stamps (a traced request)."""
        request = self.new_request(len(lengths), trace)
        self.enqueue(request, ids, lengths)
        self.look_soon()
        return request

    def new_request(self, rows: int, trace=None) -> PendingRequest:
        """A request whose rows are queued later (`enqueue`), e.g. once tokenized with others."""
        self.check_open()
        return PendingRequest(rows, self.dim, self._loop.create_future(), trace)

    def enqueue(self, request: PendingRequest, ids: np.ndarray, lengths: np.ndarray,
                admitted: float | None = None) -> None:
        """Queue a request's rows into the buckets, as of `admitted` (default now: a request
        tokenized with others keeps its place in time). Numpy until a batch is assembled: a
        torch op costs ~10x a numpy one on arrays this small, on the event loop, per request."""
        now = self.clock() if admitted is None else admitted
        # A request's rows all ask alike (its tokenizer's flags): this bit is only ever read of an
        # embed batch's output (StatesRows); another task's bit there means something else.
        request.states = bool(ids.size and asked(ids[0, 0]))
        added = 0
        for bucket, positions in split_by_bucket(lengths, self.plan.buckets):
            width = min(ids.shape[1], bucket)
            if positions[-1] - positions[0] + 1 == len(positions):  # contiguous: a view, no copy
                rows = ids[positions[0] : positions[-1] + 1, :width]
            else:
                rows = ids[positions, :width]
            added += self.queues.add(bucket, Chunk(request, rows, lengths[positions], positions), now)
        request.tokens = added
        self.estimator.enqueued(added)
        if request.trace is not None:
            request.trace.queued_now()

    def drop(self, request: PendingRequest) -> None:
        """Forget a request that ended early (cancelled, deadline, failed): its queued rows never
        reach the model and leave the backlog now."""
        freed = self.queues.drop(request)
        if freed:
            self.estimator.dequeued(freed)

    def arriving(self, rows: int, tokens: float) -> None:
        """Rows admitted that `feed` will queue (stamped with their admission time). Looked at
        now only if they can change what the batcher does: the worker is idle, no deadline is
        ahead, or they could fill a bucket (packed rows: by their estimated tokens). Otherwise
        the next finished batch or deadline looks, and queues them with every request arriving
        meanwhile; the deadline ahead is an older row's, so none of theirs passes unseen. While
        the worker is full they are queued `feed_delay_s` after the first of them, off the path
        between two batches (where the device would wait for it)."""
        self._arriving[0] += rows
        self._arriving[1] += tokens
        if self.in_worker > self.lookahead:
            if self._feeding is None:
                self._feeding = self._loop.call_later(self.feed_delay_s, self._feed_now)
        elif (self.in_worker == 0 or self._timer is None or self._arriving[0] >= self._room[0]
              or self._arriving[1] >= self._room[1]):
            self.look_soon()

    def _feed_now(self) -> None:
        self._feeding = None
        if self._batching and not self.hung:
            self.feed()

    def check_open(self) -> None:
        """Raise what a request gets from an engine that will not compute it."""
        if (error := self.lost) is not None:
            raise error
        if not self._batching:
            raise NotReady("the model is not serving")

    def look_soon(self) -> None:
        """Look at the queues once this turn of the loop is done, however many rows arrive in it."""
        if self._batching and not self._looking:
            self._looking = True
            self._loop.call_soon(self._look)

    def _look(self) -> None:
        self._looking = False
        if not self._batching:
            return
        try:
            wake_at = self._form_batches()
        except Exception:  # a bug here stops all batching: say so, loudly, and to every probe
            log.exception("the batcher failed; this server serves nothing more")
            # What waits was never computed: UNAVAILABLE, as for the worker's end, so a client
            # retries it on another pod (INTERNAL is not retried, though nothing was tried).
            self._lose("the server's batcher failed")
            return
        self._set_timer(wake_at)

    def _set_timer(self, at: float | None) -> None:
        """Look again at `at` (None: only on news). The deadline ahead rarely moves as rows
        arrive (it is the oldest row's), so the timer is kept unless it does."""
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = None if at is None else self._loop.call_later(max(0.0, at - self.clock()), self._deadline)

    def _deadline(self) -> None:
        self._timer = self._timer_at = None
        self._look()

    def _form_batches(self) -> float | None:
        """Submit batches while the decision says so; → when (self.clock) to look again, None
        for on news only (rows arriving, a batch finishing)."""
        while self.in_worker <= self.lookahead and not self.hung:
            self.feed()
            self._arriving = [0, 0.0]
            now = self.clock()
            # Idle: nothing of this model's in flight and, shared, nobody's on the device either (a
            # busy device is no reason to send a batch before it fills).
            views = self.queues.views(self.caps)
            idle = self.in_worker == 0 and (self.device is None or self.device.idle)
            if self.packing:
                drain = next_packed_drain(views, now, self.deadline_s, idle, self.queues.queued_tokens,
                                          self.warmup.token_budget, self.packing.max_rows)
            else:
                drain = next_drain(views, now, self.deadline_s, idle)
            if drain.bucket is None:
                self._room = room(views, self.packing.max_rows, self.queues.queued_tokens, self.warmup.token_budget) \
                    if self.packing else room(views)
                return drain.wake_at
            batch = self._form_packed() if self.packing else self._form(drain.bucket)
            batch.id, batch.formed = next(self._batch_ids), time.monotonic()
            if self.device is not None:  # shared: the batch due first runs first (model.device)
                batch.due = min(r.enqueued for r in self._forming) + (
                    self.max_drain_s if math.isfinite(self.max_drain_s) else self.deadline_s)
            self.worker.submit(batch)
            self.in_worker += 1
            self._forming = []
        return None

    def _form(self, bucket: int) -> Batch:
        static = self.plan.static
        rows = self.queues.rows[bucket]
        lengths = [r.length for r in rows[: within_window(rows, self.window_s)]]
        chosen = select_rows(lengths, self.caps[bucket], self.plan.max_tokens_per_batch, bucket if static else None)
        taken = self._forming = self.queues.take(bucket, chosen)
        if not static:
            return assemble(taken, self.plan.pad_id, None, None)
        width = fit_length(max(r.length for r in taken), self.lengths)
        return assemble(taken, self.plan.pad_id, width, ladder_size(len(taken)))

    def _form_packed(self) -> PackedBatch:
        """The oldest rows of all buckets up to the token budget (batching.pack_rows). Of each
        bucket only the first rows are looked at, as many as could fit the budget and the row cap
        (a GPU's queue holds thousands of rows)."""
        spec, budget = self.packing, self.warmup.token_budget
        buckets = list(self.queues.rows)
        heads = [self.queues.head(b, max(1, min(spec.max_rows, budget // (below + 1))))
                 for b, below in zip(buckets, [0, *buckets[:-1]])]
        chosen = pack_rows(heads, budget, spec.max_rows, self.window_s)
        taken = self._forming = [row for b, idx in zip(buckets, chosen) if len(idx)
                                 for row in self.queues.take(b, idx.tolist())]
        return assemble_packed(taken, self.plan.pad_id, spec)

    def _report_from_worker(self, batch: Batch | PackedBatch, out, busy_s: float) -> None:
        self._loop.call_soon_threadsafe(self._deliver, batch, out, busy_s)

    def _deliver(self, batch: Batch | PackedBatch, out, busy_s: float) -> None:
        self.in_worker -= 1
        self.estimator.computed(batch.real_tokens, busy_s)
        self.on_batch(batch, busy_s)
        if self.hung:  # a device that came back late, or a batch a lost device never ran: failed
            for request, _, _ in batch.routes:
                request.fail(self.lost)
                self.drop(request)
            return
        was = self.failing
        if isinstance(out, BaseException):
            self.failed_batches += 1
            for request, positions, _ in batch.routes:
                if request.trace is not None:
                    request.trace.batch_ran(batch, len(positions), busy_s)
                request.fail(ModelFailure(f"model failed on this request's batch: {out}"))
                self.drop(request)
        else:
            self.failed_batches = 0
            for request, positions, rows in batch.routes:
                if request.trace is not None:
                    request.trace.batch_ran(batch, len(positions), busy_s)
                if request.norms is not None and batch.norms is not None:  # a windowed request's
                    request.norms[positions] = batch.norms[rows]
                request.deliver(positions, out[rows])
        self._failing_changed(was)
        self.look_soon()

    def _failing_changed(self, was: bool) -> None:
        """Tell on_failing when `failing` turns (a good batch clears failed batches, never a
        lost device or a broken batcher)."""
        if self.failing != was:
            self.on_failing(self.failing)

    async def _watchdog(self) -> None:
        """Fail the device when a batch outruns its limit (a kernel that hangs raises nothing), and
        the engine when the worker thread has ended (nothing would compute what is queued)."""
        tick = min(1.0, self.watchdog.floor_s / 4)
        while self.lost is None:
            await asyncio.sleep(tick)
            # `alive` first: once the thread has ended, `running` is its last word (the batch it
            # died on). Read before, it could be a batch the thread then reported, before dying
            # on the next: that one's requests failed though computed, its tokens counted off
            # twice, and the next one's never.
            alive = self.worker.alive
            running = self.worker.running
            if not alive:  # neither the batch it ran nor the rest will ever report
                log.error("the model worker thread has ended: failing every request and reporting NOT_SERVING")
                lost = [running[0]] if running else []
                self.in_worker -= len(lost)
                self.estimator.dequeued(sum(b.real_tokens for b in lost))
                self._lose("the model worker stopped", batches=[*self._never_to_run(), *lost])
            elif running and time.monotonic() - running[1] > self.watchdog.limit_s(running[0], self.warmup):
                self._device_hung(running[0], time.monotonic() - running[1])

    def _device_hung(self, batch: Batch | PackedBatch, ran_s: float) -> None:
        """Every request waiting on the device fails with UNAVAILABLE (a client retries on another
        pod); health reports NOT_SERVING, so the liveness probe restarts this one."""
        log.error("a batch of %d rows has run %.1f s, past the watchdog's %.1f s: the device is not "
                  "responding; failing every request and reporting NOT_SERVING", batch.rows, ran_s,
                  self.watchdog.limit_s(batch, self.warmup))
        was, self.hung = self.failing, True
        self._fail_waiting(self.lost, (batch, *self._never_to_run()))
        self._failing_changed(was)
        if self.device is not None:  # a hung kernel holds the device every model shares
            self.device.lose()

    def device_lost(self) -> None:
        """Another model's batch hung the device this one shares (MODELS): nothing of this model's
        will run either. Its requests fail as a hung device's do (UNAVAILABLE), the batch waiting
        for its turn included (should the device come back, its report is ignored, as a hung
        batch's is)."""
        if self.hung:
            return
        log.error("another model's batch hung the shared device: failing every request and reporting NOT_SERVING")
        was, self.hung = self.failing, True
        # A batch its worker took and waits to run comes back failed (model.device: lost), and its
        # requests fail then if not before.
        self._fail_waiting(self.lost, self._never_to_run())
        self._failing_changed(was)

    def _never_to_run(self) -> list:
        """Take back the batches the worker has not started (it never will): their tokens leave
        the backlog, which only a batch's report would otherwise clear."""
        waiting = self.worker.drain()
        self.in_worker -= len(waiting)
        self.estimator.dequeued(sum(b.real_tokens for b in waiting))
        return waiting

    def _lose(self, what: str, batches=()) -> None:
        """A failure for good but the device's (the batcher, the worker thread): batching stops,
        every request with rows still to compute, but in batches the worker will still run, fails
        with the refusal every later request gets (UNAVAILABLE: nothing of it was computed, and
        another pod can), and health reports NOT_SERVING, so the liveness probe restarts this
        server."""
        was, self._batching, self.broken = self.failing, False, what
        self._fail_waiting(self.lost, batches)
        self._failing_changed(was)

    def _fail_waiting(self, error: Exception, batches=()) -> None:
        """Fail every request with rows still to compute: waiting to be tokenized, queued, or
        in `batches` (that will never run)."""
        try:
            self.feed()  # the requests waiting to be tokenized join the queues, and fail with them
        except Exception:  # a bug there must not keep the rest from failing
            log.exception("queuing the requests waiting to be tokenized failed")
        pending = {id(r): r for b in batches for r, _, _ in b.routes}
        pending.update((id(row.chunk.request), row.chunk.request) for q in [self._forming, *self.queues.rows.values()]
                       for row in q)
        # Rows taken for a batch never handed over left the queues' count but not the backlog's
        # (`drop` frees queued rows only): a broken pod exported them as a phantom backlog.
        self.estimator.dequeued(sum(row.length for row in self._forming))
        self._forming = []
        for request in pending.values():
            request.fail(error)
            self.drop(request)
        self.queues.purge()
        self.on_lost()


FIRST_ROW = np.zeros(1, dtype=np.int64)  # the positions of a one-row request (shared: read only)
FIRST_ROW.flags.writeable = False


def split_by_bucket(lengths: np.ndarray, buckets) -> list[tuple[int, np.ndarray]]:
    """Group a request's rows by the smallest bucket that holds each (positions ascending)."""
    if len(lengths) == 1:  # the usual request: numpy's per-call cost is most of the work
        return [(choose_bucket(int(lengths[0]), buckets), FIRST_ROW)]
    index = np.minimum(np.searchsorted(buckets, lengths, side="left"), len(buckets) - 1)
    if index.min() == index.max():  # texts of one size class: no grouping
        return [(buckets[int(index[0])], np.arange(len(lengths)))]
    return [(buckets[k], np.flatnonzero(index == k)) for k in np.unique(index)]
