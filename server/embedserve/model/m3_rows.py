"""BGE-M3's three outputs of one pass (task bgem3), as one result type: per text its dense vector
(a row of `dense`), its lexical weights (a row of `sparse`, CSR over the vocabulary) and its
ColBERT vectors (a row of `colbert`, ragged). The engine routes a batch's rows by slicing
(`take`, `out[rows]`), a request split over batches is put together by `gather`
(batching.queues.PendingRequest.deliver), and front ends (FRONTENDS > 1) receive it over IPC
(`wire`/`from_wire`). Every part keeps the same row order."""

from __future__ import annotations

import dataclasses

import numpy as np

from embedserve.model.sparse_rows import SparseRows
from embedserve.model.token_rows import TokenRows

# The outputs a request may ask for, as the HTTP field names them (gRPC: enum Output).
DENSE, SPARSE, COLBERT = "dense", "sparse", "colbert"
OUTPUTS = (DENSE, SPARSE, COLBERT)

# A row's asked outputs beyond dense, on its first id (as a multi-vector row's side, bits above
# every vocabulary: ids are int32, the largest vocabularies < 2^18): put there by the tokenizer
# (embedserve.batching.flagged_tokenization), cleared on the device before the encoder reads the ids,
# read by the worker, which copies and reduces only what a row asked for. Dense is every row's:
# a few KB, and what an embeddings client (and pre-tokenized Infer) gets.
FLAGS = {SPARSE: 1 << 30, COLBERT: 1 << 29}
ID_BITS = (1 << 29) - 1


def flags_of(outputs: str) -> int:
    """A request's outputs ("sparse,colbert": Texts.side of a bgem3 request) → its rows' flags."""
    return sum(bit for name, bit in FLAGS.items() if name in outputs.split(","))


def asked_rows(first_ids: np.ndarray, output: str) -> np.ndarray:
    """The rows' first ids (flags on) → bool, which rows asked for `output`."""
    return (np.asarray(first_ids).astype(np.int64) & FLAGS[output]) != 0


@dataclasses.dataclass(frozen=True)
class M3Rows:
    dense: np.ndarray  # [rows, H] float32, normalized
    sparse: SparseRows  # [rows, vocabulary]: each token id's largest weight, special tokens left out
    colbert: TokenRows  # per row its tokens after the first (CLS), normalized

    @property
    def dim(self) -> int:
        """The dense vector's dimensions: what `dimensions` and the encodings apply to."""
        return int(self.dense.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.dense.shape[0]), self.dim

    def __len__(self) -> int:
        return int(self.dense.shape[0])

    def take(self, rows: slice) -> "M3Rows":
        """Rows `rows` (a batch's route: consecutive rows), as views."""
        return M3Rows(self.dense[rows], self.sparse.take(rows), self.colbert.take(rows))

    __getitem__ = take  # what the engine's routing reads of a batch's output: out[rows]

    @classmethod
    def gather(cls, pieces: list[tuple[np.ndarray, "M3Rows"]], rows: int, dim: int) -> "M3Rows":
        """A request's rows from its batches' pieces ((its row positions, their rows)), in order."""
        dense = np.empty((rows, dim), dtype=np.float32)
        for positions, piece in pieces:
            dense[positions] = piece.dense
        vocab = pieces[0][1].sparse.dim if pieces else 0
        width = pieces[0][1].colbert.dim if pieces else 0
        return cls(dense, SparseRows.gather([(p, m.sparse) for p, m in pieces], rows, vocab),
                   TokenRows.gather([(p, m.colbert) for p, m in pieces], rows, width))

    def wire(self) -> tuple[dict, bytes]:
        """IPC's header fields and payload: dense float32, then the sparse rows' bytes, then the
        ColBERT rows' (embedserve.frontends.door)."""
        dense = np.ascontiguousarray(self.dense, dtype="<f4").tobytes()
        sparse = self.sparse.to_bytes()
        header = {"m3": True, "rows": len(self), "dim": self.dim, "nnz": len(self.sparse.values),
                  "vocab": self.sparse.dim, "colbert_dim": self.colbert.dim, "sparse_at": len(dense),
                  "colbert_at": len(dense) + len(sparse)}
        return header, dense + sparse + self.colbert.to_bytes()

    @classmethod
    def from_wire(cls, header: dict, data) -> "M3Rows":
        """What `wire` wrote (read in place, no copies)."""
        buf = memoryview(data)
        rows, dim = header["rows"], header["dim"]
        dense = np.frombuffer(buf, dtype="<f4", count=rows * dim).reshape(rows, dim)
        sparse = SparseRows.from_bytes(buf[header["sparse_at"]: header["colbert_at"]], rows, header["nnz"],
                                       header["vocab"])
        colbert = TokenRows.from_bytes(buf[header["colbert_at"]:], rows, header["colbert_dim"])
        return cls(dense, sparse, colbert)


def dense_of(rows):
    """An embed route's rows: the dense vectors of a bgem3 result, anything else as it is."""
    return rows.dense if isinstance(rows, M3Rows) else rows
