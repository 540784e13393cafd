"""text-embeddings-inference's routes beside /embed, in its shapes (router/src/http/types.rs):
/tokenize and /decode from the served tokenizer, /similarity, and the root route POST / of an
embedding server, which takes TEI's embed payload and its similarity payload alike (what
huggingface_hub's InferenceClient(base_url=...) posts for feature_extraction and
sentence_similarity).

/tokenize shows what the model reads: the same tokenizer the server embeds with (a front end's
own copy, FRONTENDS > 1: no round trip to the model process), the same prompt, the same cut at
max_length. Installed by http_api.install_routes: /tokenize and /decode on every server, the
others on an embedding server."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Callable, Literal, Union

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, create_model

from embedserve.batching.shaping import ID_ROW_BOUND, INLINE_CHARS
from embedserve.batching.tokenization import validate_texts
from embedserve.errors import InvalidInput
from embedserve.model.m3_rows import dense_of
from embedserve.transports import encodings, json_reply
from embedserve.transports.hub import Hub
from embedserve.transports.schema import MAX_ITEMS, Text, Texts, texts

PATHS = frozenset(("/tokenize", "/decode", "/similarity"))

# Texts /tokenize encodes at a time: what a refusal past MAX_REPLY_BYTES has cost at most, and what
# their tokens hold at once (a token's text and offsets: ~100 bytes in Python).
TOKENIZE_GROUP = 16


def id_row(vocab_size: int, most: int = ID_ROW_BOUND * 512):
    """A list of at most `most` token ids (as /v1/embeddings takes them: ID_ROW_BOUND × the largest
    bucket). The schema states the vocabulary's bound; the tokenizer checks it (400 naming the
    list), as the prompt names are stated and checked."""
    return Annotated[list[Annotated[int, Field(ge=0, json_schema_extra={"maximum": vocab_size - 1})]],
                     Field(max_length=most, fail_fast=True)]


IdRow = id_row(2**31)  # the documented default; each server's own bound: install()


class TokenizeRequest(BaseModel):
    inputs: Union[Text, Texts]
    add_special_tokens: bool = True
    prompt_name: str | None = Field(None, description="One of the model's declared prompts, put before each "
                                    "text (default: its default prompt, if it declares one), as /embed puts it.")
    truncate: bool | None = Field(None, description="Extension: cut at the model's max length as /embed does "
                                  "(default: the server's TRUNCATE); false shows every token.")


class SimpleToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None = Field(description="Character offset into the prompted text (TEI: UTF-8 bytes); "
                              "null for a special token.")
    stop: int | None


class DecodeRequest(BaseModel):
    ids: Union[IdRow, Annotated[list[IdRow], Field(min_length=1, max_length=MAX_ITEMS, fail_fast=True)]]
    skip_special_tokens: bool = True


class SimilarityInput(BaseModel):
    source_sentence: Text
    sentences: Texts


PROMPT_DOC = "One of the model's declared prompts, put before each text (default: its default prompt, if it declares one)."


class SimilarityParameters(BaseModel):
    truncate: bool | None = None
    truncation_direction: Literal["Right", "right"] = "Right"
    prompt_name: str | None = Field(None, description=PROMPT_DOC)


class SimilarityRequest(BaseModel):
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None
    # Extensions, as on /embed: TEI reads these from `parameters` only.
    truncate: bool | None = None
    prompt_name: str | None = Field(None, description=PROMPT_DOC + " Extension: TEI takes it in `parameters`.")


def cosines(rows: np.ndarray) -> list[float]:
    """Cosine similarity of row 0 with each later row (a zero vector: 0)."""
    rows = rows.astype(np.float64)
    norms = np.linalg.norm(rows, axis=1)
    norms[norms == 0] = 1
    unit = rows / norms[:, None]
    return (unit[1:] @ unit[0]).tolist()


def row_json(row) -> str:
    """One text's tokens as /tokenize answers them. Written as JSON text, a row at a time: a model
    object per token, validated and dumped again by FastAPI, had cost 1.2 s of the event loop and
    165 MB for 512 texts of 300 tokens (a 0.6 MB body)."""
    return json.dumps([{"id": i, "text": t, "special": s, "start": a, "stop": b} for i, t, s, a, b in row],
                      ensure_ascii=False)


async def tokens_reply(tokenizer, texts: list[str], prompt: str, add_special_tokens: bool, truncate: bool | None,
                       limit: int) -> json_reply.Reply:
    """/tokenize's answer, TOKENIZE_GROUP texts at a time (long ones on a thread: the Rust
    tokenizer releases the GIL), refused (ReplyTooLarge) as soon as it outgrows `limit`: with
    truncate false, 512 texts of 4,096 "!" had answered 152 MB, +1.15 GB of memory, and stalled
    the loop 1.6 s."""
    reply = json_reply.Reply(limit, "the answer (every token of every text, with its text and offsets)")
    await reply.add("[")
    for start in range(0, len(texts), TOKENIZE_GROUP):
        group = texts[start:start + TOKENIZE_GROUP]
        args = (group, prompt, add_special_tokens, truncate)
        rows = tokenizer.tokens(*args) if sum(map(len, group)) <= INLINE_CHARS else await asyncio.to_thread(
            tokenizer.tokens, *args)
        for i, row in enumerate(rows):
            await reply.add(("," if start + i else "") + row_json(row))
    await reply.add("]")
    return reply


def _prompted(model: type, prompt_field: Callable) -> type:
    return create_model(model.__name__, __base__=model,
                        prompt_name=prompt_field(model.model_fields["prompt_name"].description))


def install_tokenizer(router: APIRouter, server: Hub, service: Callable, prompt_field: Callable, errors: dict) -> None:
    """/tokenize and /decode, on every server whatever its task (as TEI installs them). `service`
    the served service (NotReady before); `prompt_field(description)` a prompt_name field whose
    schema names the model's prompts."""
    s = server.settings
    most = s.max_texts_per_request
    tokenize_request = create_model("TokenizeRequest", __base__=_prompted(TokenizeRequest, prompt_field),
                                    inputs=(Union[Text, texts(most)], ...))
    row = id_row(service().tokenizer.vocab_size, ID_ROW_BOUND * s.buckets[-1])
    decode_request = create_model("DecodeRequest", __base__=DecodeRequest, ids=(
        Union[row, Annotated[list[row], Field(min_length=1, max_length=most, fail_fast=True)]], ...))

    async def tokenize(body):
        """TEI's /tokenize: per input, its tokens as the model reads them."""
        svc = service()
        inputs = validate_texts([body.inputs] if isinstance(body.inputs, str) else body.inputs, most)
        reply = await tokens_reply(svc.tokenizer, inputs, _prompt(svc, body.prompt_name), body.add_special_tokens,
                                   body.truncate, s.max_reply_bytes)
        return reply.response()

    tokenize.__annotations__.update(body=tokenize_request)
    # The answer's schema is stated, not enforced: it is written as JSON text (tokens_json).
    answer = {**errors, 200: {"model": list[list[SimpleToken]], "description": "Per input, its tokens"}}
    router.post("/tokenize", response_model=None, responses=answer)(tokenize)

    async def decode(body):
        """TEI's /decode: token ids back to text, one string per list of ids."""
        rows = [body.ids] if not body.ids or isinstance(body.ids[0], int) else body.ids
        tokenizer = service().tokenizer
        # Off the loop: the ids checked one by one, then the Rust decoder (it releases the GIL).
        decoded = await asyncio.to_thread(tokenizer.decode, rows, body.skip_special_tokens) \
            if sum(map(len, rows)) > INLINE_IDS else tokenizer.decode(rows, body.skip_special_tokens)
        reply = json_reply.Reply(s.max_reply_bytes, "the answer (the decoded texts)")
        await reply.array(map(json_reply.dumps, decoded))
        return reply.response()

    decode.__annotations__.update(body=decode_request)
    router.post("/decode", response_model=list[str], responses=errors)(decode)


INLINE_IDS = 4096  # /decode rows of more ids in all are decoded on a thread


def install(router: APIRouter, server: Hub, service: Callable, embed: Callable, embed_request: type,
            caller: Callable[[Request], object], prompt_field: Callable, errors: dict) -> None:
    """/similarity and POST /, on an embedding server's router. `embed` is /embed's handler and
    `embed_request` its body's class (POST / takes that shape too)."""
    parameters = _prompted(SimilarityParameters, prompt_field)
    similarity_request = create_model("SimilarityRequest", __base__=_prompted(SimilarityRequest, prompt_field),
                                      parameters=(parameters | None, None))

    async def similar(inputs: SimilarityInput, truncate: bool | None, prompt_name: str | None, request: Request):
        texts = [inputs.source_sentence, *inputs.sentences]
        svc = service()
        rows = dense_of((await svc.embed_texts(texts, caller(request), truncate, prompt_name=prompt_name)).rows)
        # Over the vectors served by default: a declared truncate_dim's first dimensions.
        dims = encodings.output_dimensions(None, svc.head.truncate_dim if svc.head else None, rows.shape[1])
        return cosines(rows[:, :dims])

    async def similarity(body, request: Request):
        """TEI's /similarity: the cosine similarity of source_sentence with each of sentences."""
        p = body.parameters or SimilarityParameters()
        return await similar(body.inputs, _first(p.truncate, body.truncate), _first(p.prompt_name, body.prompt_name), request)

    similarity.__annotations__.update(body=similarity_request, request=Request)
    router.post("/similarity", response_model=list[float], responses=errors)(similarity)

    # POST /: TEI's embed payload or its similarity payload, told apart by `inputs`.
    root_request = create_model("TeiRootRequest", __base__=embed_request,
                                inputs=(Union[Text, texts(server.settings.max_texts_per_request), SimilarityInput], ...),
                                parameters=(parameters | None, None))

    async def root(body, request: Request):
        """TEI's root route of an embedding server: `inputs` a text or texts → /embed's answer;
        `inputs` {source_sentence, sentences} → /similarity's."""
        if isinstance(body.inputs, SimilarityInput):
            p = body.parameters or SimilarityParameters()
            return await similar(body.inputs, _first(p.truncate, body.truncate),
                                 _first(p.prompt_name, body.prompt_name), request)
        return await embed(body, request)

    root.__annotations__.update(body=root_request, request=Request)
    answer = Union[list[list[float]], list[list[int]], list[float], list[str]]  # float first: see http_api.Embedding
    router.post("/", response_model=answer, responses=errors, summary="Embed or similarity (TEI's /)")(root)


def _first(*values):
    return next((v for v in values if v is not None), None)


def _prompt(svc, name: str | None) -> str:
    try:
        return svc.head.prompt(name) if svc.head else ""
    except KeyError as e:
        raise InvalidInput(e.args[0]) from None
