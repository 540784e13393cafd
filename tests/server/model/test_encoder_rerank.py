"""Rerank on the model's side: which checkpoints rerank (task_of), and the token types derived
from pair rows (token_types) against the tokenizer's own."""

import types

import numpy as np
import pytest
import torch

from embedserve.config import ConfigError
from embedserve.model.encoder import task_of, token_types


def config(architectures, labels):
    return types.SimpleNamespace(architectures=architectures, num_labels=labels)


SEQ = ["BertForSequenceClassification"]


@pytest.mark.parametrize("arch, labels, requested, cross_encoder, expected", [
    (SEQ, 1, "auto", False, "rerank"),  # TEI's rule: one label reranks
    (SEQ, 1, "auto", True, "rerank"),  # declared a CrossEncoder
    (SEQ, 3, "auto", False, "classify"),  # several labels classify, as before
    (SEQ, 2, "auto", True, "classify"),  # a CrossEncoder of several labels is a classifier
    (["BertModel"], 2, "auto", False, "embed"),
    (None, 2, "auto", False, "embed"),
    (SEQ, 1, "rerank", False, "rerank"),
    (SEQ, 1, "classify", False, "classify"),  # TASK forces
    (SEQ, 1, "embed", True, "embed"),
])
def test_task_of(arch, labels, requested, cross_encoder, expected):
    assert task_of(config(arch, labels), requested, cross_encoder) == expected


@pytest.mark.parametrize("arch, labels, cross_encoder, why", [
    (SEQ, 3, False, "it has 3 labels"),
    (["BertModel"], 2, False, "it has 2 labels"),
    (["BertModel"], 1, False, "its architecture is"),
    (["Qwen3ForCausalLM"], 1, True, "declared a CrossEncoder"),
])
def test_task_rerank_refuses_what_cannot_rerank(arch, labels, cross_encoder, why):
    with pytest.raises(ConfigError, match=why):
        task_of(config(arch, labels), "rerank", cross_encoder)


def test_token_types_match_the_tokenizers_pair_encoding(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    queries = ["what is a panda", "a", "how long is the river nile and which countries does it cross"]
    texts = ["bears", "a much longer text about many many things " * 4, "six thousand kilometres"]
    enc = tok(queries, texts, truncation="longest_first", max_length=24, padding=True, return_tensors="pt")
    got = token_types(enc["input_ids"], enc["attention_mask"], tok.sep_token_id)
    assert got.dtype == enc["input_ids"].dtype
    assert torch.equal(got, enc["token_type_ids"])
    assert int(got.sum()) > 0  # the second segments are there: a test of something


def test_token_types_differ_only_for_a_literal_separator_in_the_query(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(["before [SEP] after"], ["text"], return_tensors="pt")
    got = token_types(enc["input_ids"], enc["attention_mask"], tok.sep_token_id)
    differs = np.flatnonzero((got != enc["token_type_ids"]).numpy()[0])
    assert tok.convert_ids_to_tokens(enc["input_ids"][0, differs].tolist()) == ["after", "[SEP]"]
