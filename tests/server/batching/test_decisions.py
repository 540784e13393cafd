"""Table tests of the pure batching decisions, on an injected clock (plain numbers)."""

import types

import numpy as np
import pytest

from embedserve.batching.decisions import BucketView, choose_bucket, next_drain, next_packed_drain, pack_rows, reorder_window, room, select_rows, within_window

BUCKETS = (16, 32, 64, 128, 256, 512)


@pytest.mark.parametrize(
    "length, bucket",
    [(1, 16), (16, 16), (17, 32), (32, 32), (33, 64), (129, 256), (512, 512), (900, 512)],
)
def test_choose_bucket_is_smallest_that_fits(length, bucket):
    assert choose_bucket(length, BUCKETS) == bucket


def v(length, rows, oldest, cap=8):
    return BucketView(length, rows, oldest, cap)


DEADLINE = 0.05


@pytest.mark.parametrize(
    "views, now, idle, bucket, reason",
    [
        ([v(16, 0, 0), v(32, 0, 0)], 1.0, True, None, ""),
        # a stale bucket beats a full one, and the oldest stale bucket goes first
        ([v(16, 8, 0.99), v(32, 1, 0.90), v(64, 1, 0.94)], 1.0, False, 32, "stale"),
        # full buckets go even while the worker is busy; the oldest full one first
        ([v(16, 8, 0.99), v(32, 9, 0.98), v(64, 1, 0.995)], 1.0, False, 32, "full"),
        # idle worker: no waiting out the deadline; the bucket holding the most tokens goes
        ([v(16, 3, 0.999), v(128, 1, 0.9995)], 1.0, True, 128, "idle"),
        ([v(16, 1, 0.999)], 1.0, True, 16, "idle"),
    ],
)
def test_next_drain_priority(views, now, idle, bucket, reason):
    d = next_drain(views, now, DEADLINE, idle)
    assert (d.bucket, d.reason) == (bucket, reason)


def test_next_drain_waits_for_the_earliest_deadline_when_busy():
    d = next_drain([v(16, 2, 0.99), v(64, 1, 0.97)], 1.0, DEADLINE, worker_idle=False)
    assert d.bucket is None
    assert d.wake_at == pytest.approx(0.97 + DEADLINE)


def test_next_drain_becomes_stale_exactly_at_the_deadline():
    views = [v(16, 1, 1.0)]
    assert next_drain(views, 1.0 + DEADLINE - 1e-6, DEADLINE, False).bucket is None
    assert next_drain(views, 1.0 + DEADLINE, DEADLINE, False).reason == "stale"


def test_room_is_what_the_drain_decision_needs_to_say_full():
    """Rows fewer than `room` added to any bucket leave a busy worker's decision waiting; `room`
    rows added to the tightest bucket make it "full" (padded). Packed: the row cap or the token
    budget. The engine looks at arrivals only past this room (or with no deadline set)."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        views = [v(b, int(rng.integers(0, 8)), 1.0, cap=8) for b in (16, 32, 64)]
        rows, tokens = room(views)
        assert tokens == float("inf")
        for i in range(3):
            fewer = [w._replace(rows=w.rows + (rows - 1 if j == i else 0)) for j, w in enumerate(views)]
            assert next_drain(fewer, 1.0, DEADLINE, worker_idle=False).reason != "full"
        tightest = min(range(3), key=lambda j: views[j].cap - views[j].rows)
        filled = [w._replace(rows=w.rows + (rows if j == tightest else 0)) for j, w in enumerate(views)]
        assert next_drain(filled, 1.0, DEADLINE, worker_idle=False).reason == "full"
        packed = [w._replace(rows=w.rows + 1, cap=0) for w in views]
        queued = int(rng.integers(0, 1024))
        rows, tokens = room(packed, packed_rows=32, queued_tokens=queued, token_budget=1024)
        for more_rows, more_tokens, full in ((rows - 1, tokens - 1, False), (rows, 0, True), (0, tokens, True)):
            grown = [packed[0]._replace(rows=packed[0].rows + more_rows), *packed[1:]]
            reason = next_packed_drain(grown, 1.0, DEADLINE, False, queued + more_tokens, 1024, 32).reason
            assert (reason == "full") == full


def test_select_rows_always_takes_the_oldest_then_nearest_lengths():
    lengths = [40, 64, 33, 41, 60, 39, 35]
    assert select_rows(lengths, cap=3, max_tokens=10_000) == [0, 3, 5]


def test_select_rows_respects_cap_and_token_budget():
    lengths = [10, 10, 10, 10, 10]
    assert select_rows(lengths, cap=2, max_tokens=10_000) == [0, 1]
    assert select_rows(lengths, cap=8, max_tokens=30) == [0, 1, 2]
    # static shapes: every row costs the padded length
    assert select_rows(lengths, cap=8, max_tokens=64, pad_to=16) == [0, 1, 2, 3]


def test_select_rows_skips_a_row_that_would_break_the_budget_but_keeps_smaller_ones():
    # The 60-token row would make 3 rows × 60 > 130; the 20-token row still fits.
    assert select_rows([20, 60, 21], cap=3, max_tokens=130) == [0, 2]


def test_select_rows_oldest_row_goes_even_alone_over_budget():
    assert select_rows([500], cap=4, max_tokens=100) == [0]
    assert select_rows([500, 20], cap=4, max_tokens=100, pad_to=512) == [0]


def spec_select_rows(lengths, cap, max_tokens, pad_to=None):
    """The rule in plain Python, one row at a time: oldest, then nearest in length (ties: the
    older), each row added while the batch stays within cap and the token budget."""
    order = sorted(range(1, len(lengths)), key=lambda i: (abs(lengths[i] - lengths[0]), i))
    chosen, longest = [0], lengths[0]
    for i in order:
        if len(chosen) >= cap:
            break
        width = pad_to or max(longest, lengths[i])
        if (len(chosen) + 1) * width <= max_tokens:
            chosen.append(i)
            longest = max(longest, lengths[i])
    return sorted(chosen)


def test_select_rows_agrees_with_the_plain_rule_on_random_queues():
    rng = np.random.default_rng(0)
    for _ in range(500):
        lengths = rng.integers(1, 65, int(rng.integers(1, 200))).tolist()
        cap, budget = int(rng.integers(1, 80)), int(rng.integers(50, 3000))
        pad_to = int(rng.choice([0, 64])) or None
        assert select_rows(lengths, cap, budget, pad_to) == spec_select_rows(lengths, cap, budget, pad_to)


# Packed rows: one batch takes rows of every bucket up to a token budget.


def pv(length, rows, oldest):
    return BucketView(length, rows, oldest, 0)


@pytest.mark.parametrize(
    "views, queued, idle, bucket, reason",
    [
        ([pv(16, 0, 0), pv(32, 0, 0)], 0, True, None, ""),
        # a stale row goes at once, and the batch starts from the oldest row's bucket
        ([pv(16, 3, 0.99), pv(64, 1, 0.90)], 100, False, 64, "stale"),
        # the queue holds a full batch: by tokens, or by rows
        ([pv(16, 3, 0.99), pv(512, 2, 0.98)], 1000, False, 512, "full"),
        ([pv(16, 8, 0.99), pv(32, 8, 0.995)], 200, False, 16, "full"),
        # idle worker: no waiting out the deadline
        ([pv(16, 1, 0.999)], 10, True, 16, "idle"),
    ],
)
def test_next_packed_drain(views, queued, idle, bucket, reason):
    d = next_packed_drain(views, 1.0, DEADLINE, idle, queued, token_budget=1000, max_rows=16)
    assert (d.bucket, d.reason) == (bucket, reason)


def test_next_packed_drain_waits_for_the_oldest_rows_deadline_when_busy():
    d = next_packed_drain([pv(16, 2, 0.99), pv(64, 1, 0.97)], 1.0, DEADLINE, False, 100, 1000, 16)
    assert d.bucket is None and d.wake_at == pytest.approx(0.97 + DEADLINE)


def spec_pack_rows(heads, budget, max_rows, window=np.inf):
    """The rule in plain Python, one row at a time: every queued row, oldest first (ties: the
    lower bucket, then queue order); the oldest always; then each row that still fits and was
    admitted within `window` of the oldest."""
    rows = sorted((age, b, i, n) for b, (lengths, ages) in enumerate(heads) for i, (n, age) in enumerate(zip(lengths, ages)))
    chosen, used = [], 0
    for k, (age, b, i, n) in enumerate(rows):
        if len(chosen) == max_rows or age > rows[0][0] + window:
            break
        if k == 0 or used + n <= budget:
            chosen.append((b, i))
            used += n
    return [sorted(i for bb, i in chosen if bb == b) for b in range(len(heads))]


def random_heads(rng, buckets=(16, 64, 256)):
    heads, below = [], 0
    for b in buckets:
        n = int(rng.integers(0, 40))
        ages = np.sort(rng.choice(1000, n, replace=False) / 1000.0)  # distinct, FIFO within a bucket
        heads.append((rng.integers(below + 1, b + 1, n), ages))
        below = b
    return heads


def test_pack_rows_agrees_with_the_plain_rule_on_random_queues():
    rng = np.random.default_rng(0)
    for _ in range(500):
        heads = random_heads(rng)
        budget, max_rows = int(rng.integers(256, 3000)), int(rng.integers(1, 60))
        window = float(rng.choice([np.inf, rng.uniform(0, 0.5)]))
        got = [idx.tolist() for idx in pack_rows(heads, budget, max_rows, window)]
        assert got == spec_pack_rows(heads, budget, max_rows, window)


def test_pack_rows_takes_stale_rows_of_every_bucket_first_and_fills_around_a_long_one():
    heads = [(np.array([5, 5, 5]), np.array([0.10, 0.50, 0.60])),
             (np.array([200, 40]), np.array([0.20, 0.30]))]
    # oldest first: 5 (0.10), 200 (0.20), then 40 (0.30) does not fit 240 - 205, the later 5s do
    assert [i.tolist() for i in pack_rows(heads, 240, 16)] == [[0, 1, 2], [0]]
    assert [i.tolist() for i in pack_rows(heads, 250, 16)] == [[0, 1], [0, 1]]  # 250 exactly
    assert [i.tolist() for i in pack_rows(heads, 250, 2)] == [[0], [0]]  # the row cap
    assert [i.tolist() for i in pack_rows(heads, 4, 16)] == [[0], []]  # the oldest goes even over budget
    assert [i.tolist() for i in pack_rows([(np.zeros(0), np.zeros(0))], 100, 4)] == [[]]
    # the later 5s were admitted more than 0.25 s after the oldest: not in its batch, though they fit
    assert [i.tolist() for i in pack_rows(heads, 250, 16, window_s=0.25)] == [[0], [0, 1]]
    assert [i.tolist() for i in pack_rows(heads, 250, 16, window_s=0.0)] == [[0], []]


@pytest.mark.parametrize("largest_batch_s, window", [
    (0.01, 0.05),  # a GPU: never shorter than the deadline
    (0.12, 0.12),  # the longest batch
    (0.40, 0.25),  # a slow device: never more than half the budget
    (0.0, 0.05),  # nothing measured
])
def test_reorder_window(largest_batch_s, window):
    assert reorder_window(0.05, 0.5, largest_batch_s) == pytest.approx(window)


def test_within_window_counts_the_rows_admitted_up_to_the_window_after_the_first():
    def rows(*times):
        return [types.SimpleNamespace(enqueued=t) for t in times]

    assert within_window(rows(1.0, 1.1, 1.2, 1.3, 2.0), 0.2) == 3
    assert within_window(rows(1.0, 1.1, 1.2), 0.0) == 1  # the first row always
    assert within_window(rows(1.0, 1.0, 1.5), 0.0) == 2  # same instant: one request's rows
    assert within_window([], 0.2) == 0
