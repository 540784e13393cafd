"""Token vectors (embedserve.model.token_rows.TokenRows: a multi-vector model's, BGE-M3's ColBERT
vectors) over IPC, model process → front end: the answer's header says how many rows, token
vectors and dimensions; its bytes are TokenRows.to_bytes (offsets, then the vectors), read in
place on arrival."""

from __future__ import annotations

from embedserve.model.token_rows import TokenRows

KEY = "token_vectors"  # in a reply's header: its rows are TokenRows, of this many vectors in all


def reply(rows: TokenRows, tokens: int) -> tuple[dict, bytes]:
    """A request's TokenRows → (reply header, payload)."""
    return {"rows": len(rows), "dim": rows.dim, KEY: int(rows.offsets[-1]), "tokens": tokens}, rows.to_bytes()


def rows_of(header: dict, payload) -> TokenRows | None:
    """What `reply` sent, back as TokenRows; None: the reply holds other rows."""
    if KEY not in header:
        return None
    return TokenRows.from_bytes(payload, header["rows"], header["dim"])
