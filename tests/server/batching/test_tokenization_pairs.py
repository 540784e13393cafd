"""Rerank's pairs through our tokenizer against the HF tokenizer's own pair encoding, as
CrossEncoder calls it: tokenizer(queries, texts, truncation="longest_first", max_length=...)."""

import numpy as np
import pytest

from embedserve.batching.shaping import Limits, pairs_request
from embedserve.batching.tokenization import TextTokenizer
from embedserve.errors import InvalidInput

QUERY = "how far is the moon from the earth on an average day"
TEXTS = ["about 384,400 km", "the moon is earth's only natural satellite and it orbits at an average distance "
         "of three hundred and eighty four thousand kilometres", "cheese", "x " * 200]


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("max_length", [16, 24, 40, 128])
def test_pairs_match_the_hf_tokenizer(hf, max_length):
    tok = TextTokenizer.from_hf(hf, max_length, truncate=True)
    ids, lengths = tok.encode_pairs(QUERY, TEXTS)
    want = hf([QUERY] * len(TEXTS), TEXTS, truncation="longest_first", max_length=max_length)["input_ids"]
    assert lengths.tolist() == [len(w) for w in want]
    for row, n, w in zip(ids, lengths, want):
        assert row[:n].tolist() == w
        assert (row[n:] == tok.pad_id).all()
    assert max(lengths) == max_length  # truncation happened


def test_pairs_and_single_texts_tokenized_in_one_call(hf):
    tok = TextTokenizer.from_hf(hf, 32, truncate=True)
    single, pairs = tok.encode_each([(["hello world"], True, ""), (TEXTS[:2], True, "", QUERY)])
    assert single[0][0, : single[1][0]].tolist() == hf("hello world")["input_ids"]
    want = hf([QUERY] * 2, TEXTS[:2], truncation="longest_first", max_length=32)["input_ids"]
    assert [r[:n].tolist() for r, n in zip(*pairs)] == want


def test_a_pair_over_the_limit_with_truncation_off_is_named(hf):
    tok = TextTokenizer.from_hf(hf, 24, truncate=False)
    with pytest.raises(InvalidInput, match=r"the pair \(query, texts\[1\]\) is longer than 24 tokens"):
        tok.encode_pairs(QUERY, TEXTS[:2])
    ids, lengths = tok.encode_pairs("moon", ["about 384,400 km"])  # fits: not refused
    assert lengths.tolist() == [len(hf("moon", "about 384,400 km")["input_ids"])]
    with pytest.raises(InvalidInput, match="query has"):
        tok.encode_pairs("y" * (tok.max_chars + 1), ["short"])


def test_pair_specials_and_sample(hf):
    tok = TextTokenizer.from_hf(hf, 64, truncate=True)
    assert tok.pair_specials == 3  # [CLS] [SEP] [SEP]
    ids, lengths = tok.encode_pairs("moon", ["about the moon"])
    chars, tokens = tok.sample(["about the moon"], "", lengths, "moon")
    assert (chars, tokens) == (len("moon") + len("about the moon"), int(lengths[0]) - 3)


@pytest.mark.parametrize("query, texts, message", [
    ("", ["a"], "query is empty"),
    ("  ", ["a"], "query is empty"),
    ("q", [], "texts is empty"),
    ("q", ["a", " "], r"texts\[1\] is empty"),
    ("q", ["a"] * 5, "5 texts exceed MAX_TEXTS_PER_REQUEST=4"),
])
def test_pairs_request_checks(query, texts, message):
    with pytest.raises(InvalidInput, match=message):
        pairs_request(query, texts, Limits(4, 32, True), None)


def test_pairs_request_key_and_truncate():
    limits = Limits(4, 32, True)
    r = pairs_request("q", ["a", "b"], limits, None)
    assert r.truncate and r.query == "q" and r.prompt == ""
    assert r.key != pairs_request("p", ["a", "b"], limits, None).key  # the query is in the content
    assert not pairs_request("q", ["a"], limits, False).truncate
    assert np.int64(r.key) >= 0


def test_a_declared_default_prompt_goes_before_the_query():
    """As CrossEncoder puts a prompt: before the first text of each pair only."""
    from embedserve.model.declared import Head

    head = Head(("mean",), False, (), 32, False, {"query": "query: "}, "query")
    r = pairs_request("q", ["a"], Limits(4, 32, True), None, head)
    assert r.query == "query: q" and r.texts == ["a"] and r.prompt == ""
    no_default = Head(("mean",), False, (), 32, False, {"query": "query: "}, None)
    assert pairs_request("q", ["a"], Limits(4, 32, True), None, no_default).query == "q"


# Longer than every max_length below in tokens, within its max_chars (16 × max_length) in characters:
# a side cut at max_chars before tokenizing may change which side is the longer, and with it
# the odd token of the split (docs/api.md, Limits).
LONG = ["word " * 50, "!" * 250, "supercalifragilisticexpialidocious " * 7, "a, b. " * 40,
        "naïve café déjà-vu " * 13, "x" * 150 + " tail"]  # the last: one [UNK] word (over 100 characters), then one


@pytest.mark.parametrize("max_length", [16, 40, 128])
def test_pairs_whose_two_sides_both_overflow_match_the_hf_tokenizer(hf, max_length):
    """Each side of a pair is cut to its first whole words spanning max_length tokens before the
    pair is encoded (TextTokenizer.pair_sides: the tokenizer pairs every overflow piece of one
    side with every piece of the other, a product that took 22 GB for 512 long pairs). Cut so,
    the pair's ids are the uncut pair's, side by side with long words, punctuation and accents."""
    tok = TextTokenizer.from_hf(hf, max_length, truncate=True)
    for query in LONG:
        ids, lengths = tok.encode_pairs(query, LONG)
        want = hf([query] * len(LONG), LONG, truncation="longest_first", max_length=max_length)["input_ids"]
        assert [r[:n].tolist() for r, n in zip(ids, lengths)] == want, query[:20]


@pytest.mark.parametrize("max_length", [5, 8, 13, 16, 23])
def test_longest_first_keeps_what_the_rust_tokenizer_keeps(model_dir, max_length):
    """The pure rule against the tokenizer's own pair truncation, every pair of side lengths up to 30
    (sides of single-token words)."""
    from tokenizers import Tokenizer

    from embedserve.batching.tokenization import longest_first

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    tok.no_padding()
    tok.enable_truncation(max_length)
    a, b = tok.token_to_id("a"), tok.token_to_id("b")
    for n1 in range(30):
        for n2 in range(30):
            ids = tok.encode(" ".join(["a"] * n1), " ".join(["b"] * n2)).ids
            assert (ids.count(a), ids.count(b)) == longest_first(n1, n2, max_length - 3), (n1, n2)


def test_pairs_match_the_tokenizer_under_a_roberta_template(hf):
    """A RoBERTa-style template (<s> A </s></s> B </s>: two separators between the sides) found by
    pair_template as the tokenizer itself lays it out, cut longest first, a query alone over the
    budget included."""
    import json

    from tokenizers import Tokenizer
    from tokenizers.processors import RobertaProcessing

    raw = Tokenizer.from_str(hf.backend_tokenizer.to_str())
    raw.post_processor = RobertaProcessing(("[SEP]", hf.sep_token_id), ("[CLS]", hf.cls_token_id))
    base = TextTokenizer(raw.to_str(), hf.pad_token_id, len(hf), 24, truncate=True)
    assert base.pair_specials == 4
    reference = Tokenizer.from_str(raw.to_str())
    reference.no_padding()
    reference.enable_truncation(24)
    for query in ["moon", "word " * 40, *LONG]:
        ids, lengths = base.encode_pairs(query, TEXTS + LONG)
        want = [e.ids for e in reference.encode_batch([(query, t) for t in TEXTS + LONG])]
        assert [r[:n].tolist() for r, n in zip(ids, lengths)] == want, query[:20]
    assert json.loads(raw.to_str())["post_processor"]["type"] == "RobertaProcessing"
