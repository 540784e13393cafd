"""Pooling, Dense and Normalize on random token states, against sentence-transformers' own modules
(the reference), and EXCLUDE_TOKENS (our deliberate deviation) against plain arithmetic."""

import pytest
import torch
from sentence_transformers.base.modules import Dense, Normalize
from sentence_transformers.sentence_transformer.modules import Pooling

from embedserve.declared import POOLING_MODES, DeclarationError
from embedserve.pooling import Pooler, pool


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 4, generator=g)
    ids = torch.tensor([[101, 7, 900, 8, 102], [101, 9, 102, 0, 0], [101, 900, 900, 102, 0]])
    mask = (ids != 0).long()
    return hidden, ids, mask


@pytest.mark.parametrize("mode", POOLING_MODES)
def test_every_mode_is_sentence_transformers_own(batch, mode):
    hidden, ids, mask = batch
    ref = Pooling(4, pooling_mode=mode)({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"]
    torch.testing.assert_close(pool(hidden, ids, mask, mode), ref)


def test_modes_concatenate_then_dense_then_normalize_as_declared(batch, tmp_path):
    hidden, ids, mask = batch
    dense = Dense(8, 3, activation_function=torch.nn.GELU())
    (tmp_path / "2_Dense").mkdir()
    dense.save(str(tmp_path / "2_Dense"))
    ours = Pooler(("cls", "max"), (tmp_path / "2_Dense",), normalize=True)
    features = Pooling(4, pooling_mode=("cls", "max"))({"token_embeddings": hidden, "attention_mask": mask})
    ref = Normalize()(dense(features))["sentence_embedding"]
    torch.testing.assert_close(ours(hidden, ids, mask), ref)
    assert ours.output_dim(4) == 3


def test_a_dense_activation_outside_torch_is_refused(tmp_path):
    dense = Dense(4, 2)
    (tmp_path / "d").mkdir()
    dense.save(str(tmp_path / "d"))
    config = (tmp_path / "d" / "config.json")
    config.write_text(config.read_text().replace("torch.nn.modules.activation.Tanh", "evil.module.Activation"))
    with pytest.raises(DeclarationError, match="not a torch.nn module"):
        Pooler(("mean",), (tmp_path / "d",), normalize=False)


def test_mean_excludes_padding_and_control_tokens(batch):
    hidden, ids, mask = batch
    out = pool(hidden, ids, mask, "mean", exclude_ids=torch.tensor([900]))
    expected = torch.stack([
        hidden[0, [0, 1, 3, 4]].mean(0), hidden[1, [0, 1, 2]].mean(0), hidden[2, [0, 3]].mean(0),
    ])
    torch.testing.assert_close(out, expected)


def test_row_of_only_excluded_tokens_is_zero_not_nan(batch):
    hidden, ids, mask = batch
    out = Pooler(("mean",), (), normalize=True, exclude_ids=torch.tensor([101, 9, 102]))(hidden, ids, mask)
    assert torch.isfinite(out).all()
    assert out[1].abs().sum() == 0


def test_unknown_mode():
    with pytest.raises(ValueError, match="unknown pooling"):
        pool(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), "median")
