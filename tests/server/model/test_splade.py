"""SPLADE on the device (model/splade.py through the Encoder) against sentence-transformers'
SparseEncoder on the same directory: the same non-zeros, values within 1e-4, for each pooling,
activation and a declared max_active_dims, on rows of different lengths padded in one batch."""

import numpy as np
import pytest
import torch

from embedserve.config import Settings
from embedserve.model.batches import Batch
from embedserve.model.encoder import Encoder, Placement
from embedserve.prepare import prepare
from tests.server.model.sparse_models import build_splade

TEXTS = ["hello world", "x",
         "a much longer sentence about sparse lexical retrieval with splade models, expansion terms and more words"]


@pytest.mark.parametrize("kind", [{}, {"strategy": "sum", "activation": "log1p_relu"}, {"max_active_dims": 7}],
                         ids=["max-relu", "sum-log1p_relu", "max_active_dims"])
def test_splade_rows_match_sentence_transformers(tmp_path, model_dir, kind):
    from sentence_transformers import SparseEncoder

    path = build_splade(tmp_path, model_dir, **kind)
    settings = Settings(model_path=path)
    m = prepare(settings)
    assert m.task == "sparse"  # TASK=auto
    encoder = Encoder(path, settings, Placement(torch.device("cpu"), torch.float32, False, False), [], m.task, m.head)
    ids, lengths = m.tokenizer.encode(TEXTS)
    mask = torch.from_numpy((np.arange(ids.shape[1]) < lengths[:, None]).astype(np.int64))
    got = encoder.run(Batch(torch.from_numpy(ids.astype(np.int64)), mask, len(TEXTS), int(lengths.sum()), [])).dense()
    want = SparseEncoder(path, device="cpu").encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    assert got.shape == want.shape == (3, encoder.dim)
    assert np.array_equal(got != 0, want != 0)
    assert np.abs(got - want).max() <= 1e-4
    nonzeros = (got != 0).sum(axis=1)
    assert (nonzeros == 7).all() if kind.get("max_active_dims") else (nonzeros < encoder.dim // 4).all()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu.sh runs these)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_splade_replayed_from_cuda_graphs_computes_what_the_eager_cpu_model_does(tmp_path, device):
    """SPLADE pooling has no host synchronisation: captured in a CUDA graph per static shape (float32,
    so the non-zeros can be compared exactly), replayed on new rows with a dummy row of padding,
    it gives the eager CPU model's rows. On CPU: the static-shape path without graphs."""
    from transformers import BertConfig, BertForMaskedLM

    from embedserve.model.declared import Head, Splade
    from embedserve.model.encoder import choose_placement

    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(tmp_path)
    head = Head((), False, (), 64, False, {}, None, splade=Splade("max", "relu", 20))
    settings = Settings.from_env({"DTYPE": "float32", "ATTENTION": "padded", "STATIC_SHAPES": "true"})
    placement = choose_placement(settings, device == "cuda", True)
    assert placement.cuda_graphs == (device == "cuda")
    served = Encoder(str(tmp_path), settings, placement, [], "sparse", head)
    reference = Encoder(str(tmp_path), Settings(), Placement(torch.device("cpu"), torch.float32, False, False), [],
                        "sparse", head)
    rng = torch.Generator().manual_seed(1)
    for _ in range(2):  # the first run captures, the second replays on other rows
        lengths = torch.tensor([5, 31, 12, 0])
        mask = (torch.arange(32) < lengths[:, None]).long()
        batch = Batch(torch.randint(5, 300, (4, 32), generator=rng) * mask, mask, 3, int(lengths.sum()), [])
        got, want = (r.dense() for r in (served.run(batch), reference.run(Batch(batch.input_ids[:3], mask[:3], 3, batch.real_tokens, []))))
        assert got.shape == (3, 300) and np.array_equal(got != 0, want != 0) and (got != 0).sum(axis=1).max() == 20
        assert np.abs(got - want).max() <= 1e-4


def test_task_sparse_refuses_a_checkpoint_without_a_masked_lm_head(model_dir):
    """The packaged model is a BertModel: AutoModelForMaskedLM would load it with a random MLM head
    (a warning only), and every vector would be noise."""
    from embedserve.model.declared import DeclarationError

    with pytest.raises(DeclarationError, match="ForMaskedLM"):
        prepare(Settings(model_path=model_dir, task="sparse"))
