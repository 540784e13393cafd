"""A multi-vector model's rows by side (batching/multivector_tokenization.py): the lengths each
side is cut at, the expansion's padding and the side's marks in the ids, against the rule
sentence-transformers' Transformer.preprocess states; and the tokenizer rebuilt from its spec (a
front end's) tokenizes as the model process's does."""

import numpy as np
import pytest

from embedserve.batching.multivector_tokenization import MultiVectorTokenizer, expanded, from_spec, side_lengths
from embedserve.model.colbert import EXPANSION, ID_BITS, QUERY


@pytest.mark.parametrize("args,want", [
    ((512, None, None, "fixed", 32), (32, 32, 512)),  # fixed: the expansion's length is the query's width
    ((512, 64, 180, "min", 32), (64, 32, 180)),  # min: pads to 32, cut at query_length
    ((512, 16, None, "min", 32), (32, 32, 512)),  # min: a query_length under the floor is raised to it
    ((512, 48, None, None, None), (48, 0, 512)),  # no expansion
    ((24, None, 100, "fixed", 32), (24, 24, 24)),  # all within the model's max length
])
def test_side_lengths(args, want):
    assert side_lengths(*args) == want


def test_expanded_pads_with_the_expansion_token_and_marks_the_side():
    ids = np.array([[101, 7, 8, 102, 0], [101, 9, 102, 0, 0]], dtype=np.int32)
    out, lengths = expanded(ids, np.array([4, 3]), 6, 103, 0)
    assert lengths.tolist() == [6, 6]
    assert (out & ID_BITS).tolist() == [[101, 7, 8, 102, 103, 103], [101, 9, 102, 103, 103, 103]]
    assert ((out & QUERY) != 0).tolist() == [[True] + [False] * 5] * 2
    assert ((out & EXPANSION) != 0).tolist() == [[False] * 4 + [True] * 2, [False] * 3 + [True] * 3]
    # A query longer than the floor ("min") is not padded; no expansion: only marked.
    out, lengths = expanded(ids, np.array([4, 3]), 2, None, 0)
    assert lengths.tolist() == [4, 3] and ((out & EXPANSION) == 0).all() and (out[:, 0] & QUERY).all()


def test_sides_and_the_front_end_copy(model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    tok = MultiVectorTokenizer(hf.backend_tokenizer.to_str(), 0, len(hf), 64, True, False, 8, 8, 16, hf.mask_token_id)
    long = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    q, q_lengths = tok.encode(["hi", long], prompt="query: ", side="query")
    d, d_lengths = tok.encode(["hi", long], prompt="passage: ", side="document")
    assert q_lengths.tolist() == [8, 8] and d_lengths.tolist() == [5, 16]
    assert (q[:, 0] & QUERY).all() and not (d & ~ID_BITS).any()
    assert (q[0] & ID_BITS).tolist()[-3:] == [hf.mask_token_id] * 3
    none, lengths = tok.encode([long])  # no side: the model's max length, unmarked
    assert lengths.tolist() == [len(hf(long)["input_ids"])] and not (none & ~ID_BITS).any()
    copy = from_spec(tok.spec, truncate=True)
    assert isinstance(copy, MultiVectorTokenizer)
    assert np.array_equal(copy.encode(["hi", long], prompt="query: ", side="query")[0], q)
    with pytest.raises(Exception, match="longer than 16 tokens"):
        tok.encode([long], truncate=False, prompt="passage: ", side="document")
