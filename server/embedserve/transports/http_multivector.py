"""HTTP of a multi-vector (ColBERT) server: `POST /embed_multivector` (and TEI's root `POST /` in
its shape) takes `inputs` (a text or a list), `is_query` (queries: the query prefix and the
expansion; documents, the default: the document prefix, the skiplist's tokens left out),
`truncate` and `encoding`, and answers per input its matrix: a list of token vectors, each
encoded as /embed encodes a row (floats, base64 of its float32 bytes, or quantized ints).
`/rerank` and `/v1/rerank` rank by MaxSim on such a server (http_rerank; the service scores).
Installed by embedserve.transports.http_api.install_routes, which hands over what it shares."""

from __future__ import annotations

from typing import Callable, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, create_model

from embedserve.admission.gate import Caller
from embedserve.transports import json_reply, multivector_wire
from embedserve.transports.hub import Hub

PATH = "/embed_multivector"


class EmbedMultiVectorRequest(BaseModel):
    is_query: bool = Field(False, description="Queries: the model's query prefix, expanded with its mask token to "
                           "its query length. Documents (default): its document prefix, its skiplist's tokens "
                           "(punctuation) left out of the vectors.")
    truncate: bool | None = Field(None, description="Cut over-long inputs (default: the server's TRUNCATE).")
    truncation_direction: Literal["Right", "right"] = Field("Right", description="Texts are cut at the end, "
                                                             "as sentence-transformers cuts them.")
    encoding: Literal["float", "base64", "int8", "uint8", "binary", "ubinary"] = Field(
        "float", description="Each token vector as /embed encodes a row: floats, base64 (float32 little-endian), "
        "or quantized over [-QUANTIZE_RANGE, QUANTIZE_RANGE] (ints).")


def install(router: APIRouter, server: Hub, service: Callable, caller: Callable[[Request], Caller], inputs,
            errors: dict) -> None:
    """The multi-vector routes on `router`. `inputs`: the schema of `inputs` (a text or a list)."""
    request_model = create_model("EmbedMultiVectorRequest", __base__=EmbedMultiVectorRequest,
                                 inputs=(inputs, Field(description="A text or a list of texts.")))

    async def embed_multivector(body, request: Request):
        """Per input, its token vectors (tokens × dimensions)."""
        svc = service()
        svc.require_task("multivector")
        texts = [body.inputs] if isinstance(body.inputs, str) else list(body.inputs)
        rows = (await svc.embed_multivector(texts, body.is_query, caller(request), body.truncate)).rows
        limit = server.settings.max_reply_bytes
        multivector_wire.check_size(rows, body.encoding, True, limit)  # before any is written
        reply = json_reply.Reply(limit, "the answer")
        await multivector_wire.json_rows(reply, rows, body.encoding, server.quantization,
                                         bool(server.head and server.head.normalize))
        return reply.response()

    embed_multivector.__annotations__.update(body=request_model, request=Request)
    # The answer's schema is stated, not enforced: it is written as JSON text a text at a time.
    answer = {**errors, 200: {"model": list[list[list[float]]], "description": "Per input, its token vectors"}}
    router.post(PATH, response_model=None, responses=answer)(embed_multivector)
    router.post("/", response_model=None, responses=answer, summary="Embed multi-vector (TEI's /)")(embed_multivector)
