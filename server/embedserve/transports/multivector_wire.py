"""Token vectors (embedserve.model.token_rows.TokenRows) as the transports answer them: gRPC's
MultiVectorResponse (a multi-vector model's EmbedMultiVector, and BGE-M3's ColBERT output in
EmbedResponse.multivector), and HTTP's JSON (per text, its matrix: a list of token vectors). Each
token vector is encoded as a dense row is (transports/encodings.py: float32, or quantized over
the same ranges). An answer's size is known only once its texts are tokenized (how many token
vectors a text gives): checked then, against MAX_REPLY_BYTES, before anything is encoded."""

from __future__ import annotations

import json

import numpy as np

from embedfleet.v1 import inference_pb2 as pb
from embedserve.errors import InvalidInput, ReplyTooLarge
from embedserve.model.token_rows import TokenRows
from embedserve.transports import encodings, json_reply

GRPC_ENCODINGS = (encodings.FLOAT, *encodings.QUANTIZED)  # base64 is JSON's way to carry floats


def check_encoding(encoding: str, json_text: bool) -> None:
    """Refused before any work: an encoding token vectors do not come in over this transport."""
    if not json_text and encoding not in GRPC_ENCODINGS:
        raise InvalidInput(f"encoding {encoding}: token vectors come as {', '.join(GRPC_ENCODINGS)} over gRPC")


def check_size(rows: TokenRows, encoding: str, json_text: bool, limit: int) -> None:
    """The answer's most bytes (encodings.reply_bytes, per token vector) within `limit`, else
    ReplyTooLarge naming the count."""
    vectors = int(rows.offsets[-1])
    size = encodings.reply_bytes(vectors, rows.dim, encoding, json_text) + 8 * len(rows.offsets)
    if size > limit:
        raise ReplyTooLarge(f"the answer's {vectors} token vectors of {rows.dim} dimensions ({encoding}) would be up to "
                            f"{size} bytes, over MAX_REPLY_BYTES={limit}: send fewer or shorter texts"
                            + (", or a quantized encoding" if encoding == encodings.FLOAT else ""))


def multivector_response(rows: TokenRows, encoding: str, quantization, normalized: bool,
                         limit: int | None = None) -> pb.MultiVectorResponse:
    """TokenRows → MultiVectorResponse: the vectors as float32 bytes (FLOAT) or quantized bytes,
    row-major, text i's rows offsets[i]:offsets[i + 1]. `limit`: MAX_REPLY_BYTES (None: unchecked)."""
    if limit is not None:
        check_size(rows, encoding, False, limit)
    offsets, dim = rows.offsets.tolist(), rows.dim
    if encoding == encodings.FLOAT:
        return pb.MultiVectorResponse(vectors=np.ascontiguousarray(rows.vectors, dtype="<f4").tobytes(),
                                      offsets=offsets, dimension=dim)
    quantized = encodings.quantize(rows.vectors, encoding, quantization, normalized)
    return pb.MultiVectorResponse(quantized=quantized.tobytes(), offsets=offsets, dimension=dim,
                                  encoding=pb.Encoding.Value(encoding.upper()))


def matrix_json(matrix, encoding: str, quantization, normalized: bool) -> str:
    """One text's token vectors as JSON: one json.dumps of the whole matrix where it is float and
    finite (a call per token vector, json_reply.row_json's way, took 1.7x as long, and the worst
    answer, 131k vectors, 43 MB, held the loop 0.26 s at once, against 0.045 s so), else a row at
    a time (non-finite values as null, base64 strings, quantized ints)."""
    if encoding == encodings.FLOAT and np.isfinite(matrix).all():
        return json.dumps(matrix.tolist())
    return "[" + ",".join(json_reply.vectors(matrix, encoding, quantization, normalized)) + "]"


# Values of token vectors written as one piece (~20 ms of json.dumps): a text's matrix of
# hidden states (TEI's /embed_all: 256 tokens x 1,024 dimensions, 0.3 s at once) goes in pieces.
PIECE_VALUES = 16384


async def json_rows(reply: json_reply.Reply, rows: TokenRows, encoding: str, quantization, normalized: bool) -> None:
    """Per text, its token vectors as JSON (a list of rows in `encoding`), written into `reply`
    PIECE_VALUES at a time (the loop gets its turns between them: json_reply.Reply)."""
    step = max(1, PIECE_VALUES // max(1, rows.dim))
    await reply.add("[")
    for i in range(len(rows)):
        matrix = rows.row(i)
        await reply.add("," if i else "")
        await reply.add("[")
        for start in range(0, len(matrix), step):
            piece = matrix_json(matrix[start:start + step], encoding, quantization, normalized)[1:-1]  # its rows only
            await reply.add(piece if start == 0 else "," + piece)
        await reply.add("]")
    await reply.add("]")
