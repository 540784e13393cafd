"""HTTP for a sparse (SPLADE) server, in TEI's shapes: `POST /embed_sparse` and TEI's root `POST /`
take `inputs` (a text or a list), `truncate`, `truncation_direction` and `prompt_name`, and answer
per input a list of {"index": vocabulary id, "value": weight}, ascending by index. The dense
routes answer with the service's WrongTask (400): this server's vectors are sparse.
Installed by embedserve.transports.http_api.install_routes, which hands over what both share (the
caller from the headers, the error responses, the inputs' schema), so this module needs nothing
of it."""

from __future__ import annotations

from typing import Callable, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, create_model

from embedserve.admission.gate import Caller
from embedserve.transports.hub import Hub


class SparseValue(BaseModel):
    index: int
    value: float


class TeiEmbedSparseRequest(BaseModel):
    truncate: bool | None = Field(None, description="Cut over-long inputs (default: the server's TRUNCATE).")
    truncation_direction: Literal["Right", "right"] = Field("Right", description="Texts are cut at the end, "
                                                             "as sentence-transformers cuts them.")


def install(router: APIRouter, server: Hub, service: Callable, caller: Callable[[Request], Caller], inputs,
            prompt_field, errors: dict) -> None:
    """The sparse routes on `router`. `inputs`: the schema of `inputs` (a text or a list of them);
    `prompt_field`: the model's prompt names as the schema states them."""
    request_model = create_model("TeiEmbedSparseRequest", __base__=TeiEmbedSparseRequest,
                                 inputs=(inputs, Field(description="A text or a list of texts.")),
                                 prompt_name=prompt_field)

    async def embed_sparse(body, request: Request):
        """TEI's embed_sparse: per input, its non-zero vocabulary weights."""
        rows = (await service().embed_sparse([body.inputs] if isinstance(body.inputs, str) else list(body.inputs),
                                             caller(request), body.truncate, prompt_name=body.prompt_name)).rows
        out = []
        for i in range(rows.shape[0]):
            indices, values = rows.row(i)
            out.append([{"index": k, "value": v} for k, v in zip(indices.tolist(), values.tolist())])
        return out

    embed_sparse.__annotations__.update(body=request_model, request=Request)
    answer = list[list[SparseValue]]
    router.post("/embed_sparse", response_model=answer, responses=errors)(embed_sparse)
    # TEI serves the model's task on / too.
    router.post("/", response_model=answer, responses=errors, summary="Embed sparse (TEI's /)")(embed_sparse)

    async def dense(request: Request):
        """Dense vectors: not from a sparse model (WrongTask, 400)."""
        service().require_task("embed")

    for path in ("/v1/embeddings", "/embed"):
        router.post(path, responses=errors, include_in_schema=False)(dense)
