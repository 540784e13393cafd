"""TASK=classify on a real server, one process and FRONTENDS=2: a classifier's scores are those of
transformers' text-classification pipeline on the same directory, whatever kind of classifier it
is. A multi-label one (`problem_type: multi_label_classification`) or one of a single label gets
each label's sigmoid, not a softmax across labels (which made a one-label model's score always 1
and a multi-label model's scores sum to 1)."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from tests.conftest import ServerProcess
from tests.server.frontends.test_frontend import children, kill_front_ends

TEXTS = ["what a great day", "this is terrible", "it is a chair"]
KINDS = {  # config fields, server environment
    "multi-label, one process": ({"num_labels": 3, "problem_type": "multi_label_classification",
                                  "id2label": {0: "sports", 1: "politics", 2: "food"},
                                  "label2id": {"sports": 0, "politics": 1, "food": 2}}, {}),
    "one label, FRONTENDS=2": ({"num_labels": 1, "id2label": {0: "toxic"}, "label2id": {"toxic": 0}},
                               {"TASK": "classify", "FRONTENDS": "2"}),
}


def post(url: str, body: dict):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.load(r)


@pytest.fixture(scope="module", params=list(KINDS))
def classifier(request, tmp_path_factory, model_dir):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, pipeline

    fields, env = KINDS[request.param]
    out = tmp_path_factory.mktemp("classifier")
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, **fields)
    torch.manual_seed(1)
    BertForSequenceClassification(config).eval().save_pretrained(out)
    tok.save_pretrained(out)
    judge = pipeline("text-classification", model=str(out), top_k=None, device="cpu")
    server = ServerProcess({"MODEL_PATH": str(out), "MAX_DRAIN_TIME_MS": "600000", **env}).wait_ready()
    fronts = children(server.proc.pid)
    yield server, config, judge
    server.stop()
    kill_front_ends(fronts)


def test_scores_are_the_text_classification_pipelines(classifier):
    server, config, judge = classifier
    expected = [{d["label"]: d["score"] for d in row} for row in judge(TEXTS)]
    labels = [config.id2label[i] for i in range(config.num_labels)]
    body = post(server.http + "/classify", {"inputs": TEXTS, "all_scores": True})
    for row, theirs in zip(body, expected):
        assert np.abs(np.array([row["scores"][label] for label in labels]) - [theirs[x] for x in labels]).max() <= 1e-5
        assert row["label"] == max(theirs, key=theirs.get) and abs(row["score"] - max(theirs.values())) <= 1e-5
    # TEI's predict route (/) scores alike, best first.
    predicted = post(server.http + "/", {"inputs": TEXTS})
    for row, theirs in zip(predicted, expected):
        assert [p["label"] for p in row] == sorted(theirs, key=theirs.get, reverse=True)
        assert max(abs(p["score"] - theirs[p["label"]]) for p in row) <= 1e-5
    if config.num_labels == 1:
        assert len({round(r["score"], 6) for r in body}) == len(TEXTS)  # a probability, not always 1
