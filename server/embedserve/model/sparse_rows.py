"""Sparse rows in CSR form: how a SPLADE model's batch comes back from the model (Encoder.run makes
its dense [rows, vocabulary] output sparse on the model worker's thread, where the time counts as
model-busy time and so in the service rate), how a request's rows are gathered from its batches,
and how they cross IPC and gRPC. A SPLADE row has a few hundred non-zeros of ~30,000, so nothing
after the worker holds a request's rows dense: a request of 512 texts holds ~1 MB, not 62.

CSR: row i's entries are offsets[i]:offsets[i + 1] of `indices` (int32 vocabulary ids, ascending
within a row) and `values` (float32), as gRPC's EmbedSparseResponse carries them."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SparseRows:
    indices: np.ndarray  # [nnz] int32
    values: np.ndarray  # [nnz] float32
    offsets: np.ndarray  # [rows + 1] int64
    dim: int  # the vocabulary's size

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.offsets) - 1, self.dim

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.indices[start:end], self.values[start:end]

    def to_bytes(self) -> bytes:
        """offsets (int64), then indices (int32), then values (float32), little-endian: IPC's payload."""
        return b"".join((self.offsets.astype("<i8").tobytes(), self.indices.astype("<i4").tobytes(),
                         self.values.astype("<f4").tobytes()))

    @classmethod
    def from_bytes(cls, data, rows: int, nnz: int, dim: int) -> "SparseRows":
        """What to_bytes wrote (read in place, no copies)."""
        buf = memoryview(data)
        offsets = np.frombuffer(buf, dtype="<i8", count=rows + 1)
        at = 8 * (rows + 1)
        indices = np.frombuffer(buf, dtype="<i4", count=nnz, offset=at)
        values = np.frombuffer(buf, dtype="<f4", count=nnz, offset=at + 4 * nnz)
        return cls(indices, values, offsets, dim)

    def take(self, rows: slice) -> "SparseRows":
        """Rows `rows` (a batch's route: a slice of consecutive rows), as views."""
        start, stop, _ = rows.indices(self.shape[0])
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        return SparseRows(self.indices[a:b], self.values[a:b], self.offsets[start : stop + 1] - a, self.dim)

    __getitem__ = take  # what the engine's routing reads of a batch's output: out[rows]

    @classmethod
    def gather(cls, pieces: list[tuple[np.ndarray, "SparseRows"]], rows: int, dim: int) -> "SparseRows":
        """A request's rows from the pieces its batches computed ((its row positions, their rows)),
        in the request's order."""
        at = [None] * rows
        for positions, piece in pieces:
            for i, position in enumerate(positions.tolist()):
                at[position] = piece.row(i)
        counts = np.array([len(ids) for ids, _ in at], dtype=np.int64)
        offsets = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        indices = np.concatenate([ids for ids, _ in at]) if rows else np.zeros(0, np.int32)
        values = np.concatenate([v for _, v in at]) if rows else np.zeros(0, np.float32)
        return cls(indices.astype(np.int32, copy=False), values.astype(np.float32, copy=False), offsets, dim)

    def dense(self) -> np.ndarray:
        """[rows, dim] float32 (for checks; the server never needs it)."""
        out = np.zeros(self.shape, dtype=np.float32)
        for i in range(self.shape[0]):
            ids, values = self.row(i)
            out[i, ids] = values
        return out


def to_csr(dense: np.ndarray) -> SparseRows:
    """[rows, dim] → its non-zeros, row by row (np.nonzero walks row-major: indices ascend)."""
    rows, cols = np.nonzero(dense)
    offsets = np.zeros(dense.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=dense.shape[0]), out=offsets[1:])
    return SparseRows(cols.astype(np.int32), np.ascontiguousarray(dense[rows, cols], dtype=np.float32), offsets,
                      int(dense.shape[1]))
