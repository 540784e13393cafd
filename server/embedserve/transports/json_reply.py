"""JSON answers built a piece at a time, under MAX_REPLY_BYTES.

An answer's JSON is written by C code that holds the GIL for as long as it runs: one json.dumps
(or pydantic's serializer) of a whole answer stalled the event loop for as long as the answer
was large (152 MB of /tokenize: 1.6 s; 512 vectors of 4,096 floats: ~0.4 s), and a thread does
not help, it holds the GIL the same. So an answer is written a piece at a time (a row, a token
list), each piece a short C call, and the loop gets its turn between slices of SLICE_BYTES; the
pieces are counted as they are written, and an answer that outgrows the bound is refused
(ReplyTooLarge) at that moment, before it is sent. Memory: the pieces and their join, twice the
answer at most."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Iterable, Iterator

import numpy as np
from fastapi.responses import Response

from embedserve.errors import ReplyTooLarge
from embedserve.transports import encodings

SLICE_BYTES = 256 * 1024  # written between the loop's turns (~1 ms of json.dumps)


class Reply:
    """A JSON answer being written: `await add(piece)` for JSON text pieces in order (str), then
    `response()`. `what` names the answer in a refusal."""

    def __init__(self, limit: int, what: str):
        self.limit, self.what = limit, what
        self.parts: list[bytes] = []
        self.size = self._since = 0

    async def add(self, piece: str) -> None:
        data = piece.encode()
        self.parts.append(data)
        self.size += len(data)
        if self.size > self.limit:
            self.parts.clear()
            raise ReplyTooLarge(f"{self.what} would be more than {self.size} bytes, over MAX_REPLY_BYTES="
                                f"{self.limit}: send fewer inputs")
        self._since += len(data)
        if self._since >= SLICE_BYTES:
            self._since = 0
            await asyncio.sleep(0)

    async def array(self, pieces: Iterable[str]) -> None:
        """`[piece, piece, ...]`."""
        await self.add("[")
        for i, piece in enumerate(pieces):
            await self.add(piece if i == 0 else "," + piece)
        await self.add("]")

    def response(self, status_code: int = 200) -> Response:
        body = b"".join(self.parts)
        self.parts = []  # the pieces go as the whole is made: twice the answer at most, not three times
        return Response(body, status_code=status_code, media_type="application/json")


def row_json(row: np.ndarray) -> str:
    """One vector as JSON: floats as Python writes them (shortest round trip), a non-finite value
    as null (JSON has no NaN: pydantic's choice, which these answers were written by before);
    a quantized row's ints as they are."""
    values = row.tolist()
    if row.dtype.kind == "f" and not np.isfinite(row).all():
        values = [v if np.isfinite(v) else None for v in values]
    return json.dumps(values)


def dumps(value) -> str:
    """A small value (a scalar, a short string, a few fields) as JSON; a non-finite float as null
    (JSON has no NaN), as the rows are written."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), ensure_ascii=False)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def vectors(rows: np.ndarray, encoding: str, quantization: "encodings.Quantization", normalized: bool) -> Iterator[str]:
    """Each row as JSON in `encoding` (encodings.py): a list of floats, a base64 string of its
    float32 bytes, or a quantized list of ints (over `quantization`'s ranges, as for rows that
    are `normalized` or not); a row at a time, as the answer is written."""
    if encoding == encodings.BASE64:
        return (f'"{text}"' for text in encodings.base64_rows(rows))
    if encoding != encodings.FLOAT:
        rows = encodings.quantize(rows, encoding, quantization, normalized)
    return map(row_json, rows)
