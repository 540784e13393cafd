"""Token vectors, ragged: each text's matrix of tokens x dimension (a multi-vector / ColBERT
model's output, BGE-M3's ColBERT vectors), as one [tokens, dim] float32 array and where each
text's rows start. How a batch's come back from the model (its real tokens only: no padding
crosses to the host), how a request's are gathered from its batches, and how they cross IPC and
gRPC (MultiVectorResponse carries the same arrays).

Text i's vectors are vectors[offsets[i]:offsets[i + 1]]."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class TokenRows:
    vectors: np.ndarray  # [tokens, dim] float32
    offsets: np.ndarray  # [rows + 1] int64

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        """(texts, dim), as a dense batch's [rows, dim]."""
        return len(self.offsets) - 1, self.dim

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        return self.vectors[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def take(self, rows: slice) -> "TokenRows":
        """Rows `rows` (a batch's route: a slice of consecutive rows), as views."""
        start, stop, _ = rows.indices(len(self))
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        return TokenRows(self.vectors[a:b], self.offsets[start : stop + 1] - a)

    __getitem__ = take  # what the engine's routing reads of a batch's output: out[rows]

    def to_bytes(self) -> bytes:
        """offsets (int64), then vectors (float32), little-endian: IPC's payload."""
        return self.offsets.astype("<i8").tobytes() + np.ascontiguousarray(self.vectors, dtype="<f4").tobytes()

    @classmethod
    def from_bytes(cls, data, rows: int, dim: int) -> "TokenRows":
        """What to_bytes wrote (read in place, no copies)."""
        buf = memoryview(data)
        offsets = np.frombuffer(buf, dtype="<i8", count=rows + 1)
        tokens = int(offsets[-1]) if rows + 1 else 0
        vectors = np.frombuffer(buf, dtype="<f4", count=tokens * dim, offset=8 * (rows + 1)).reshape(tokens, dim)
        return cls(vectors, offsets)

    @classmethod
    def gather(cls, pieces: list[tuple[np.ndarray, "TokenRows"]], rows: int, dim: int) -> "TokenRows":
        """A request's rows from the pieces its batches computed ((its row positions, their rows)),
        in the request's order."""
        at: list[np.ndarray | None] = [None] * rows
        for positions, piece in pieces:
            for i, position in enumerate(positions.tolist()):
                at[position] = piece.row(i)
        counts = np.array([len(m) for m in at], dtype=np.int64)
        offsets = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        vectors = np.concatenate(at) if rows else np.zeros((0, dim), np.float32)
        return cls(np.ascontiguousarray(vectors, dtype=np.float32), offsets)

    @classmethod
    def from_padded(cls, states: np.ndarray, keep: np.ndarray) -> "TokenRows":
        """[rows, length, dim] token vectors and a [rows, length] bool of the tokens each row
        keeps → the kept ones, row by row (padding, and whatever else `keep` leaves out, gone)."""
        offsets = np.zeros(states.shape[0] + 1, dtype=np.int64)
        np.cumsum(keep.sum(axis=1), out=offsets[1:])
        return cls(np.ascontiguousarray(states[keep], dtype=np.float32), offsets)
