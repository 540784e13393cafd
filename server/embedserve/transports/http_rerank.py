"""HTTP routes of a reranking server (TASK=rerank, a cross-encoder): TEI's `POST /rerank` (and
TEI's root `POST /` in its rerank shape), and the Cohere/Jina-compatible `POST /v1/rerank`. Every
route asks the service for one score per text (shaping.PreTokenized.rerank: the pairs are rows
like any others, admitted in real tokens) and sorts them here, best first.

A server of another task answers these paths with its WrongTask error (400, naming what to use),
and a reranking server answers the embedding paths so. Installed by http_api.install_routes,
which hands in its helpers (this module does not import it: no import circle)."""

from __future__ import annotations

import uuid
from typing import Annotated, Callable, Literal, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, create_model

from embedserve.errors import InvalidInput, ReplyTooLarge
from embedserve.transports import http_models
from embedserve.transports.hub import Hub
from embedserve.transports.schema import MAX_ITEMS, Text

# A non-blank query and texts (transports/schema.py), 1 to MAX_TEXTS_PER_REQUEST of them (each
# server's own bound: `install`), a list stopping at its first bad item.


def _items(kind, most: int):
    return Annotated[list[kind], Field(min_length=1, max_length=most, fail_fast=True)]


class TeiRerankRequest(BaseModel):
    query: Text = Field(description="The query each text is scored against.")
    texts: _items(Text, MAX_ITEMS) = Field(description="The texts to score (1 to MAX_TEXTS_PER_REQUEST).")
    raw_scores: bool = Field(False, description="The model's logits, without its activation (CrossEncoder's "
                             "default: sigmoid for one label).")
    return_text: bool = Field(False, description="Return each text with its score.")
    truncate: bool | None = Field(None, description="Cut over-long pairs, longest first, as CrossEncoder does "
                                  "(default: the server's TRUNCATE).")
    truncation_direction: Literal["Right", "right"] = Field("Right", description="Pairs are cut at the end of "
                                                             "their longer text, as CrossEncoder cuts them.")


class Rank(BaseModel):
    index: int
    score: float
    text: str | None = None


class Document(BaseModel):
    text: Text


class RerankRequest(BaseModel):
    """Cohere's and Jina's /v1/rerank."""

    model: str | None = Field(None, description="The served model's id (GET /v1/models); optional.")
    query: Text
    documents: _items(Union[Text, Document], MAX_ITEMS) = Field(description="Strings, or objects with a `text` "
                                                                "field (Cohere).")
    top_n: int | None = Field(None, ge=1, description="Return the best N (default: all; above the count: all).")
    return_documents: bool = Field(False, description="Return each document's text with its score.")
    truncate: bool | None = Field(None, description="Extension: cut over-long pairs (default: the server's TRUNCATE).")


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: Document | None = None


class RerankUsage(BaseModel):
    total_tokens: int  # the pairs' real tokens, special tokens included


class RerankResponse(BaseModel):
    id: str
    results: list[RerankResult]
    model: str
    usage: RerankUsage


def ranked(scores) -> list[tuple[int, float]]:
    """Scores in text order → (index, score), best first (ties: the earlier text first)."""
    return sorted(enumerate(map(float, scores)), key=lambda pair: -pair[1])


def _documents(documents, max_texts: int) -> list[str]:
    """/v1/rerank's documents → texts, every check named for the field as sent."""
    if not documents:
        raise InvalidInput("documents is empty: send at least one document")
    if len(documents) > max_texts:
        raise InvalidInput(f"{len(documents)} documents exceed MAX_TEXTS_PER_REQUEST={max_texts}")
    texts = [d if isinstance(d, str) else d.text for d in documents]
    for i, t in enumerate(texts):
        if not t or t.isspace():
            raise InvalidInput(f"documents[{i}] is empty or whitespace only")
    return texts


def _echo_fits(texts: list[str], limit: int) -> None:
    """An answer that returns every text (return_text, return_documents) within `limit`, each
    character as JSON may escape it: refused before any work (ReplyTooLarge)."""
    size = sum(map(len, texts)) * 6 + 96 * len(texts)
    if size > limit:
        raise ReplyTooLarge(f"the answer with its {len(texts)} texts returned would be up to {size} bytes, over "
                            f"MAX_REPLY_BYTES={limit}: send fewer texts, or leave the texts out of the answer")


def install(router: APIRouter, server: Hub, service: Callable, caller: Callable, errors: dict,
            error: Callable, root: bool = True) -> None:
    """A reranking server's routes (another task's paths answer 400: http_api.refusals).
    `caller`, `errors`, `error`: http_api's request → Caller, error responses for the schema, and
    JSON error response. `root`: TEI's / is rerank's too (a multi-vector server's / embeds)."""
    most = min(MAX_ITEMS, server.settings.max_texts_per_request)
    tei_request = create_model("TeiRerankRequest", __base__=TeiRerankRequest, texts=(
        _items(Text, most), Field(description=TeiRerankRequest.model_fields["texts"].description)))

    async def rerank(body, request: Request):
        """TEI's rerank: each text's score against the query, best first."""
        if body.return_text:
            _echo_fits(body.texts, server.settings.max_reply_bytes)
        out = await service().rerank(body.query, body.texts, caller(request), body.truncate, body.raw_scores)
        return [Rank(index=i, score=s, text=body.texts[i] if body.return_text else None) for i, s in ranked(out.rows)]

    rerank.__annotations__.update(body=tei_request, request=Request)  # classes made here, not names
    for path, summary in (("/rerank", "Rerank"), ("/", "Rerank (TEI's /)"))[: 2 if root else 1]:
        router.post(path, response_model=list[Rank], response_model_exclude_none=True, responses=errors,
                    summary=summary)(rerank)

    install_v1(router, server, service, caller, errors, error)


def install_v1(router: APIRouter, server, service: Callable, caller: Callable, errors: dict, error: Callable) -> None:
    """/v1/rerank, for the model its payload names (none: `server`'s, whose schema it has)."""
    most = min(MAX_ITEMS, server.settings.max_texts_per_request)
    v1_request = create_model("RerankRequest", __base__=RerankRequest, documents=(
        _items(Union[Text, Document], most), Field(description=RerankRequest.model_fields["documents"].description)))

    async def v1_rerank(body, request: Request):
        """Cohere/Jina-compatible rerank: results best first, cut at top_n."""
        m = server.model(body.model, request)  # UnknownModel: 404 naming the served ones
        svc = http_models.use(request, m, "rerank")
        if body.top_n is not None and body.top_n < 1:
            raise InvalidInput(f"top_n must be at least 1, got {body.top_n}")
        texts = _documents(body.documents, server.settings.max_texts_per_request)
        if body.return_documents:
            _echo_fits(texts, server.settings.max_reply_bytes)
        try:
            out = await svc.rerank(body.query, texts, caller(request), body.truncate)
        except InvalidInput as e:  # the service names the texts as its own field: here they are documents
            raise InvalidInput(str(e).replace("texts[", "documents[")) from None
        best = ranked(out.rows)[: body.top_n]  # above the count: all of them, as Cohere
        results = [RerankResult(index=i, relevance_score=s, document=Document(text=texts[i]) if body.return_documents
                                else None) for i, s in best]
        return RerankResponse(id=uuid.uuid4().hex, results=results, model=m.served_name,
                              usage=RerankUsage(total_tokens=out.tokens))

    v1_rerank.__annotations__.update(body=v1_request, request=Request)
    router.post("/v1/rerank", response_model=RerankResponse, response_model_exclude_none=True,
                responses=errors)(v1_rerank)
