import numpy as np
import pytest
import torch

from embedserve.config import Settings
from embedserve.model.encoder import Encoder, choose_placement
from embedserve.model.batches import Batch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu.sh runs these)")


@pytest.mark.parametrize(
    "env, on_cuda, expected",
    [
        # (device, dtype, torch.compile, static shapes, CUDA graphs)
        ({}, False, ("cpu", torch.float32, False, False, False)),
        ({}, True, ("cuda", torch.bfloat16, False, True, True)),
        ({"COMPILE": "true"}, True, ("cuda", torch.bfloat16, True, True, True)),
        ({"COMPILE": "false"}, True, ("cuda", torch.bfloat16, False, False, False)),
        ({"COMPILE": "true"}, False, ("cpu", torch.float32, True, True, False)),
        ({"STATIC_SHAPES": "false"}, True, ("cuda", torch.bfloat16, False, False, False)),
        ({"DEVICE": "cpu", "COMPILE": "graphs"}, True, ("cpu", torch.float32, False, False, False)),
        ({"DTYPE": "float16", "DEVICE": "cuda:1"}, True, ("cuda:1", torch.float16, False, True, True)),
    ],
)
def test_placement_follows_the_settings(env, on_cuda, expected):
    p = choose_placement(Settings.from_env(env), cuda_available=on_cuda, bf16_supported=True)
    assert (str(p.device), p.dtype, p.compile, p.static_shapes, p.cuda_graphs) == expected


@pytest.mark.parametrize(
    "env, on_cuda, attention",
    [
        ({}, True, "packed"),  # CUDA in bf16: FlashAttention-2 over packed rows
        ({"DTYPE": "float16", "COMPILE": "false"}, True, "packed"),
        ({}, False, "padded"),
        ({"DTYPE": "float32"}, True, "padded"),  # auto packs only where FlashAttention runs
        ({"DEVICE": "cpu"}, True, "padded"),
        ({"ATTENTION": "padded"}, True, "padded"),
        ({"ATTENTION": "packed"}, False, "packed"),  # CPU: the reference attention, on request
        ({"ATTENTION": "packed", "DTYPE": "float32"}, True, "packed"),
    ],
)
def test_placement_asks_for_packed_rows_where_the_kernels_run(env, on_cuda, attention):
    assert choose_placement(Settings.from_env(env), on_cuda, True).attention == attention


def test_cuda_graphs_are_never_used_without_static_shapes():
    """Every new batch shape would otherwise capture another graph: memory without bound."""
    for compile_ in ("auto", "graphs", "true"):
        p = choose_placement(Settings.from_env({"COMPILE": compile_, "STATIC_SHAPES": "false"}), True, True)
        assert not p.cuda_graphs


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    """A small random BERT saved to disk: the GPU machine has no packaged model."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=3000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("tiny-bert")
    BertModel(config).save_pretrained(path)
    return str(path)


def batch(rng, rows: int, length: int, padded_rows: int, vocab: int) -> Batch:
    ids = np.zeros((padded_rows, length), dtype=np.int64)
    mask = np.zeros((padded_rows, length), dtype=np.int64)
    for r in range(rows):
        n = int(rng.integers(2, length + 1))
        ids[r, :n] = rng.integers(1000, vocab, n)
        mask[r, :n] = 1
    return Batch(torch.from_numpy(ids), torch.from_numpy(mask), rows, int(mask.sum()), [])


@cuda
@pytest.mark.parametrize("compile_", ["graphs", "true"])
def test_graph_replays_compute_what_the_eager_model_computes(tiny_model_dir, compile_):
    """Fresh random inputs per call: a stale static input or output buffer would show."""
    env = {"DTYPE": "float32", "COMPILE": compile_}
    graphed = Encoder(tiny_model_dir, Settings.from_env(env), choose_placement(Settings.from_env(env), True, True), [])
    eager_env = {"DTYPE": "float32", "COMPILE": "false"}
    eager = Encoder(tiny_model_dir, Settings.from_env(eager_env), choose_placement(Settings.from_env(eager_env), True, True), [])
    vocab = graphed.model.config.vocab_size
    rng = np.random.default_rng(0)
    for rows, length, padded in [(3, 16, 8), (8, 16, 8), (5, 64, 8), (1, 16, 8), (20, 32, 32)]:
        b = batch(rng, rows, length, padded, vocab)
        got, want = graphed.run(b), eager.run(b)
        assert got.shape == want.shape == (rows, graphed.dim)
        np.testing.assert_allclose(got, want, atol=2e-3)
    assert graphed._forward.shapes == [(8, 16), (8, 64), (32, 32)]


@pytest.fixture(scope="module")
def tiny_cross_encoder_dir(tmp_path_factory):
    """A BERT cross-encoder of one label and two token types, random (no packaged model needed:
    bench/gpu.sh's machine has none)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=3000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, num_labels=1, type_vocab_size=2)
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        model.bert.embeddings.token_type_embeddings.weight[1] += 1.0  # type 1 must matter
        model.classifier.weight.mul_(1000)  # logits of order 1, not 1e-3
    path = tmp_path_factory.mktemp("tiny-cross-encoder")
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("env, on_cuda", [
    ({"DEVICE": "cpu", "COMPILE": "false"}, False),
    pytest.param({"DTYPE": "float32", "COMPILE": "graphs"}, True, marks=cuda),
], ids=["cpu eager", "cuda graphs"])
def test_rerank_rows_get_their_token_types(tiny_cross_encoder_dir, env, on_cuda):
    """Pair rows ([CLS] q [SEP] t [SEP], right-padded) through the Encoder (task rerank): the logits
    of the HF model given the pair's token_type_ids; the types are derived on the device, inside
    the captured graph too (fresh rows per replay: a stale derivation would show)."""
    from transformers import AutoModelForSequenceClassification

    settings = Settings.from_env(env)
    encoder = Encoder(tiny_cross_encoder_dir, settings, choose_placement(settings, on_cuda, on_cuda), [],
                      task="rerank", sep_id=102)
    reference = AutoModelForSequenceClassification.from_pretrained(tiny_cross_encoder_dir).eval()
    rng = np.random.default_rng(0)
    for rows, length, padded in [(3, 16, 8), (8, 16, 8), (5, 32, 8)]:
        ids = np.zeros((padded, length), dtype=np.int64)
        mask = np.zeros_like(ids)
        types = np.zeros_like(ids)
        for r in range(rows):
            n = int(rng.integers(5, length + 1))
            q = int(rng.integers(1, n - 3))  # the query's tokens
            ids[r, :n] = rng.integers(1000, 3000, n)
            ids[r, 0], ids[r, q + 1], ids[r, n - 1] = 101, 102, 102
            mask[r, :n] = 1
            types[r, q + 2 : n] = 1
        got = encoder.run(Batch(torch.from_numpy(ids), torch.from_numpy(mask), rows, int(mask.sum()), []))
        with torch.inference_mode():
            want = reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                             token_type_ids=torch.from_numpy(types)).logits[:rows].numpy()
            untyped = reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits[:rows].numpy()
        assert got.shape == (rows, 1)
        np.testing.assert_allclose(got, want, atol=2e-3 if on_cuda else 1e-4)
        assert np.abs(untyped - want).max() > 1e-2  # the types are what made the difference
