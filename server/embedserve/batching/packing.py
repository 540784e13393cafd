"""Packed rows from the queues: the taken rows laid end to end in one stream
(embedserve.model.batches says how a stream is laid out and what the model makes of it)."""

from __future__ import annotations

import numpy as np
import torch

from embedserve.batching.queues import QueuedRow
from embedserve.model.batches import PackedBatch, PackSpec, layout


def assemble_packed(taken: list[QueuedRow], pad_id: int, spec: PackSpec) -> PackedBatch:
    """Concatenate the taken rows into one stream. Rows of one chunk are gathered with one masked
    index (row-major order keeps each row's tokens together and the rows in order)."""
    groups: dict[int, tuple] = {}
    for r in taken:
        groups.setdefault(id(r.chunk), (r.chunk, []))[1].append(r.index)
    parts, lengths, routes, pos = [], [], [], 0
    for chunk, idx in groups.values():
        n = chunk.lengths[idx].astype(np.int64)
        width = int(n.max())
        ids = chunk.ids[idx, :width]
        parts.append(ids[np.arange(width) < n[:, None]])
        lengths.append(n)
        routes.append((chunk.request, chunk.positions[idx], slice(pos, pos + len(idx))))
        pos += len(idx)
    row_lengths = np.concatenate(lengths)
    cu, positions, segments, size = layout(row_lengths, spec)
    ids = np.full(size, pad_id, dtype=np.int64)
    real = int(row_lengths.sum())
    ids[:real] = np.concatenate(parts)
    max_len = spec.max_len if spec.ladder else int(row_lengths.max())
    return PackedBatch(torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(segments),
                       torch.from_numpy(cu), max_len, len(taken), real, routes)


