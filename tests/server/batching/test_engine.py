"""The engine with a stand-in model whose output is a known function of each row's tokens, so
routing, ordering, cancellation and failure isolation can be checked exactly and fast."""

import asyncio
import threading

import numpy as np
import pytest
import torch

from embedserve.model.shapes import length_ladder
from embedserve.batching.engine import Engine, split_by_bucket
from embedserve.errors import DeviceUnresponsive, ModelFailure, NotReady
from embedserve.admission.estimator import Estimator
from embedserve.model.worker import WarmupPlan, Watchdog

BUCKETS = (4, 8, 16)
POISON = 13


class RowSums:
    """'Embeds' a row as (sum of its attended ids, its length). Raises on POISON."""

    dim = 2

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.batches: list[tuple[int, int]] = []
        self.warmed: set[tuple[int, int]] = set()  # shapes the warm-up ran (captured, on a GPU)

    def run(self, batch):
        self.gate.wait()
        ids, mask = batch.input_ids, batch.attention_mask
        if batch.routes and (ids[mask.bool()] == POISON).any():
            raise RuntimeError("poisoned batch")
        if batch.routes:  # not a warm-up batch
            self.batches.append(tuple(ids.shape))
        else:
            self.warmed.add(tuple(ids.shape))
        return torch.stack([(ids * mask).sum(1), mask.sum(1)], 1)[: batch.rows].float().numpy()

    def memory(self):
        return {}


def expected(rows):
    return np.array([[sum(r), len(r)] for r in rows], dtype=np.float32)


def as_tensor(rows):
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids, np.array([len(r) for r in rows])


async def started_engine(runner, static=False, caps=None, lookahead=2, deadline_s=0.005, vocab_size=100, **kwargs):
    plan = WarmupPlan(BUCKETS, 64, 1024, static, caps or {4: 8, 8: 8, 16: 8}, 0, vocab_size)
    engine = Engine(plan, lambda: runner, Estimator(), deadline_s=deadline_s, worker_queue_size=4, lookahead=lookahead,
                    **kwargs)
    await engine.start()
    return engine


def random_rows(rng, n):
    return [list(rng.integers(1, 12, size=rng.integers(1, 17))) for _ in range(n)]


@pytest.mark.parametrize("static, lookahead", [(False, 0), (False, 2), (True, 2)])
async def test_concurrent_requests_get_their_own_rows_in_order(static, lookahead):
    runner = RowSums()
    engine = await started_engine(runner, static, lookahead=lookahead)
    rng = np.random.default_rng(1)
    requests = [random_rows(rng, int(rng.integers(1, 9))) for _ in range(200)]
    futures = [engine.submit(*as_tensor(rows)).future for rows in requests]
    results = await asyncio.gather(*futures)
    for rows, out in zip(requests, results):
        np.testing.assert_array_equal(out, expected(rows))
    assert engine.estimator.snapshot().queued_tokens == 0
    if static:  # only shapes the warm-up captured, padded to the length ladder, not the bucket
        assert set(runner.batches) <= runner.warmed
        assert {w for _, w in runner.batches} <= set(length_ladder(BUCKETS))
        assert {w for _, w in runner.batches} - set(BUCKETS), "some batch ran shorter than its bucket"
    else:  # no dummy rows
        assert all(b <= 8 for b, _ in runner.batches)
    await engine.stop()


class PackedRowSums:
    """RowSums for packed rows: the same (sum, length) per row, read from the stream's bounds."""

    dim = 2
    attention = "packed"

    def __init__(self):
        self.batches: list = []

    def run(self, batch):
        cu, ids = batch.cu_seqlens.tolist(), batch.input_ids
        if batch.routes:
            self.batches.append(batch)
        return np.array([[int(ids[a:b].sum()), b - a] for a, b in zip(cu, cu[1 : batch.rows + 1])], np.float32)

    def memory(self):
        return {}


@pytest.mark.parametrize("static, lookahead", [(False, 0), (True, 2)])
async def test_packed_batches_take_rows_of_every_bucket_and_route_them_home(static, lookahead):
    runner = PackedRowSums()
    engine = await started_engine(runner, static, caps={4: 1}, lookahead=lookahead)
    assert engine.attention == "packed" and engine.warmup.token_budget == 1024
    rng = np.random.default_rng(2)
    requests = [random_rows(rng, int(rng.integers(1, 9))) for _ in range(200)]
    results = await asyncio.gather(*(engine.submit(*as_tensor(rows)).future for rows in requests))
    for rows, out in zip(requests, results):
        np.testing.assert_array_equal(out, expected(rows))
    assert engine.estimator.snapshot().queued_tokens == 0
    assert all(b.real_tokens <= 1024 and b.rows <= 64 for b in runner.batches)
    assert max(len(set(np.searchsorted(BUCKETS, np.diff(b.cu_seqlens[: b.rows + 1].numpy())))) for b in runner.batches) > 1
    await engine.stop()


async def test_dropped_requests_never_reach_the_model_and_leave_the_backlog():
    runner = RowSums()
    engine = await started_engine(runner, caps={4: 1, 8: 1, 16: 1})
    runner.gate.clear()  # the worker blocks on its first batch
    first = engine.submit(*as_tensor([[1, 2]]))
    await asyncio.sleep(0)  # let the batcher hand it to the worker
    while engine.in_worker == 0:
        await asyncio.sleep(0.001)
    queued = [engine.submit(*as_tensor([[3] * 5, [4] * 9])) for _ in range(50)]
    assert engine.estimator.snapshot().queued_tokens > 50 * 14 - 100
    for request in queued:
        request.future.cancel()
        engine.drop(request)
    runner.gate.set()
    assert (await first.future).tolist() == [[3.0, 2.0]]
    while engine.in_worker:
        await asyncio.sleep(0.001)
    assert engine.estimator.snapshot().queued_tokens == 0
    assert runner.batches == [(1, 2)]  # none of the 100 dropped rows ran
    assert all(not engine.queues.rows[b] for b in BUCKETS)
    await engine.stop()


@pytest.mark.parametrize("packed", [False, True])
async def test_a_stale_batch_takes_no_row_admitted_past_the_reorder_window(packed):
    """Rows admitted long after a stale batch's oldest row wait for a later batch, though they
    fit beside it: otherwise the rows of one bucket can overtake a row of another without end."""
    now = [0.0]
    runner = PackedRowSums() if packed else RowSums()
    engine = await started_engine(runner, caps={4: 8, 8: 8, 16: 8}, lookahead=0, clock=lambda: now[0],
                                  max_drain_s=0.5)
    assert engine.window_s < 1.0  # the stand-in's batches take ~0 s: the late rows are outside it
    gate = threading.Event()
    run = runner.run
    runner.run = lambda batch: gate.wait(10) and run(batch)  # the worker blocks on its first batch
    first = engine.submit(*as_tensor([[1] * 12]))
    async with asyncio.timeout(10):
        while engine.in_worker == 0:
            await asyncio.sleep(0.001)
    early = engine.submit(*as_tensor([[2] * 5] * 3))
    now[0] = 1.0
    late = engine.submit(*as_tensor([[3] * 6] * 3))
    now[0] = 2.0  # both stale
    gate.set()
    async with asyncio.timeout(10):
        await asyncio.gather(first.future, early.future, late.future)
    rows = [b.rows for b in runner.batches] if packed else [shape[0] for shape in runner.batches]
    assert rows == [1, 3, 3]
    await engine.stop()


async def test_a_failing_batch_fails_only_its_requests():
    runner = RowSums()
    engine = await started_engine(runner, caps={4: 1, 8: 1, 16: 1})
    good = [engine.submit(*as_tensor([[1, 2, 3]])) for _ in range(5)]
    bad = engine.submit(*as_tensor([[POISON, 1], [2, 2, 2, 2, 2, 2]]))  # two buckets, one poisoned
    more = [engine.submit(*as_tensor([[5] * 10])) for _ in range(5)]
    for r in good + more:
        assert (await r.future).shape == (1, 2)
    with pytest.raises(ModelFailure, match="poisoned batch"):
        await bad.future
    while engine.in_worker:
        await asyncio.sleep(0.001)
    assert engine.estimator.snapshot().queued_tokens == 0
    later = engine.submit(*as_tensor([[7, 7]]))
    assert (await later.future).tolist() == [[14.0, 2.0]]
    await engine.stop()


async def test_batch_caps_off_the_captured_sizes_are_clamped_and_nothing_new_is_met_while_serving(caplog):
    """BATCH_CAPS=4:20,8:100 with static shapes: 20 rows is no captured batch size and 100 is more
    than MAX_BATCH_SIZE (64) allows; both run as the largest captured size below, said in the log."""
    runner = RowSums()
    engine = await started_engine(runner, static=True, caps={4: 20, 8: 100, 16: 8})
    assert engine.caps == {4: 16, 8: 64, 16: 8}
    assert "BATCH_CAPS 4:20 runs as 4:16" in caplog.text and "BATCH_CAPS 8:100 runs as 8:64" in caplog.text
    rng = np.random.default_rng(3)
    futures = [engine.submit(*as_tensor(random_rows(rng, int(rng.integers(1, 40))))).future for _ in range(60)]
    await asyncio.gather(*futures)
    assert set(runner.batches) <= runner.warmed  # no shape met for the first time after warm-up
    await engine.stop()


async def test_a_hung_device_fails_every_waiting_request_and_reports_it():
    """A kernel that hangs raises nothing: the watchdog fails the batch on the device and all the
    work waiting for it with UNAVAILABLE's error, and says so (liveness restarts the pod)."""
    runner = RowSums()
    failing = []
    engine = await started_engine(runner, caps={4: 1, 8: 1, 16: 1}, watchdog=Watchdog(multiple=1, floor_s=0.2),
                                  on_failing=failing.append)
    runner.gate.clear()  # the device hangs on the next batch
    stuck = [engine.submit(*as_tensor([[1, 2, 3]])) for _ in range(6)]
    for request in stuck:
        with pytest.raises(DeviceUnresponsive):
            await asyncio.wait_for(request.future, 10)
    assert engine.failing and engine.hung and failing == [True]
    assert all(not engine.queues.rows[b] for b in BUCKETS)
    runner.gate.set()  # the device comes back late: nothing is delivered twice, nothing raises
    while engine.in_worker:
        await asyncio.sleep(0.01)
    assert failing == [True]
    await engine.stop()


async def test_a_bug_in_the_batcher_fails_what_waits_and_refuses_what_comes(caplog):
    """Not a request left hanging: the rows queued fail, the engine is no longer ready, and a new
    request is refused at once. Nothing queued was computed: UNAVAILABLE's error, which a client
    retries on another pod (INTERNAL's it does not)."""
    runner = RowSums()
    engine = await started_engine(runner, caps={4: 1, 8: 1, 16: 1})
    runner.gate.clear()
    first = engine.submit(*as_tensor([[1, 2]]))
    await asyncio.sleep(0)
    while engine.in_worker < 3:  # lookahead 2: three batches formed, the rest queue
        engine.submit(*as_tensor([[1, 2]]))
        await asyncio.sleep(0.001)
    queued = engine.submit(*as_tensor([[5, 6, 7]]))

    def broken():
        raise RuntimeError("a bug")

    engine.feed = broken  # fault injection: the next look fails
    runner.gate.set()
    with pytest.raises(NotReady, match="the server's batcher failed; this server will be restarted"):
        await asyncio.wait_for(queued.future, 10)
    assert (await first.future).tolist() == [[3.0, 2.0]]  # formed before: computed
    assert not engine.ready and "the batcher failed" in caplog.text
    with pytest.raises(NotReady):
        engine.submit(*as_tensor([[1]]))
    await engine.stop()


async def test_a_bug_after_rows_are_taken_fails_their_requests_too():
    """Rows taken into a batch that is never handed to the worker were in no queue: their
    requests were left waiting for ever. Their tokens leave the backlog too (they had stayed:
    a broken pod exported a backlog of work it will never do)."""
    runner = RowSums()
    failing, lost = [], []
    engine = await started_engine(runner, on_failing=failing.append, on_lost=lambda: lost.append(True))

    def broken(batch):
        raise RuntimeError("a bug")

    engine.worker.submit = broken  # fault injection: a batch is formed, then the hand-over fails
    taken = engine.submit(*as_tensor([[1, 2]]))
    with pytest.raises(NotReady, match="the server's batcher failed"):
        await asyncio.wait_for(taken.future, 10)
    assert engine.failing and failing == [True] and lost == [True]
    assert engine.estimator.snapshot().queued_tokens == 0
    with pytest.raises(NotReady, match="the server's batcher failed; this server will be restarted"):
        engine.submit(*as_tensor([[1]]))
    await engine.stop()


async def test_a_worker_thread_that_ends_fails_what_waits_and_reports_it():
    """Nothing would compute what is queued: every waiting request fails UNAVAILABLE's error
    (another pod serves it), and health turns, as for a hung device."""
    runner = RowSums()
    failing = []
    engine = await started_engine(runner, caps={4: 1, 8: 1, 16: 1}, watchdog=Watchdog(floor_s=0.2),
                                  on_failing=failing.append)
    await asyncio.to_thread(engine.worker.stop, 5)  # the thread ends (its stop sentinel)
    waiting = [engine.submit(*as_tensor([[1, 2, 3]])) for _ in range(6)]
    for request in waiting:
        with pytest.raises(NotReady, match="the model worker stopped"):
            await asyncio.wait_for(request.future, 10)
    assert engine.failing and failing == [True] and engine.estimator.snapshot().queued_tokens == 0
    with pytest.raises(NotReady, match="the model worker stopped"):
        engine.submit(*as_tensor([[1]]))
    await engine.stop()


class DiesOnRow99(RowSums):
    """Its thread ends on a batch holding id 99 (a BaseException, which the worker's `except
    Exception` lets through), the batch left as `running`."""

    def run(self, batch):
        if batch.routes and (batch.input_ids == 99).any():
            raise SystemExit
        return super().run(batch)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's end, on purpose
async def test_a_worker_that_reports_a_batch_then_dies_on_the_next_fails_only_that_one(monkeypatch):
    """The watchdog had read the batch running before asking whether the thread lives: a batch X
    reported meanwhile, and the thread then ended on the next, Y, the watchdog failed X's
    requests though computed (and counted its tokens off twice), and Y's requests waited for
    ever. The interleaving is forced: the thread runs X to its end and dies on Y exactly while
    the watchdog asks whether it lives."""
    runner = DiesOnRow99()
    engine = await started_engine(runner, caps={4: 1, 8: 1, 16: 1}, watchdog=Watchdog(floor_s=2.0))
    runner.gate.clear()  # X waits on the device
    x = engine.submit(*as_tensor([[1, 2]]))
    y = engine.submit(*as_tensor([[99, 1, 1]]))
    while engine.in_worker < 2 or engine.worker.running is None:
        await asyncio.sleep(0.001)
    asked = []
    alive = type(engine.worker).alive

    def alive_once_x_is_done(worker):
        if not asked:
            asked.append(True)
            runner.gate.set()  # X computed and reported, then the thread ends on Y
            worker._thread.join(5)
        return alive.fget(worker)

    monkeypatch.setattr(type(engine.worker), "alive", property(alive_once_x_is_done))
    assert (await asyncio.wait_for(x.future, 10)).tolist() == [[3.0, 2.0]]
    with pytest.raises(NotReady, match="the model worker stopped"):
        await asyncio.wait_for(y.future, 10)
    assert asked and engine.estimator.snapshot().queued_tokens == 0 and engine.in_worker == 0
    await engine.stop()


def test_split_by_bucket_groups_positions():
    groups = split_by_bucket(np.array([3, 9, 4, 16, 20, 5]), BUCKETS)
    assert [(b, p.tolist()) for b, p in groups] == [(4, [0, 2]), (8, [5]), (16, [1, 3, 4])]
    assert [(b, p.tolist()) for b, p in split_by_bucket(np.array([6, 7]), BUCKETS)] == [(8, [0, 1])]
    assert [(b, p.tolist()) for b, p in split_by_bucket(np.array([30]), BUCKETS)] == [(16, [0])]
