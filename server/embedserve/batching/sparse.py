"""Sparse (SPLADE) rows in CSR form, and the request's dense rows made so.

Where the sparsifying happens, and why there: the model worker returns a batch as dense float32
[rows, vocabulary] (the device path, CUDA graphs and the engine's result routing stay exactly
those of embeddings), and a request's rows are gathered dense, as an Embed request's are. Its
rows are turned into CSR as soon as the request is complete, in the model's process, before
anything crosses IPC to a front end or is written as JSON or protobuf: a SPLADE row has a few
hundred non-zeros of ~30,000, so CSR is ~1% of the dense bytes. The dense rows live only from the
last batch to here: at most MAX_TEXTS_PER_REQUEST × vocabulary × 4 bytes (512 texts of BERT's
30,522: 62 MB) per request in flight, which admission bounds with the rest of the backlog.
Sparsifying per batch in the worker would lower that peak, at the cost of a second result path
through the engine; not done.

CSR: row i's entries are offsets[i]:offsets[i + 1] of `indices` (int32 vocabulary ids, ascending
within a row) and `values` (float32), as gRPC's EmbedSparseResponse carries them."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import Executor

import numpy as np

# Dense weights sparsified on the event loop; a larger request goes to a thread (numpy's nonzero
# lets the loop run meanwhile): measured on this 2-core VM, 8 rows of BERT's vocabulary took
# ~9 ms, 512 rows ~270 ms, during which the loop saw gaps of at most ~5 ms from the thread.
INLINE_VALUES = 4 * 30522


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


async def sparsify(dense: np.ndarray, executor: Executor | None = None) -> SparseRows:
    """to_csr, off the event loop when the request is large (INLINE_VALUES)."""
    if dense.size <= INLINE_VALUES:
        return to_csr(dense)
    return await asyncio.get_running_loop().run_in_executor(executor, to_csr, dense)


def to_csr(dense: np.ndarray) -> SparseRows:
    """[rows, dim] → its non-zeros, row by row (np.nonzero walks row-major: indices ascend)."""
    rows, cols = np.nonzero(dense)
    offsets = np.zeros(dense.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=dense.shape[0]), out=offsets[1:])
    return SparseRows(cols.astype(np.int32), np.ascontiguousarray(dense[rows, cols], dtype=np.float32), offsets,
                      int(dense.shape[1]))
