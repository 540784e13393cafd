"""The pure parts of the rerank routes (the routes themselves, on real servers:
tests/server/test_rerank.py)."""

import numpy as np
import pytest

from embedserve.errors import InvalidInput
from embedserve.transports.http_rerank import Document, RerankRequest, _documents, ranked


def test_ranked_is_best_first_ties_in_text_order():
    assert ranked(np.array([0.1, 0.9, 0.5, 0.9], dtype=np.float32)) == [
        (1, pytest.approx(0.9)), (3, pytest.approx(0.9)), (2, pytest.approx(0.5)), (0, pytest.approx(0.1))]
    assert all(isinstance(s, float) for _, s in ranked(np.array([1.0], dtype=np.float32)))  # JSON-ready


def test_documents_as_strings_or_cohere_objects():
    body = RerankRequest.model_validate({"query": "q", "documents": ["a", {"text": "b"}]})
    assert _documents(body.documents, 4) == ["a", "b"]
    assert isinstance(body.documents[1], Document)


@pytest.mark.parametrize("documents, message", [
    ([], "documents is empty"),
    (["a"] * 5, "5 documents exceed MAX_TEXTS_PER_REQUEST=4"),
    (["a", Document.model_construct(text=" ")], r"documents\[1\] is empty"),  # the schema refuses it first
])
def test_documents_checks_name_the_field(documents, message):
    with pytest.raises(InvalidInput, match=message):
        _documents(documents, 4)
