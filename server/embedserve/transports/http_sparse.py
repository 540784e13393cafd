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
from embedserve.errors import ReplyTooLarge
from embedserve.transports import json_reply
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
        # How many entries a model leaves non-zero is known only now: a dense-ish model's rows over a
        # vocabulary of 30,522 are ~1.2 MB of JSON each. Refused before any is written, else
        # written a row at a time (json_reply.py).
        limit = server.settings.max_reply_bytes
        if (size := len(rows.values) * ENTRY_BYTES + 4 * rows.shape[0]) > limit:
            raise ReplyTooLarge(f"the answer's {len(rows.values)} non-zero entries would be up to {size} bytes, over "
                                f"MAX_REPLY_BYTES={limit}: send fewer inputs")
        reply = json_reply.Reply(limit, "the answer")
        await reply.array(map(row_json, rows_of(rows)))
        return reply.response()

    embed_sparse.__annotations__.update(body=request_model, request=Request)
    # The answer's schema is stated, not enforced: it is written as JSON text (sparse_json).
    answer = {**errors, 200: {"model": list[list[SparseValue]], "description": "Per input, its non-zero weights"}}
    router.post("/embed_sparse", response_model=None, responses=answer)(embed_sparse)
    # TEI serves the model's task on / too.
    router.post("/", response_model=None, responses=answer, summary="Embed sparse (TEI's /)")(embed_sparse)


ENTRY_BYTES = 48  # {"index":30521,"value":0.12345679104328156}, : the most one entry takes


def rows_of(rows):
    """CSR rows → each row's (indices, values) as lists, a row at a time."""
    offsets = rows.offsets.tolist()
    for a, b in zip(offsets, offsets[1:]):
        yield rows.indices[a:b].tolist(), rows.values[a:b].tolist()


def row_json(row) -> str:
    """One row as TEI answers it ([{"index", "value"}, ...]), built as text: a model object per
    entry, validated and dumped by FastAPI, cost ~7 us each (1.1 s and 120 MB for 512 texts of
    300 non-zeros). Floats as Python writes them (shortest round trip, as json.dumps); SPLADE
    weights are finite (log1p of relu)."""
    indices, values = row
    return "[" + ",".join(f'{{"index":{k},"value":{v!r}}}' for k, v in zip(indices, values)) + "]"


def sparse_json(rows) -> bytes:
    """CSR rows → TEI's answer ([[{"index", "value"}, ...] per input]) as JSON text, at once."""
    return ("[" + ",".join(map(row_json, rows_of(rows))) + "]").encode()
