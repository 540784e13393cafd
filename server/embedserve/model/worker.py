"""The model-worker thread: it loads the model, warms it up (compiling/capturing every shape the
batcher can produce and measuring where bigger batches stop paying), then runs batches from its
queue and reports each result. It is the only thread that touches the model."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from embedserve.model.shapes import bucket_row_limit, choose_cap, ladder_upto, served_shapes, sweep_should_stop, token_ladder
from embedserve.model.batches import PackedBatch, PackSpec, random_packed
from embedserve.model.batches import Batch
from embedserve.model.device import Device, DeviceLost

log = logging.getLogger(__name__)

# A warm-up batch slower than this is not worth growing further: latency, not throughput.
SWEEP_MAX_BATCH_S = 0.5
# Each shape is timed best-of-n over at least this long (single runs of small batches are noisy).
SWEEP_MIN_TIMING_S = 0.15
SWEEP_MAX_REPEATS = 5


class Runner(Protocol):
    dim: int  # and optionally `attention`: "packed" for a runner of packed rows (default padded)

    def run(self, batch: Batch | PackedBatch) -> np.ndarray:
        """→ [batch.rows, dim] (or more rows): a new array each call, never reused, since a
        request takes its rows as a view of it (queues.PendingRequest.deliver)."""
        ...

    def memory(self) -> dict[str, int]: ...


@dataclasses.dataclass(frozen=True)
class WarmupPlan:
    buckets: Sequence[int]
    max_batch_size: int
    max_tokens_per_batch: int
    static: bool
    fixed_caps: dict[int, int] | None
    pad_id: int
    vocab_size: int


@dataclasses.dataclass
class WarmupResult:
    caps: dict[int, int]  # padded rows: each bucket's batch cap
    rates: dict[int, float]  # tokens/s at each bucket's cap (warm-up rows are full: real = padded);
    # packed rows: at the token budget
    packing: PackSpec | None = None  # packed rows: how batches are shaped
    token_budget: int = 0  # packed rows: most real tokens per batch

    @property
    def service_rate(self) -> float:
        return float(np.mean(list(self.rates.values()))) if self.rates else 0.0

    @property
    def largest_batch_s(self) -> float:
        """How long the longest batch the batcher forms runs (the reorder window, the watchdog)."""
        if self.packing:
            return self.token_budget / self.rates[self.token_budget] if self.rates.get(self.token_budget) else 0.0
        return max((b * self.caps[b] / r for b, r in self.rates.items() if r > 0), default=0.0)


def dummy_batch(bucket: int, rows: int, plan: WarmupPlan, rng: np.random.Generator) -> Batch:
    low = min(1000, plan.vocab_size - 1)
    ids = torch.from_numpy(rng.integers(low, plan.vocab_size, size=(rows, bucket), dtype=np.int64))
    mask = torch.ones((rows, bucket), dtype=torch.int64)
    return Batch(ids, mask, rows, rows * bucket, [])


def fixed_cap(bucket: int, wanted: int, limit: int, static: bool) -> int:
    """A BATCH_CAPS entry as the batcher can run it: at most the bucket's row limit
    (MAX_BATCH_SIZE, MAX_TOKENS_PER_BATCH) and, with static shapes, a captured batch size (the
    largest ladder size not above it), so no shape is ever met for the first time while serving.
    A cap that changes says so in the log."""
    cap = min(wanted, limit)
    if static:
        cap = ladder_upto(cap)[-1]
    if cap != wanted:
        log.warning("BATCH_CAPS %d:%d runs as %d:%d (%s)", bucket, wanted, bucket, cap,
                    "captured batch sizes are " + ", ".join(map(str, ladder_upto(limit))) if static
                    else f"at most {limit} rows fit MAX_BATCH_SIZE and MAX_TOKENS_PER_BATCH")
    return cap


def warm_up(runner: Runner, plan: WarmupPlan, clock: Callable[[], float] = time.perf_counter) -> WarmupResult:
    """Run every shape once (compiling it), time it, and cap each bucket's batch size."""
    if getattr(runner, "attention", "padded") == "packed":
        return warm_up_packed(runner, plan, clock)
    rng = np.random.default_rng(0)
    caps, rates = {}, {}
    for b in plan.buckets:
        limit = bucket_row_limit(b, plan.max_batch_size, plan.max_tokens_per_batch, plan.static)
        fixed = plan.fixed_caps.get(b) if plan.fixed_caps else None
        if fixed is not None:
            fixed = fixed_cap(b, fixed, limit, plan.static)
            sizes = ladder_upto(fixed) if plan.static else (fixed,)
        else:
            sizes = ladder_upto(limit) if plan.static else _powers_of_two(limit)
        sweep: list[tuple[int, float]] = []
        for rows in sizes:
            batch = dummy_batch(b, rows, plan, rng)
            runner.run(batch)  # first run compiles / captures; not timed
            dt = _best_time(runner, batch, clock)
            sweep.append((rows, rows * b / dt))
            if fixed is None and (sweep_should_stop(sweep) or dt > SWEEP_MAX_BATCH_S):
                break
        caps[b] = fixed or choose_cap(sweep)
        rates[b] = dict(sweep).get(caps[b], sweep[-1][1])
        log.info("bucket %d: batch cap %d rows (sweep %s)", b, caps[b],
                 ", ".join(f"{s}:{r:.0f} tok/s" for s, r in sweep))
    if plan.static:  # the shorter static lengths within each bucket, at every size up to its cap
        for length, rows in served_shapes(plan.buckets, caps, True):
            if length not in plan.buckets:
                runner.run(dummy_batch(length, rows, plan, rng))
    return WarmupResult(caps, rates)


def warm_up_packed(runner: Runner, plan: WarmupPlan, clock: Callable[[], float] = time.perf_counter) -> WarmupResult:
    """Packed rows: run (capture) every stream size of the ladder up to the token budget, timing
    each on rows of random lengths; the budget is the smallest size within 5% of the best rate
    (as bucket caps are chosen). BATCH_CAPS skips the sweep: the budget is then
    MAX_TOKENS_PER_BATCH (with static shapes every size up to it is still captured)."""
    spec = PackSpec.for_plan(plan.buckets[-1], plan.max_batch_size, plan.max_tokens_per_batch, plan.static)
    rng = np.random.default_rng(0)
    fixed = bool(plan.fixed_caps)
    budget = max(plan.max_tokens_per_batch, plan.buckets[-1])
    sizes = (budget,) if fixed and not spec.ladder else spec.ladder or token_ladder(budget)
    if fixed:
        log.warning("BATCH_CAPS: packed rows have no per-bucket caps; the token budget is MAX_TOKENS_PER_BATCH (%d)", budget)
    sweep: list[tuple[int, float]] = []
    for tokens in sizes:
        batch = random_packed(tokens, spec, plan.vocab_size, rng)
        runner.run(batch)  # first run compiles / captures; not timed
        if fixed and tokens != sizes[-1]:
            continue
        dt = _best_time(runner, batch, clock)
        sweep.append((tokens, batch.real_tokens / dt))
        # A budget must hold the longest row: the sweep goes at least that far.
        if not fixed and tokens >= spec.max_len and (sweep_should_stop(sweep) or dt > SWEEP_MAX_BATCH_S):
            break
    budget = sizes[-1] if fixed else choose_cap([(t, r) for t, r in sweep if t >= spec.max_len])
    log.info("packed rows: token budget %d, at most %d rows (sweep %s)", budget, spec.max_rows,
             ", ".join(f"{s}:{r:.0f} tok/s" for s, r in sweep))
    return WarmupResult({}, {budget: dict(sweep).get(budget, sweep[-1][1])}, spec, budget)


def _best_time(runner: Runner, batch: Batch | PackedBatch, clock: Callable[[], float]) -> float:
    best, spent = float("inf"), 0.0
    for _ in range(SWEEP_MAX_REPEATS):
        t0 = clock()
        runner.run(batch)
        dt = clock() - t0
        best, spent = min(best, dt), spent + dt
        if spent >= SWEEP_MIN_TIMING_S:
            break
    return max(best, 1e-9)


def _powers_of_two(limit: int) -> tuple[int, ...]:
    sizes, s = [], 1
    while s < limit:
        sizes.append(s)
        s *= 2
    return tuple(sizes + [limit])


Report = Callable[[Batch, "np.ndarray | BaseException", float], None]
# The loaded runner and the plan → its warm-up: `warm_up`, or a warm start's (model.warm_start).
Warm = Callable[[Runner, WarmupPlan], WarmupResult]


@dataclasses.dataclass(frozen=True)
class Watchdog:
    """When a batch has run too long: `multiple` times what warm-up says it should take, and never
    less than `floor_s` (a loaded host is slow, a hung device is forever). A device that hangs in
    a kernel raises nothing: only the clock can tell."""

    multiple: float = 20.0
    floor_s: float = 30.0

    def limit_s(self, batch: Batch | PackedBatch, warmup: WarmupResult) -> float:
        slowest = min(warmup.rates.values(), default=0.0)
        expected = max(warmup.largest_batch_s, batch.padded_tokens / slowest if slowest > 0 else 0.0)
        return max(self.floor_s, self.multiple * expected)


class ModelWorker:
    """Owns the runner on its own thread. `started` is set once loading and warm-up end (check
    `failure`); `submit` never blocks (the batcher keeps the queue below its cap)."""

    def __init__(self, load: Callable[[], Runner], plan: WarmupPlan, report: Report, maxsize: int,
                 warm: Warm = warm_up, device: Device | None = None):
        self._load, self._plan, self._report, self._warm = load, plan, report, warm
        self._device = device  # shared with other models' workers (MODELS): one batch at a time
        # SimpleQueue: a C queue, ~0.1 us per hand-off on the event loop against queue.Queue's ~1.3.
        self._queue: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._maxsize = maxsize
        self.started = threading.Event()
        self.failure: BaseException | None = None
        self.warmup: WarmupResult | None = None
        self.runner: Runner | None = None
        self.running: tuple[Batch, float] | None = None  # the batch on the device, since (monotonic)
        self.footprint = 0  # device memory the load and warm-up reserved (0 off CUDA)
        self._thread = threading.Thread(target=self._main, name="model-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, batch: Batch) -> None:
        assert self._queue.qsize() < self._maxsize, "the batcher overfilled the worker's queue"
        self._queue.put_nowait(batch)

    def drain(self) -> list[Batch]:
        """Take back the batches not yet started (the device is lost)."""
        taken = []
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return taken
            if batch is not None:
                taken.append(batch)

    def stop(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def _main(self) -> None:
        try:
            before = reserved_bytes()
            self.runner = self._load()
            self.warmup = self._warm(self.runner, self._plan)
            # Weights, warm-up activations, graph pools: measured here, where CUDA already runs
            # (asked on the event loop, the first call would start a CUDA context there).
            self.footprint = reserved_bytes() - before
        except BaseException as e:  # noqa: BLE001 - reported to the starter, which exits
            self.failure = e
            log.exception("model load / warm-up failed")
            return
        finally:
            self.started.set()
        while (batch := self._queue.get()) is not None:
            t0 = time.perf_counter()
            try:
                # Its busy time, and the watchdog's clock, start once the device is this model's.
                with self._device.turn(batch.due) if self._device else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    self.running = (batch, time.monotonic())
                    batch.started = self.running[1]
                    try:
                        # contiguous float32 (a no-op for every runner but a strided view, e.g. CLS pooling)
                        out = self.runner.run(batch)
                        if isinstance(out, np.ndarray):
                            out = np.ascontiguousarray(out, dtype=np.float32)
                    except Exception as e:  # one bad batch fails its own requests, not the server
                        log.exception("batch of %d rows failed", batch.rows)
                        out = e
                    self.running = None
            except DeviceLost as e:  # never ran: reported failed, its tokens leave the backlog
                out, t0 = e, time.perf_counter()
            busy_s = time.perf_counter() - t0
            self._report(batch, out, busy_s)


def reserved_bytes() -> int:
    """What torch's allocator holds on every GPU (0 before any CUDA work: nothing can be held)."""
    if not torch.cuda.is_initialized():
        return 0
    return sum(torch.cuda.memory_reserved(d) for d in range(torch.cuda.device_count()))
