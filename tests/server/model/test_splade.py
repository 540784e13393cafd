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
    got = encoder.run(Batch(torch.from_numpy(ids.astype(np.int64)), mask, len(TEXTS), int(lengths.sum()), []))
    want = SparseEncoder(path, device="cpu").encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    assert got.shape == want.shape == (3, encoder.dim)
    assert np.array_equal(got != 0, want != 0)
    assert np.abs(got - want).max() <= 1e-4
    nonzeros = (got != 0).sum(axis=1)
    assert (nonzeros == 7).all() if kind.get("max_active_dims") else (nonzeros < encoder.dim // 4).all()
