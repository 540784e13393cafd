"""An embed batch's raw token states, for the rows that asked (TEI's /embed_all; flags:
embedserve.model.states_rows): their real tokens' last hidden states picked by index on the
device, then copied, and made float32 on the host; nothing when no row asked (the embed hot path
copies its pooled rows only, and such a batch runs outside the captured graphs: Encoder.run). On
the worker's thread, after the forward."""

from __future__ import annotations

import numpy as np
import torch

from embedserve.model.batches import Batch, PackedBatch
from embedserve.model.states_rows import asked
from embedserve.model.token_rows import TokenRows


def asking(batch: Batch | PackedBatch) -> bool:
    """Whether any row of the batch asked (its first id, on the host)."""
    if isinstance(batch, PackedBatch):
        return bool(asked(batch.input_ids.numpy()[batch.cu_seqlens[: batch.rows].numpy().astype(np.int64)]).any())
    return bool(asked(batch.input_ids[: batch.rows, 0].numpy()).any())


def picked(hidden: torch.Tensor, batch: Batch | PackedBatch) -> TokenRows | None:
    """The forward's hidden states ([B, L, H] padded, [T, H] packed) → the asking rows' token
    states (other rows: none), or None when no row of the batch asked."""
    if isinstance(batch, PackedBatch):
        cu = batch.cu_seqlens[: batch.rows + 1].numpy().astype(np.int64)
        asking = asked(batch.input_ids.numpy()[cu[:-1]])
        if not asking.any():
            return None
        counts = np.where(asking, np.diff(cu), 0)
        index = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in np.flatnonzero(asking)])
    else:
        asking = asked(batch.input_ids[: batch.rows, 0].numpy())
        if not asking.any():
            return None
        keep = batch.attention_mask[: batch.rows].numpy().astype(bool) & asking[:, None]
        counts = keep.sum(axis=1)
        r, t = np.nonzero(keep)
        index = r * batch.input_ids.shape[1] + t
    flat = hidden.reshape(-1, hidden.shape[-1])
    # Gathered in the model's dtype, converted on the host: no float32 copy on the device.
    vectors = flat[torch.from_numpy(index).to(flat.device)].cpu().float().numpy()
    offsets = np.zeros(batch.rows + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return TokenRows(np.ascontiguousarray(vectors, dtype=np.float32), offsets)
