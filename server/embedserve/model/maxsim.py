"""MaxSim (late interaction), as sentence_transformers.util.maxsim scores a query against
documents: for each of the query's token vectors its largest dot product with a document's token
vectors, summed. On the host, in float32 (a request's few documents: one matrix product)."""

from __future__ import annotations

import numpy as np

from embedserve.model.token_rows import TokenRows


def maxsim(query: np.ndarray, documents: TokenRows) -> np.ndarray:
    """[q, dim] query vectors, the documents' token vectors → one score per document (float32).
    A document with no vector (all of it skiplisted) scores 0."""
    out = np.zeros(len(documents), dtype=np.float32)
    if not len(documents.vectors):
        return out
    sims = np.asarray(documents.vectors, dtype=np.float32) @ np.asarray(query, dtype=np.float32).T  # [tokens, q]
    offsets = documents.offsets.tolist()
    for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
        if b > a:
            out[i] = sims[a:b].max(axis=0).sum(dtype=np.float32)
    return out
