"""A multi-vector (ColBERT) model's requests: texts of one side (queries or documents) into a
checked request, and reranking by MaxSim (late interaction): the query encoded as a query, the
texts as documents, each text's score the sum over the query's token vectors of their largest
dot product with the text's (sentence_transformers.util.maxsim). The same in one process and in a
front end (FRONTENDS > 1): both compute the two sides' vectors through `_texts`, and score here."""

from __future__ import annotations

import asyncio

import numpy as np

from embedserve.batching.shaping import Limits, Result, Texts, content_key, read
from embedserve.batching.tokenization import validate_texts
from embedserve.errors import InvalidInput
from embedserve.model.declared import Head
from embedserve.model.token_rows import TokenRows


def side_prompt(head: Head | None, is_query: bool) -> str:
    """The side's prompt, as MultiVectorEncoder.encode_query / encode_document pick it: the
    model's "query" or "document" prompt (its prefix), else none (never the default prompt)."""
    return ((head.prompts if head else {}).get("query" if is_query else "document")) or ""


def multivector_request(texts, limits: Limits, head: Head | None, truncate: bool | None, is_query: bool) -> Texts:
    truncate = limits.truncate if truncate is None else truncate
    texts = validate_texts(texts, limits.max_texts)
    side = "query" if is_query else "document"
    prompt = side_prompt(head, is_query)
    return Texts(texts, truncate, prompt, content_key("multivector", side, truncate, prompt, *read(texts, limits)),
                 side=side)


def maxsim(query: np.ndarray, documents: TokenRows) -> np.ndarray:
    """[q, dim] query vectors, the documents' token vectors → one score per document: for each
    query vector its largest dot product with the document's vectors, summed (float32, as
    sentence-transformers scores float32 vectors). A document with no vector scores 0."""
    q = np.asarray(query, dtype=np.float32)
    if not len(documents.vectors):
        return np.zeros(len(documents), dtype=np.float32)
    sims = np.asarray(documents.vectors, dtype=np.float32) @ q.T  # [tokens, q]
    out = np.zeros(len(documents), dtype=np.float32)
    offsets = documents.offsets.tolist()
    for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
        if b > a:
            out[i] = sims[a:b].max(axis=0).sum(dtype=np.float32)
    return out


async def maxsim_rerank(service, query: str, texts, caller, truncate: bool | None) -> Result:
    """Rerank on a multi-vector model: the query's vectors and the texts' (two requests, computed
    together), → MaxSim scores in text order; usage counts both sides' tokens."""
    if not isinstance(query, str) or not query or query.isspace():
        raise InvalidInput("query is empty or whitespace only")
    head, limits = service.head, service.limits
    documents = multivector_request(texts, limits, head, truncate, False)
    queries = multivector_request([query], limits, head, truncate, True)
    asked = asyncio.ensure_future(service._texts(queries, caller))
    asked.add_done_callback(lambda f: f.cancelled() or f.exception())  # read when the documents failed first
    try:
        docs = await service._texts(documents, caller)
    except BaseException:
        asked.cancel()
        raise
    try:
        q = await asked
    except InvalidInput as e:  # the query's own refusal, named as the field it came in
        raise InvalidInput(str(e).replace("texts[0]", "query")) from None
    return Result(maxsim(q.rows.row(0), docs.rows), q.tokens + docs.tokens)
