"""Raw token states (TEI's /embed_all, task embed): an embed batch any of whose rows asked for
them (STATES on the row's first id, put there by embedserve.batching.flagged_tokenization) gives
its pooled rows and, for the asking rows only, every token's last hidden state (special tokens
included, before pooling, Dense or Normalize: what TEI answers). A request takes one side of it
(queues.PendingRequest.deliver): the states if it asked, else its dense rows, so a batch mixing
both never changes what an embeddings request gets."""

from __future__ import annotations

import dataclasses

import numpy as np

from embedserve.model.token_rows import TokenRows

STATES = 1 << 30  # on an embed row's first id: it asks for its token states (bits above every vocabulary)


def flags_of(side: str) -> int:
    """An embed request's Texts.side → its rows' flags."""
    return STATES if side == "states" else 0


def asked(first_ids) -> np.ndarray:
    """Rows' first ids → bool, which asked for their token states."""
    return (np.asarray(first_ids).astype(np.int64) & STATES) != 0


@dataclasses.dataclass(frozen=True)
class StatesRows:
    dense: np.ndarray  # [rows, dim] the pooled rows, every row's
    states: TokenRows  # the asking rows' token states (others: none)

    @property
    def shape(self) -> tuple[int, int]:
        return self.dense.shape

    def __len__(self) -> int:
        return int(self.dense.shape[0])

    def take(self, rows: slice) -> "StatesRows":
        return StatesRows(self.dense[rows], self.states.take(rows))

    __getitem__ = take  # the engine's routing: out[rows]

    def side(self, states: bool):
        """What a request gets of its rows: the token states if it asked, else the dense rows."""
        return self.states if states else self.dense
