"""Pure batching decisions: which bucket a row goes to, which bucket to drain next, which rows
form the batch and what shape it runs at. No I/O, no clocks: callers pass `now`."""

from __future__ import annotations

import bisect
import dataclasses
from typing import Sequence

import numpy as np

# Batch sizes CUDA graphs are captured for; a batch of n rows runs at the smallest size >= n.
# Steps of at most 1.5x: a partial batch pads at most a third of its rows.
LADDER = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def choose_bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `length` tokens; the largest if none does (the caller
    truncates or rejects before that)."""
    i = bisect.bisect_left(buckets, length)
    return buckets[min(i, len(buckets) - 1)]


def length_ladder(buckets: Sequence[int]) -> tuple[int, ...]:
    """Padded lengths of static shapes: every bucket and the midpoint below it. Rows queue by
    bucket, but a batch (rows near each other in length) pads to the smallest of these that
    holds its longest row: at most 1.5x its length instead of 2x, for twice the graphs."""
    lengths, prev = set(buckets), 0
    for b in buckets:
        if b - prev >= 2:
            lengths.add(prev + (b - prev) // 2)
        prev = b
    return tuple(sorted(lengths))


def fit_length(longest: int, ladder: Sequence[int]) -> int:
    """The static length a batch whose longest row has `longest` tokens runs at."""
    return ladder[min(bisect.bisect_left(ladder, longest), len(ladder) - 1)]


def ladder_size(rows: int, ladder: Sequence[int] = LADDER) -> int:
    """The captured batch size a batch of `rows` rows runs at."""
    i = bisect.bisect_left(ladder, rows)
    if i == len(ladder):
        raise ValueError(f"{rows} rows exceed the largest captured batch {ladder[-1]}")
    return ladder[i]


def ladder_upto(limit: int, ladder: Sequence[int] = LADDER) -> tuple[int, ...]:
    """Ladder sizes no larger than `limit` (at least the smallest one)."""
    sizes = tuple(s for s in ladder if s <= limit)
    return sizes or (ladder[0],)


def bucket_row_limit(bucket: int, max_batch_size: int, max_tokens: int, static: bool) -> int:
    """Most rows a batch of this bucket may hold under MAX_BATCH_SIZE and MAX_TOKENS_PER_BATCH
    (rows are at most `bucket` long). Static shapes round down to a ladder size."""
    rows = max(1, min(max_batch_size, max_tokens // bucket))
    return ladder_upto(rows)[-1] if static else rows


def choose_cap(sweep: Sequence[tuple[int, float]], keep: float = 0.95) -> int:
    """Given (batch size, tokens/s) measurements, the smallest batch size within `keep` of the
    best throughput: bigger batches that do not pay only add latency."""
    if not sweep:
        raise ValueError("empty sweep")
    best = max(rate for _, rate in sweep)
    return min(size for size, rate in sweep if rate >= keep * best)


def sweep_should_stop(sweep: Sequence[tuple[int, float]], drop: float = 0.85) -> bool:
    """Stop measuring larger batches once throughput has clearly fallen from its best."""
    best = max(rate for _, rate in sweep)
    return sweep[-1][1] < drop * best


@dataclasses.dataclass(frozen=True)
class BucketView:
    """What the drain decision sees of one bucket."""

    length: int
    rows: int
    oldest: float  # enqueue time of the oldest row; meaningless when rows == 0
    cap: int  # rows that make the bucket full


@dataclasses.dataclass(frozen=True)
class Drain:
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
