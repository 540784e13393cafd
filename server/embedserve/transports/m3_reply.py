"""What a request of a BGE-M3 model (task bgem3) asks for and how its answer is written.

One pass computes the three outputs (embedserve.model.m3); a request names the ones it wants:
gRPC `EmbedRequest.outputs` (enum Output: DENSE, SPARSE, MULTIVECTOR), HTTP `outputs` on
/embed and /v1/embeddings ("dense", "sparse", "colbert"). None named: the dense vector alone,
answered exactly as an embedding model answers (so an embeddings client needs nothing new).
Any other task answers only "dense"; asking it for more is the caller's error (400 /
INVALID_ARGUMENT; HTTP: the schema's 422), named.

The answers: gRPC fills EmbedResponse's `embeddings` (or `quantized`) and `shape` for dense,
`sparse` (EmbedSparseResponse, CSR) and `multivector` (MultiVectorResponse: each text's ColBERT
vectors, in the request's encoding, as dense rows are). HTTP with outputs other than ["dense"]:
/embed answers per input an object {"dense": vector, "sparse": [{"index", "value"}, ...],
"colbert": [vector, ...]} with the asked keys; /v1/embeddings adds "sparse" and "colbert" to each
data item (and leaves out "embedding" when dense is not asked). Vectors in the request's encoding;
`dimensions` applies to the dense vector only."""

from __future__ import annotations

from typing import Callable, Iterator, Literal

import numpy as np
from fastapi import APIRouter
from pydantic import Field

from embedfleet.v1 import inference_pb2 as pb
from embedserve.errors import InvalidInput, ReplyTooLarge
from embedserve.model.m3_rows import COLBERT, DENSE, OUTPUTS, SPARSE, M3Rows
from embedserve.transports import encodings, http_sparse, json_reply

_PROTO = {pb.DENSE: DENSE, pb.SPARSE: SPARSE, pb.MULTIVECTOR: COLBERT}

Output = Literal["dense", "sparse", "colbert"]


def outputs_field(task: str):
    """HTTP's `outputs` as the schema states it for a model of `task`: every embed route has it;
    a bgem3 model's takes its three outputs, any other's only dense (422 naming the field, as
    the schema says; `wanted` refuses what a payload naming another model asks, 400)."""
    kind = Output if task == "bgem3" else Literal["dense"]
    return (list[kind] | None, Field(None, min_length=1, max_length=len(OUTPUTS), description=(
        "Extension, task bgem3 (BGE-M3): the outputs wanted of one pass, any of dense (the vector), sparse "
        "(lexical weights: [{index, value}] per input), colbert (a vector per token after CLS). Default: dense, "
        "answered as without the field. Other tasks: dense only.")))


def wanted(outputs, task: str) -> tuple[str, ...]:
    """The asked outputs (names, proto ints or none) → their names in a fixed order; refused
    (InvalidInput) where the model cannot answer them."""
    names = []
    for o in outputs or ():
        if isinstance(o, str):
            names.append(o)
        elif o in _PROTO:
            names.append(_PROTO[o])
        else:
            raise InvalidInput(f"outputs: {o} is not an Output ({', '.join(pb.Output.keys())})")
    asked = tuple(n for n in OUTPUTS if n in names) or (DENSE,)
    if task != "bgem3" and asked != (DENSE,):
        raise InvalidInput(f"outputs {', '.join(asked)}: this model does {task} and answers dense vectors only "
                           "(sparse and ColBERT outputs are a BGE-M3 model's, TASK=bgem3)")
    return asked


def _size_check(rows: M3Rows, asked: tuple[str, ...], per_value: int, limit: int) -> None:
    """Sparse and ColBERT sizes are known only once computed: refused before any is written."""
    size = (8 * len(rows.sparse.values) if SPARSE in asked else 0) + \
        (per_value * rows.colbert.vectors.size if COLBERT in asked else 0)
    if size > limit:
        raise ReplyTooLarge(f"the answer's sparse and ColBERT outputs would be about {size} bytes, over "
                            f"MAX_REPLY_BYTES={limit}: send fewer texts or ask for fewer outputs")


def grpc_finish(asked: tuple[str, ...], dense: Callable, encoding: str, quantization,
                max_reply_bytes: int) -> Callable:
    """`dense(rows)`: the embed answer of dense rows (grpc_server's) → how an M3Rows becomes the
    EmbedResponse with the asked outputs."""
    if asked == (DENSE,):
        return lambda out: dense(out.dense if isinstance(out, M3Rows) else out)

    def finish(out: M3Rows) -> pb.EmbedResponse:
        _size_check(out, asked, 1 if encoding != encodings.FLOAT else 4, max_reply_bytes)
        response = dense(out.dense) if DENSE in asked else pb.EmbedResponse()
        if SPARSE in asked:
            s = out.sparse
            response.sparse.CopyFrom(pb.EmbedSparseResponse(
                indices=s.indices.astype("<i4", copy=False).tobytes(), values=s.values.astype("<f4", copy=False).tobytes(),
                offsets=s.offsets.tolist(), dimension=s.dim))
        if COLBERT in asked:
            response.multivector.CopyFrom(multivector_response(out.colbert, encoding, token_range(quantization)))
        return response

    return finish


def token_range(quantization):
    """The range ColBERT vectors quantize over: the fixed one (QUANTIZE_RANGE r). A calibrated
    range is each dense dimension's, measured on dense vectors: not a token vector's."""
    return getattr(quantization, "r", quantization)


def multivector_response(tokens, encoding: str, quantization) -> pb.MultiVectorResponse:
    """TokenRows → MultiVectorResponse: float32 `vectors`, or every token's vector quantized as a
    (normalized) dense row is."""
    offsets, dim = tokens.offsets.tolist(), tokens.dim
    if encoding == encodings.FLOAT:
        return pb.MultiVectorResponse(vectors=tokens.vectors.astype("<f4", copy=False).tobytes(), offsets=offsets,
                                      dimension=dim)
    quantized = encodings.quantize(tokens.vectors, encoding, quantization, True)
    return pb.MultiVectorResponse(quantized=quantized.tobytes(), offsets=offsets, dimension=dim,
                                  encoding=pb.Encoding.Value(encoding.upper()))


def sparse_json(rows, i: int) -> str:
    ids, values = rows.row(i)
    return "[" + ",".join(f'{{"index":{k},"value":{v!r}}}' for k, v in zip(ids.tolist(), values.tolist())) + "]"


def colbert_json(tokens, i: int, encoding: str, quantization) -> str:
    return "[" + ",".join(json_reply.vectors(tokens.row(i), encoding, quantization, True)) + "]"


def items(rows: M3Rows, dense_rows: np.ndarray | None, asked: tuple[str, ...], encoding: str, quantization,
          limit: int, dense_key: str = DENSE, prefix: Callable[[int], str] = lambda i: "") -> Iterator[str]:
    """Each input's JSON object (its asked keys; dense as `dense_key`, from `dense_rows`: the
    dense vectors cut to the asked dimensions); `prefix(i)`: fields written first. Refused at
    once if too large; then made an input at a time, as json_reply.Reply writes them (the event
    loop gets its turns between them: one input's ColBERT vectors are hundreds of rows)."""
    _size_check(rows, asked, encodings.JSON_FLOAT_BYTES if encoding == encodings.FLOAT else 5, limit)
    dense = json_reply.vectors(dense_rows, encoding, quantization, True) if DENSE in asked else None

    def each() -> Iterator[str]:
        for i in range(len(rows)):
            parts = [] if dense is None else [f'"{dense_key}":{next(dense)}']
            if SPARSE in asked:
                parts.append(f'"sparse":{sparse_json(rows.sparse, i)}')
            if COLBERT in asked:
                parts.append(f'"colbert":{colbert_json(rows.colbert, i, encoding, token_range(quantization))}')
            yield "{" + prefix(i) + ",".join(parts) + "}"

    return each()


def install_sparse(router, server, service: Callable, caller: Callable, inputs, prompt_field, errors: dict) -> None:
    """POST /embed_sparse on a bgem3 model: its lexical weights in TEI's shape (http_sparse's
    route; the service's embed_sparse answers a bgem3 model's sparse rows). TEI's root POST /
    stays the embed route's."""
    own = APIRouter()
    http_sparse.install(own, server, service, caller, inputs, prompt_field, errors)
    router.routes.extend(r for r in own.routes if getattr(r, "path", "") == "/embed_sparse")
