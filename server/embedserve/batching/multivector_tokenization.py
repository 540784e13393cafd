"""A multi-vector (ColBERT) model's texts → token rows, by side, as sentence-transformers'
MultiVectorEncoder prepares them (Transformer.preprocess with task="query" / "document"):

- queries: the query prefix (the "query" prompt) before each text, cut at the query's length; with
  query expansion, padded with the expansion token (the mask token) to the expansion's length
  ("fixed": cut there too; "min": only padded up to it). The expansion tokens are real tokens of
  the row here (its length counts them): the model computes a vector for each, MaxSim scores them,
  and admission, buckets and usage count what the model computes;
- documents: the document prefix, cut at the document length. Their skiplist tokens stay in the
  row (the encoder reads them) and leave the vectors on the device (embedserve.model.token_head).

A row carries its side to the device in its ids (token_head.QUERY on a query's first id,
token_head.EXPANSION on its expansion tokens): rows are ids and lengths through the queues, the
batches and IPC, as every other row, so nothing between here and the model changes. A request of
no side (pre-tokenized rows, /tokenize) is read at the model's max length, as a document.

The tokenizer is a TextTokenizer (what the service, /tokenize and admission read of it is the
model's max length) with one more for each side; a front end rebuilds it from its `spec`
(`from_spec`)."""

from __future__ import annotations

import numpy as np

from embedserve.batching.flagged_tokenization import FlaggedTokenizer
from embedserve.batching.tokenization import TextTokenizer
from embedserve.model.colbert import EXPANSION, QUERY

SIDES = ("query", "document")


def side_lengths(max_length: int, query_length: int | None, document_length: int | None,
                 strategy: str | None, expansion_length: int | None) -> tuple[int, int, int]:
    """→ (a query's tokens at most, the tokens a query is padded to with the expansion token,
    a document's tokens at most), within the model's max length. Pure: sentence-transformers'
    rule (the "fixed" expansion's length is the query's width; "min" pads to it and cuts at
    query_length)."""
    query = min(query_length or max_length, max_length)
    floor = 0
    if strategy is not None and expansion_length:
        floor = min(expansion_length, max_length)
        query = floor if strategy == "fixed" else max(query, floor)
    return query, floor, min(document_length or max_length, max_length)


def expanded(ids: np.ndarray, lengths: np.ndarray, floor: int, expansion_id: int | None,
             pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """A request's query rows → the same rows padded to `floor` tokens with the expansion token
    (marked EXPANSION), their first ids marked QUERY. Pure."""
    n, width = ids.shape
    grow = floor if expansion_id is not None else 0
    out = np.full((n, max(width, grow)), pad_id, dtype=np.int32)
    out[:, :width] = ids
    if grow:
        positions = np.arange(out.shape[1])[None, :]
        fill = (positions >= lengths[:, None]) & (positions < grow)
        out[fill] = expansion_id | EXPANSION
        lengths = np.maximum(lengths, grow)
    out[:, 0] |= QUERY
    return out, lengths


class MultiVectorTokenizer(TextTokenizer):
    def __init__(self, tokenizer_json: str, pad_id: int, vocab_size: int, max_length: int, truncate: bool,
                 lower_case: bool = False, query_max: int | None = None, query_floor: int = 0,
                 document_max: int | None = None, expansion_id: int | None = None, pair_prompt: dict | None = None):
        # pair_prompt: an LLM reranker's (TextTokenizer); a multi-vector model has none, its spec says None.
        super().__init__(tokenizer_json, pad_id, vocab_size, max_length, truncate, lower_case, pair_prompt)
        self.query_floor, self.expansion_id = query_floor, expansion_id
        self.sides = {side: TextTokenizer(tokenizer_json, pad_id, vocab_size, n or max_length, truncate, lower_case)
                      for side, n in (("query", query_max), ("document", document_max))}
        self.spec = {**self.spec, "query_max": self.sides["query"].max_length, "query_floor": query_floor,
                     "document_max": self.sides["document"].max_length, "expansion_id": expansion_id}

    def encode_each(self, requests: list[tuple]) -> list:
        """TextTokenizer.encode_each, each request by its side (its fifth field: "query",
        "document", or none)."""
        out: list = [None] * len(requests)
        for side in (*SIDES, ""):
            mine = [i for i, r in enumerate(requests) if (r[4] if len(r) > 4 else "") == side]
            if not mine:
                continue
            tok = self.sides.get(side)
            done = (tok or super()).encode_each([requests[i][:4] for i in mine])
            for i, result in zip(mine, done):
                if side == "query" and not isinstance(result, Exception):
                    result = expanded(*result, self.query_floor, self.expansion_id, self.pad_id)
                out[i] = result
        return out


def from_spec(spec: dict, truncate: bool) -> TextTokenizer:
    """A tokenizer's `spec` (what the model process says of it) → the tokenizer, in a front end."""
    kind = MultiVectorTokenizer if "query_max" in spec else FlaggedTokenizer if "flags" in spec else TextTokenizer
    return kind(**spec, truncate=truncate)


def for_model(hf_tokenizer, max_length: int, truncate: bool, lower_case: bool, mv) -> MultiVectorTokenizer:
    """The tokenizer of a multi-vector model (`mv`: embedserve.model.colbert.MultiVector, resolved)."""
    e = mv.expansion
    query, floor, document = side_lengths(max_length, mv.query_length, mv.document_length,
                                          e.strategy if e else None, e.length if e else None)
    pad = hf_tokenizer.pad_token_id
    return MultiVectorTokenizer(hf_tokenizer.backend_tokenizer.to_str(), int(pad if pad is not None else 0),
                                len(hf_tokenizer), max_length, truncate, lower_case, query, floor, document,
                                mv.expansion_id)
