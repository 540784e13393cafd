"""Pure batching decisions: which bucket a row goes to, which bucket to drain next, which rows
form the batch and what shape it runs at. No I/O, no clocks: callers pass `now`."""

from __future__ import annotations

import bisect
import math
import operator
from typing import NamedTuple, Sequence

import numpy as np


def choose_bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `length` tokens; the largest if none does (the caller
    truncates or rejects before that)."""
    i = bisect.bisect_left(buckets, length)
    return buckets[min(i, len(buckets) - 1)]


def reorder_window(deadline_s: float, max_drain_s: float, largest_batch_s: float = 0.0) -> float:
    """W: how much later than a batch's oldest row its other rows may have been admitted.
    Admission holds the same W back from the drain budget.

    Why a request admitted at once then finishes within the budget plus its own batch (and its
    own tokenization): the rows that run before a row R are either older (queued when R was
    admitted: less than budget - W of work) or admitted after R. Once R is stale, every batch is
    led by a row at least as old as R (stale buckets drain oldest first), so none carries a row
    admitted more than W after R; before that, batches are formed within DEADLINE_WAIT_MS of R.
    And admission admits only while the queue is under budget - W, so what it admits within W
    of R is at most W of work beyond the room R left, plus the one request that closed the room
    (admission is size-neutral: it may overshoot by one request). Outside the bound: a
    DEADLINE_WAIT_MS above W (adds the excess; the engine warns), and retries admitted into room booked for them (they skip the
    present queue's check, so a late crowd of them adds its own work). Without a window a stale
    bucket's batch takes the rows nearest in length from its whole queue and R can be overtaken
    again and again: on a 2-core CPU under 2x overload the accepted P99 was 1.2-1.6x the budget.

    How large: the longest batch, at least DEADLINE_WAIT_MS, at most half the budget. The
    smallest W the bound allows, so the queue admitted at once keeps as much of the budget as it
    can: below saturation that queue absorbs bursts (half the budget held back made a simulated
    slow fleet at 60-75% utilization refuse 3-7% of requests in some 5 s windows). The price is
    paid under overload on a slow device: a batch then chooses among about W of work, so a CPU's
    batches thin out (bench/RESULTS.md, "Reorder window"). A GPU's batches take milliseconds:
    W is DEADLINE_WAIT_MS and its queue keeps 90% of the budget."""
    return min(0.5 * max_drain_s, max(deadline_s, largest_batch_s))


def within_window(rows: Sequence, window_s: float) -> int:
    """How many of a queue's first rows (`.enqueued` ascending) may join a batch its first row
    leads: those admitted no later than `window_s` after it."""
    return bisect.bisect_right(rows, rows[0].enqueued + window_s, key=operator.attrgetter("enqueued")) if rows else 0


class BucketView(NamedTuple):
    """What the drain decision sees of one bucket (a tuple: built per bucket at every look)."""

    length: int
    rows: int
    oldest: float  # enqueue time of the oldest row; meaningless when rows == 0
    cap: int  # rows that make the bucket full


class Drain(NamedTuple):
    """Drain `bucket` now (None: nothing to do) or look again at `wake_at` (None: on news only)."""

    bucket: int | None
    reason: str = ""
    wake_at: float | None = None


def next_drain(views: Sequence[BucketView], now: float, deadline_s: float, worker_idle: bool) -> Drain:
    """Priority drain: stale buckets (oldest first), then full ones (oldest first), then, when
    the worker is idle, the bucket with the most queued tokens, so a lone request on an idle
    server never waits out the deadline."""
    waiting = [v for v in views if v.rows > 0]
    if not waiting:
        return Drain(None)
    stale = [v for v in waiting if now - v.oldest >= deadline_s]
    if stale:
        return Drain(min(stale, key=lambda v: v.oldest).length, "stale")
    full = [v for v in waiting if v.rows >= v.cap]
    if full:
        return Drain(min(full, key=lambda v: v.oldest).length, "full")
    if worker_idle:
        return Drain(max(waiting, key=lambda v: (v.rows * v.length, -v.oldest)).length, "idle")
    return Drain(None, wake_at=min(v.oldest for v in waiting) + deadline_s)


def room(views: Sequence[BucketView], packed_rows: int | None = None, queued_tokens: int = 0,
         token_budget: float = math.inf) -> tuple[int, float]:
    """How many more rows (and tokens) may join the queues before the drain decision could say
    "full", its one reason to act before a deadline or an idle worker: padded rows fill a bucket
    to its cap; packed rows (`packed_rows`: the row cap) fill the stream's rows or token budget."""
    if packed_rows is not None:
        return packed_rows - sum(v.rows for v in views), token_budget - queued_tokens
    return min(v.cap - v.rows for v in views), math.inf


def select_rows(lengths: Sequence[int], cap: int, max_tokens: int, pad_to: int | None = None) -> list[int]:
    """Pick a batch from one bucket's rows, given oldest first. The oldest row always goes (so
    every row is served in bounded time); the rest are the rows nearest to it in length (ties:
    the older), which keeps padding low without a sort of the whole queue by length. `pad_to`
    is the fixed padded length (static shapes); otherwise a batch pads to its own longest row.
    Returns indices, ascending. One C-speed argsort: a GPU's queue holds thousands of rows."""
    if not lengths:
        return []
    rest = np.asarray(lengths[1:])
    order = (np.argsort(np.abs(rest - lengths[0]), kind="stable") + 1).tolist()
    if pad_to:  # every row costs the same width: the nearest ones, as many as fit
        return [0] + sorted(order[: max(0, min(cap, max_tokens // pad_to) - 1)])
    chosen, longest = [0], lengths[0]
    for i in order:
        if len(chosen) >= cap:
            break
        width = max(longest, lengths[i])
        if (len(chosen) + 1) * width > max_tokens:
            continue
        chosen.append(i)
        longest = width
    return sorted(chosen)


# Packed rows (ATTENTION=packed): a batch is one stream of tokens, its rows end to end, so a row
# costs its own length whatever the others' lengths are. Only the stream's total is a shape.


def next_packed_drain(views: Sequence[BucketView], now: float, deadline_s: float, worker_idle: bool,
                      queued_tokens: int, token_budget: int, max_rows: int) -> Drain:
    """When to form a packed batch. Any queued row can join any batch, so the question is only
    when: at once if a row is stale or the queue holds a full batch (the token budget or the row
    cap), or the worker is idle; otherwise at the oldest row's deadline. The bucket returned is
    the oldest row's (the batch starts there)."""
    waiting = [v for v in views if v.rows > 0]
    if not waiting:
        return Drain(None)
    oldest = min(waiting, key=lambda v: v.oldest)
    if now - oldest.oldest >= deadline_s:
        return Drain(oldest.length, "stale")
    if queued_tokens >= token_budget or sum(v.rows for v in waiting) >= max_rows:
        return Drain(oldest.length, "full")
    if worker_idle:
        return Drain(oldest.length, "idle")
    return Drain(None, wake_at=oldest.oldest + deadline_s)


def pack_rows(heads: Sequence[tuple[np.ndarray, np.ndarray]], token_budget: int, max_rows: int,
              window_s: float = math.inf) -> list[np.ndarray]:
    """Choose a packed batch from the heads of the bucket queues: per bucket, its first rows'
    (lengths, enqueue times), oldest first. Rows go oldest first across all buckets (so stale
    rows always lead, and the oldest row always goes), each taken if it still fits the token
    budget and the row cap: first fit in age order, as text-embeddings-inference fills its
    batches, except that a row too long for what is left is passed over rather than ending the
    batch (it is older than the rows behind it, so it leads a later batch), and no row admitted
    more than `window_s` after the oldest joins (reorder_window). Returns, per
    bucket, the indices taken (ascending). Vectorised: each round takes the longest prefix that
    fits, then drops the rows that can no longer fit at all."""
    lengths = np.concatenate([h[0] for h in heads]).astype(np.int64)
    if not len(lengths):
        return [np.zeros(0, dtype=np.int64) for _ in heads]
    ages = np.concatenate([h[1] for h in heads])
    owner = np.repeat(np.arange(len(heads)), [len(h[0]) for h in heads])
    index = np.concatenate([np.arange(len(h[0])) for h in heads])
    pool = np.argsort(ages, kind="stable")
    pool = pool[ages[pool] <= ages[pool[0]] + window_s]
    chosen = [pool[:1]]  # the oldest row goes even if the budget is smaller than it
    left, rows, pool = token_budget - int(lengths[pool[0]]), max_rows - 1, pool[1:]
    while len(pool) and rows > 0:
        pool = pool[lengths[pool] <= left]
        if not len(pool):
            break
        total = np.cumsum(lengths[pool])
        k = min(int(np.searchsorted(total, left, side="right")), rows)
        chosen.append(pool[:k])
        left, rows, pool = left - int(total[k - 1]), rows - k, pool[k:]
    taken = np.concatenate(chosen)
    return [np.sort(index[taken[owner[taken] == b]]) for b in range(len(heads))]
