"""The cross-encoder's activation: found as sentence-transformers' CrossEncoder finds it, and
computed as torch computes it."""

import numpy as np
import pytest
import torch

from embedserve.model import activation

CE = {"model_type": "CrossEncoder"}


@pytest.mark.parametrize("st_config, hf_config, labels, expected", [
    ({}, {}, 1, "Sigmoid"),  # a plain checkpoint of one label: CrossEncoder's default
    ({}, {}, 3, "Identity"),
    ({**CE, "activation_fn": "torch.nn.modules.linear.Identity"}, {}, 1, "Identity"),  # what CrossEncoder.save writes
    ({**CE, "activation_fn": "torch.nn.modules.activation.Tanh"}, {}, 1, "Tanh"),
    # config_sentence_transformers.json first, then config.json's, then the legacy key
    ({**CE, "activation_fn": "torch.nn.Tanh"}, {"sentence_transformers": {"activation_fn": "torch.nn.Identity"}}, 1, "Tanh"),
    ({}, {"sentence_transformers": {"activation_fn": "torch.nn.Identity"}}, 1, "Identity"),
    ({}, {"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}, 1, "Tanh"),
    # a file that does not declare a CrossEncoder is not read for it
    ({"activation_fn": "torch.nn.Identity"}, {}, 1, "Sigmoid"),
    # code outside torch is skipped (as sentence-transformers without trust_remote_code), for the next one
    ({**CE, "activation_fn": "my_repo.Activation"}, {"sentence_transformers": {"activation_fn": "torch.nn.Identity"}}, 1,
     "Identity"),
    ({**CE, "activation_fn": "my_repo.Activation"}, {}, 1, "Sigmoid"),
])
def test_resolve_follows_cross_encoder(st_config, hf_config, labels, expected):
    name, notes = activation.resolve(st_config, hf_config, labels)
    assert name == expected
    assert notes and expected in notes[-1]
    if "my_repo" in str(st_config):
        assert any("my_repo.Activation" in n and "not a torch.nn class" in n for n in notes)


def test_a_torch_activation_this_server_cannot_compute_is_refused():
    with pytest.raises(activation.ActivationError, match="torch.nn.GELU"):
        activation.resolve({**CE, "activation_fn": "torch.nn.GELU"}, {}, 1)


def test_resolve_agrees_with_cross_encoder_on_saved_models(tmp_path, model_dir):
    """CrossEncoder's own choice, for models it saved itself."""
    import json

    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(model_dir)
    config = BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=1)
    BertForSequenceClassification(config).save_pretrained(tmp_path / "plain")
    tok.save_pretrained(tmp_path / "plain")
    for name, fn in (("sigmoid", None), ("identity", torch.nn.Identity()), ("tanh", torch.nn.Tanh())):
        CrossEncoder(str(tmp_path / "plain"), device="cpu", activation_fn=fn).save(str(tmp_path / name))
        loaded = CrossEncoder(str(tmp_path / name), device="cpu")
        st = json.loads((tmp_path / name / "config_sentence_transformers.json").read_text())
        hf = json.loads((tmp_path / name / "config.json").read_text())
        assert activation.resolve(st, hf, 1)[0] == type(loaded.activation_fn).__name__


@pytest.mark.parametrize("name", sorted(activation.ACTIVATIONS))
def test_apply_matches_torch(name):
    logits = np.random.default_rng(0).normal(scale=30, size=(64, 3)).astype(np.float32)
    logits[0, :] = [-1e4, 1e4, 0]  # no overflow at the extremes
    want = getattr(torch.nn, name)(**({"dim": -1} if name == "Softmax" else {}))(torch.from_numpy(logits)).numpy()
    got = activation.apply(name, logits)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


async def test_rerank_applies_the_activation_to_each_pair_as_cross_encoder_does():
    """The scores are the activation of each pair's own row ([n, 1]): a declared Softmax gives 1.0
    per pair (CrossEncoder's answer), not a distribution over the request's documents."""
    from embedserve.batching.shaping import Limits, PreTokenized, Result

    logits = np.array([[2.0], [0.5], [-1.0]], dtype=np.float32)

    class Computed(PreTokenized):  # the model's side: these logits for any three pairs
        limits, head = Limits(8, 64, True), None

        async def _texts(self, r, caller):
            return Result(logits, 9)

    for name in ("Softmax", "Sigmoid", "Identity"):
        service = Computed()
        service.activation = name
        got = (await service.rerank("q", ["a", "b", "c"])).rows
        want = getattr(torch.nn, name)(**({"dim": -1} if name == "Softmax" else {}))(torch.from_numpy(logits))[:, 0]
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert (await service.rerank("q", ["a", "b", "c"], raw_scores=True)).rows.tolist() == logits[:, 0].tolist()


CLASSIFIERS = {  # config.json's fields → what transformers' text-classification pipeline applies
    "several labels": ({"num_labels": 3}, "Softmax"),
    "single-label": ({"num_labels": 3, "problem_type": "single_label_classification"}, "Softmax"),
    "multi-label": ({"num_labels": 3, "problem_type": "multi_label_classification"}, "Sigmoid"),
    "one label": ({"num_labels": 1}, "Sigmoid"),
    "regression": ({"num_labels": 1, "problem_type": "regression"}, "Identity"),
}


@pytest.mark.parametrize("case", CLASSIFIERS)
def test_a_classifiers_activation_is_the_text_classification_pipelines(case, model_dir):
    """Judged by transformers' own TextClassificationPipeline (top_k=None: every label's score) on
    tiny classifiers of each kind: our activation on the same logits gives its scores."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, pipeline

    fields, expected = CLASSIFIERS[case]
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, **fields)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    name, why = activation.for_classifier(config.problem_type, config.num_labels, getattr(config, "function_to_apply", None))
    assert name == expected and why
    judge = pipeline("text-classification", model=model, tokenizer=tok, top_k=None, device="cpu")
    texts = ["what a great day", "this is terrible"]
    with torch.inference_mode():
        logits = torch.cat([model(**tok(t, return_tensors="pt")).logits for t in texts]).numpy()
    ours = activation.apply(name, logits)
    for row, judged in zip(ours, judge(texts)):
        theirs = {d["label"]: d["score"] for d in judged}
        assert np.abs(row - np.array([theirs[config.id2label[i]] for i in range(config.num_labels)])).max() <= 1e-6
