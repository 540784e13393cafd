"""What the model runs: one forward pass over padded rows (Batch) or over packed rows (PackedBatch).

Packed rows: a batch laid out as one stream of tokens, its rows end to end with no padding
between them, plus where each row starts (cu_seqlens), each token's position in its row and the
row it belongs to. Host side only (numpy, on the event loop); the model side is embedserve.model.varlen.

With static shapes the stream is padded at its end to a total-token size of the ladder, and
cu_seqlens has a fixed length for that size: the real rows, then the padding tail cut into rows
no longer than the kernel's pinned longest row, then zero-length rows. Every token then belongs
to a row no longer than the pin, so a captured graph replays any batch of that size.

The batcher forms them (embedserve.batching); `routes` says where each row's result goes, which
the model carries back unread."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from embedserve.model.shapes import fit_length, packed_slots, token_ladder


@dataclasses.dataclass(eq=False)
class Batch:
    """One forward pass: `rows` real rows first, then any dummy rows a captured shape needs."""

    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] int64
    rows: int
    real_tokens: int
    routes: list[tuple[object, np.ndarray, slice]]  # the batcher's: request, its positions, batch rows (read by it, not the model)
    id: int = 0  # the batcher's number for it, and when it was formed (monotonic): for traces
    formed: float = 0.0
    started: float = 0.0  # when the worker began running it (monotonic)
    due: float = 0.0  # when its oldest row has waited its drain budget: a shared device's order (model.device)
    norms: np.ndarray | None = None  # [rows] each row's norm before Normalize, where the model reports it (LONG_TEXTS=window)

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.shape[0] * self.input_ids.shape[1])


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """How packed batches are shaped for one runner."""

    max_len: int  # the longest row (the largest bucket): attention's max sequence length, pinned
    max_rows: int  # rows per batch (MAX_BATCH_SIZE)
    ladder: tuple[int, ...] | None  # stream sizes graphs are captured for; None: exact sizes (eager)

    @classmethod
    def for_plan(cls, longest: int, max_rows: int, max_tokens: int, static: bool) -> "PackSpec":
        budget = max(max_tokens, longest)  # a row of the largest bucket must fit a batch
        return cls(longest, max_rows, token_ladder(budget) if static else None)

    @property
    def max_tokens(self) -> int | None:
        return self.ladder[-1] if self.ladder else None

    def shape(self, tokens: int, rows: int) -> tuple[int, int]:
        """(stream size, cu_seqlens slots) a batch of `rows` rows and `tokens` tokens runs at."""
        if self.ladder is None:
            return tokens, rows
        if tokens > self.ladder[-1]:
            raise ValueError(f"{tokens} tokens exceed the largest captured stream {self.ladder[-1]}")
        size = fit_length(tokens, self.ladder)
        return size, packed_slots(size, self.max_rows, self.max_len)


@dataclasses.dataclass(eq=False)
class PackedBatch:
    """One forward pass over packed rows: rows 0..rows-1 are the real ones; `routes` as in
    Batch (request, its positions, rows of the output)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: 0, 1, ... within each row (the model adds its own offset)
    segments: torch.Tensor  # [T] int64: the row of each token
    cu_seqlens: torch.Tensor  # [S + 1] int32: row i is tokens cu[i]:cu[i + 1]
    max_len: int  # attention's max sequence length: pinned with static shapes, else the longest row
    rows: int
    real_tokens: int
    routes: list[tuple[object, np.ndarray, slice]]  # the batcher's: request, its positions, rows
    id: int = 0  # as Batch's
    formed: float = 0.0
    started: float = 0.0
    due: float = 0.0
    norms: np.ndarray | None = None  # as Batch's

    @property
    def padded_tokens(self) -> int:
        """Tokens the device computes (the stream, tail included)."""
        return int(self.input_ids.shape[0])


def layout(lengths: np.ndarray, spec: PackSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Row lengths (batch order) → (cu_seqlens, positions, segments, stream size) with the tail
    rows and zero-length rows a static shape needs. Pure numpy."""
    real = int(lengths.sum())
    size, slots = spec.shape(real, len(lengths))
    tail = size - real
    pieces = [spec.max_len] * (tail // spec.max_len) + ([tail % spec.max_len] if tail % spec.max_len else [])
    rows = np.concatenate([lengths, np.asarray(pieces, dtype=np.int64)]).astype(np.int64)
    cu = np.full(slots + 1, size, dtype=np.int32)
    cu[0] = 0
    cu[1 : len(rows) + 1] = np.cumsum(rows)
    starts = np.repeat(cu[: len(rows)].astype(np.int64), rows)
    positions = np.arange(size, dtype=np.int64) - starts
    segments = np.repeat(np.arange(len(rows), dtype=np.int64), rows)
    return cu, positions, segments, size


def random_packed(tokens: int, spec: PackSpec, vocab_size: int, rng: np.random.Generator,
                  shortest: int = 2) -> PackedBatch:
    """A warm-up stream of `tokens` real tokens in rows of random lengths (shortest..max_len, at
    most max_rows rows): what the device computes at that size, captured and timed."""
    lengths: list[int] = []
    left = tokens
    while left > 0 and len(lengths) < spec.max_rows:
        # Rows long enough that the row cap still lets them fill the stream (a small
        # MAX_BATCH_SIZE would otherwise leave it mostly tail and time a near-empty batch).
        low = min(spec.max_len, max(shortest, -(-left // (spec.max_rows - len(lengths)))))
        n = min(left, int(rng.integers(low, spec.max_len + 1)))
        lengths.append(n)
        left -= n
    row_lengths = np.asarray(lengths, dtype=np.int64)
    cu, positions, segments, size = layout(row_lengths, spec)
    low = min(1000, vocab_size - 1)
    ids = rng.integers(low, vocab_size, size=size, dtype=np.int64)
    max_len = spec.max_len if spec.ladder else int(row_lengths.max())
    return PackedBatch(torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(segments),
                       torch.from_numpy(cu), max_len, len(lengths), int(row_lengths.sum()), [])


def padded_rows(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed batch's real rows, right-padded: (input_ids, attention_mask), as the padded
    path lays them out (with pad id 0). For checking one layout against the other."""
    cu, stream = batch.cu_seqlens.tolist(), batch.input_ids
    lengths = [cu[i + 1] - cu[i] for i in range(batch.rows)]
    ids = torch.zeros((batch.rows, max(lengths)), dtype=torch.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = stream[cu[i] : cu[i] + n]
    mask = (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
    return ids, mask
