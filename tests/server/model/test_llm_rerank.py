"""LLM rerankers on the model's side: which checkpoints are ones (llm_rerank.read, task_of,
prepare under TASK=auto and TASK=rerank), and the Encoder's scores, padded and packed rows,
against sentence-transformers 6.2's CrossEncoder.predict on the same directory within 1e-4
(pairs of very different lengths in one batch, and a pair alone)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from embedserve.config import ConfigError, Settings
from embedserve.model import llm_rerank, varlen
from embedserve.model.batches import Batch, PackedBatch, PackSpec, layout
from embedserve.model.declared import DeclarationError
from embedserve.model.encoder import Encoder, Placement, task_of
from embedserve.prepare import prepare
from tests.server.model.llm_reranker_models import build

TOL = 1e-4
QUERY = "how far away from the earth is the moon on an average day of the year"
TEXTS = ["the moon is about 384,400 kilometres", "cheese", "the distance between the earth and the moon changes " * 20,
         "paris", "yes no"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("llm-rerankers"))


def judge(model_dir: str, texts: list[str], raw: bool = False) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(model_dir, device="cpu", **({"activation_fn": torch.nn.Identity()} if raw else {}))
    return ce.predict([(QUERY, t) for t in texts], batch_size=3)


def padded(ids: np.ndarray, lengths: np.ndarray) -> Batch:
    mask = (np.arange(ids.shape[1]) < lengths[:, None]).astype(np.int64)
    return Batch(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask), len(lengths), int(lengths.sum()), [])


def packed(ids: np.ndarray, lengths: np.ndarray, longest: int) -> PackedBatch:
    """The rows as one stream, laid out as a static shape lays it (a padding tail cut into rows,
    zero-length rows after them)."""
    cu, positions, segments, size = layout(lengths, PackSpec(max_len=longest, max_rows=8, ladder=(1024,)))
    stream = np.zeros(size, dtype=np.int64)
    for i, n in enumerate(lengths):
        stream[cu[i]: cu[i] + n] = ids[i, :n]
    return PackedBatch(torch.from_numpy(stream), torch.from_numpy(positions), torch.from_numpy(segments),
                       torch.from_numpy(cu), longest, len(lengths), int(lengths.sum()), [])


@pytest.mark.parametrize("layout_name, task", [("st", "auto"), ("plain", "rerank"), ("plain_text", "rerank")])
def test_scores_equal_cross_encoder_padded_and_packed(dirs, layout_name, task):
    model_dir = dirs[layout_name]
    settings = Settings(model_path=model_dir, task=task)
    m = prepare(settings)
    assert m.task == "rerank" and m.activation == "Sigmoid" and m.head.logit_score is not None
    want, raw = judge(model_dir, TEXTS), judge(model_dir, TEXTS, raw=True)
    assert raw.max() - raw.min() > 0.5  # scores worth comparing
    ids, lengths = m.tokenizer.encode_pairs(m.head.prompt(None) + QUERY, TEXTS)
    assert lengths.max() == m.head.max_length > lengths.min()  # a cut row beside whole ones
    for attention in ("padded", "packed"):
        place = Placement(torch.device("cpu"), torch.float32, False, False, attention=attention)
        enc = Encoder(model_dir, settings, place, [], m.task, m.head)
        assert enc.attention == attention and enc.dim == 1
        assert isinstance(enc.model.get_output_embeddings(), torch.nn.Identity)  # untied: let go after the check
        batch = padded(ids, lengths) if attention == "padded" else packed(ids, lengths, m.head.max_length)
        got = enc.run(batch)
        assert got.shape == (len(TEXTS), 1)
        assert np.abs(got[:, 0] - raw).max() <= TOL, attention
        assert np.abs(1 / (1 + np.exp(-got[:, 0])) - want).max() <= TOL
        one_ids, one_len = m.tokenizer.encode_pairs(m.head.prompt(None) + QUERY, TEXTS[1:2])
        alone = enc.run(padded(one_ids, one_len) if attention == "padded" else packed(one_ids, one_len, m.head.max_length))
        assert abs(float(alone[0, 0]) - raw[1]) <= TOL  # a row's score does not depend on its batch


def test_what_is_an_llm_reranker(dirs):
    from transformers import AutoConfig, AutoTokenizer

    def read(name, task):
        return llm_rerank.read(dirs[name], AutoConfig.from_pretrained(dirs[name]),
                               AutoTokenizer.from_pretrained(dirs[name]), task)

    hf = AutoTokenizer.from_pretrained(dirs["st"])
    yes, no = hf.convert_tokens_to_ids("yes"), hf.convert_tokens_to_ids("no")
    assert read("st", "auto") == read("st", "rerank") == llm_rerank.LogitScore(yes, no)  # declared
    assert read("plain", "auto") is None and read("plain_text", "auto") is None  # declares nothing: an embedder
    assert read("plain", "rerank") == read("plain_text", "rerank") == llm_rerank.LogitScore(yes, no)
    assert read("plain", "classify") is None
    with pytest.raises(DeclarationError, match="TASK=embed: this model is an LLM reranker"):
        read("st", "embed")


def test_task_auto_decisions_through_prepare(dirs):
    assert prepare(Settings(model_path=dirs["st"])).task == "rerank"
    plain = prepare(Settings(model_path=dirs["plain"]))
    assert plain.task == "embed" and plain.head.logit_score is None  # a decoder embedder, as declared (nothing)
    with pytest.raises(DeclarationError, match="an LLM reranker"):
        prepare(Settings(model_path=dirs["st"], task="embed"))


@pytest.mark.parametrize("arch, llm, requested, expected", [
    (["Qwen3ForCausalLM"], True, "auto", "rerank"),
    (["Qwen3ForCausalLM"], True, "rerank", "rerank"),
    (["Qwen3ForCausalLM"], False, "auto", "embed"),
])
def test_task_of_an_llm_reranker(arch, llm, requested, expected):
    config = types.SimpleNamespace(architectures=arch, num_labels=2)
    assert task_of(config, requested, cross_encoder=llm, llm_reranker=llm) == expected


def test_packed_rows_serve_an_llm_reranker_and_not_a_sequence_classifier():
    def config(arch, kind="qwen3"):
        return types.SimpleNamespace(architectures=[arch], model_type=kind, num_attention_heads=4, hidden_size=64,
                                     head_dim=16, sliding_window=None)

    assert varlen.unsupported(config("Qwen3ForCausalLM"), "rerank", "cuda", torch.bfloat16, (9, 0)) is None
    assert "reads padded rows" in varlen.unsupported(config("Qwen3ForSequenceClassification"), "rerank", "cuda",
                                                     torch.bfloat16, (9, 0))
    assert "does not pack" in varlen.unsupported(config("LlamaForCausalLM", "llama"), "rerank", "cuda", torch.bfloat16)


def test_a_model_whose_logits_are_transformed_unknowingly_is_refused(dirs):
    """The load-time check compares the two-row score with the model's own full forward: a
    config saying the logits are soft-capped while the class does not cap them (or the reverse,
    a class doing what _answer_logits does not know) makes them differ, and the start stops."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dirs["plain"]).eval()
    score = llm_rerank.LogitScore(5, 6)
    llm_rerank.check(model, llm_rerank.Answer(model, score), score, torch.device("cpu"), torch.float32)  # they agree
    model.config.final_logit_softcapping = 0.5
    with pytest.raises(ConfigError, match="differ from the model's own forward"):
        llm_rerank.check(model, llm_rerank.Answer(model, score), score, torch.device("cpu"), torch.float32)


def test_an_untied_lm_head_is_let_go_and_a_tied_one_kept(dirs):
    """After the check only the answer rows are read: an untied head (vocabulary × hidden) goes;
    a head tied to the input embeddings is them, and stays."""
    from transformers import AutoModelForCausalLM

    untied = AutoModelForCausalLM.from_pretrained(dirs["plain"]).eval()
    assert llm_rerank.shed(untied) and isinstance(untied.get_output_embeddings(), torch.nn.Identity)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tied = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                        tie_word_embeddings=True)).eval()
    assert tied.get_output_embeddings().weight.data_ptr() == tied.get_input_embeddings().weight.data_ptr()
    assert not llm_rerank.shed(tied) and isinstance(tied.get_output_embeddings(), torch.nn.Linear)
