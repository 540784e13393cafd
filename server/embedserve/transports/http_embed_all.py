"""TEI's `POST /embed_all` on an embedding server (task embed): per input, every token's last
hidden state (special tokens included, before pooling, Dense or Normalize), as TEI answers it:
a list of float vectors per input. The rows that ask are flagged at tokenization and only theirs
come off the device (embedserve.model.states_rows); the states are bounded by MAX_REPLY_BYTES
before any work, on their real token count (EmbeddingService._rows), and the JSON answer again
once written (multivector_wire.check_size). Installed by embedserve.transports.http_api."""

from __future__ import annotations

from typing import Callable, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, create_model

from embedserve.admission.gate import Caller
from embedserve.transports import encodings, json_reply, multivector_wire
from embedserve.transports.hub import Hub

PATH = "/embed_all"


class EmbedAllRequest(BaseModel):
    truncate: bool | None = Field(None, description="Cut over-long inputs (default: the server's TRUNCATE).")
    truncation_direction: Literal["Right", "right"] = Field("Right", description="Texts are cut at the end.")


def install(router: APIRouter, server: Hub, service: Callable, caller: Callable[[Request], Caller], inputs,
            prompt_field, errors: dict) -> None:
    """/embed_all on `router`. `inputs`: the schema of `inputs` (a text or a list); `prompt_field`:
    the server's prompt_name field."""
    request_model = create_model("EmbedAllRequest", __base__=EmbedAllRequest, prompt_name=prompt_field,
                                 inputs=(inputs, Field(description="A text or a list of texts.")))

    async def embed_all(body, request: Request):
        """TEI's embed_all: per input, its tokens' hidden states (tokens × hidden size)."""
        texts = [body.inputs] if isinstance(body.inputs, str) else list(body.inputs)
        rows = (await service().embed_all(texts, caller(request), body.truncate, body.prompt_name)).rows
        limit = server.settings.max_reply_bytes
        multivector_wire.check_size(rows, encodings.FLOAT, True, limit)  # before any is written
        reply = json_reply.Reply(limit, "the answer")
        await multivector_wire.json_rows(reply, rows, encodings.FLOAT, None, False)
        return reply.response()

    embed_all.__annotations__.update(body=request_model, request=Request)
    # The answer's schema is stated, not enforced: it is written as JSON text a text at a time.
    answer = {**errors, 200: {"model": list[list[list[float]]], "description": "Per input, its tokens' hidden states"}}
    router.post(PATH, response_model=None, responses=answer)(embed_all)
