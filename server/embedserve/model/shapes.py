"""The static shapes the model runs and how big its batches may be: the padded lengths and batch
sizes CUDA graphs are captured for, the packed streams' token sizes, and the warm-up sweep's
choice of each bucket's cap. Pure: the model worker measures, the batcher forms batches of
these shapes (embedserve.batching.decisions)."""

from __future__ import annotations

import bisect
from typing import Sequence


# Batch sizes CUDA graphs are captured for; a batch of n rows runs at the smallest size >= n.
# Steps of at most 1.5x: a partial batch pads at most a third of its rows.
LADDER = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


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


def served_shapes(buckets: Sequence[int], caps: dict[int, int], static: bool) -> list[tuple[int, int]]:
    """Every (padded length, rows) shape a batcher of these caps runs, smallest bucket first.
    Eager: each bucket at its cap (fewer rows run the same kernels, nothing to capture). Static:
    every ladder size up to its cap at each bucket and at each ladder length below it, down to
    the bucket before (fit_length pads a batch to the first of these that holds its rows)."""
    if not static:
        return [(b, caps[b]) for b in buckets]
    shapes, below, lengths = [], 0, length_ladder(buckets)
    for b in buckets:
        for length in (n for n in lengths if below < n <= b):
            shapes += [(length, rows) for rows in ladder_upto(caps[b])]
        below = b
    return shapes


def token_ladder(max_tokens: int, smallest: int = 64) -> tuple[int, ...]:
    """Total-token counts CUDA graphs are captured for, up to `max_tokens` (always included):
    each power of two and its quarter points (64, 80, 96, 112, 128, 160, ...), so a stream pads
    at most a fifth of its tokens to the next size, for ~4 graphs per doubling (37 up to 32768)."""
    sizes, base = set(), smallest
    while base <= max_tokens:
        sizes.update(s for s in (base, base * 5 // 4, base * 3 // 2, base * 7 // 4) if s <= max_tokens)
        base *= 2
    return tuple(sorted(sizes | {max_tokens}))


def packed_slots(tokens: int, max_rows: int, max_len: int) -> int:
    """Entries of a stream's cu_seqlens (minus the leading 0): up to `max_rows` real rows, then
    the stream's padding tail cut into rows of at most `max_len` tokens (the kernel's pinned
    longest row), then zero-length rows. A fixed count per stream size, as a captured graph
    needs: the kernels read the rows' bounds from the device, never their number."""
    return min(max_rows, tokens) + -(-tokens // max_len)
