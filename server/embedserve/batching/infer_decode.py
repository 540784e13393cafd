"""Decoding of pre-tokenized Infer input: bytes → numpy views, no copies, every check named."""

from __future__ import annotations

import numpy as np

from embedserve.errors import InvalidInput


def decode(
    input_ids: bytes, attention_mask: bytes, shape, vocab_size: int, max_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """→ (ids [rows, seq] int32 read-only view of the request bytes, lengths [rows]).
    Rows must be right-padded: a mask row is n ones then zeros, n >= 1. Raises InvalidInput."""
    if len(shape) != 2:  # counted before it is read: a packed field may hold millions of values
        raise InvalidInput(f"shape must be [rows, seq]; got {len(shape)} values")
    shape = list(shape)
    rows, seq = shape
    if rows < 1 or seq < 1:
        raise InvalidInput(f"shape {shape}: rows and seq must be >= 1")
    if rows > max_rows:
        raise InvalidInput(f"{rows} rows exceed MAX_TEXTS_PER_REQUEST={max_rows}")
    for name, buf in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        if len(buf) % 4:
            raise InvalidInput(f"{name} has {len(buf)} bytes, not a multiple of 4 (int32)")
        if len(buf) != rows * seq * 4:
            raise InvalidInput(f"{name} has {len(buf) // 4} values; shape {shape} needs {rows * seq}")
    ids = np.frombuffer(input_ids, dtype="<i4").reshape(rows, seq)
    mask = np.frombuffer(attention_mask, dtype="<i4").reshape(rows, seq)
    if ((mask != 0) & (mask != 1)).any():
        raise InvalidInput("attention_mask values must be 0 or 1")
    lengths = mask.sum(axis=1, dtype=np.int64)
    if (lengths == 0).any():
        raise InvalidInput(f"row {int(np.flatnonzero(lengths == 0)[0])} has no attended tokens")
    # Right padding: the ones of each row come first.
    if (mask != (np.arange(seq) < lengths[:, None])).any():
        raise InvalidInput("attention_mask rows must be right-padded (ones, then zeros)")
    attended = ids[mask.astype(bool)]
    if attended.min() < 0:
        raise InvalidInput("input_ids must not be negative")
    if attended.max() >= vocab_size:
        raise InvalidInput(f"input_ids must be < the vocabulary size {vocab_size}")
    return ids, lengths
