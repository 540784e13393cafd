"""Pooling, Dense and Normalize on random token states, against sentence-transformers' own modules
(the reference), and EXCLUDE_TOKENS (our deliberate deviation) against plain arithmetic."""

import pytest
import torch
from sentence_transformers.base.modules import Dense, Normalize
from sentence_transformers.sentence_transformer.modules import Pooling

from embedserve.model.declared import POOLING_MODES, DeclarationError
from embedserve.model.batches import PackSpec, layout
from embedserve.model.pooling import Pooler, pool, pool_segments


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


def packed_layout(hidden, ids, mask, spec):
    """The padded batch's rows laid end to end as embedserve.batching.packing lays them (tail rows and
    zero-length rows included), with random states in the tail."""
    lengths = mask.sum(1).numpy()
    cu, positions, segments, size = layout(lengths, spec)
    flat_hidden = torch.randn(size, hidden.shape[2])
    flat_ids = torch.full((size,), 0, dtype=torch.long)
    for i, n in enumerate(lengths):
        flat_hidden[cu[i] : cu[i] + n] = hidden[i, :n]
        flat_ids[cu[i] : cu[i] + n] = ids[i, :n]
    return flat_hidden, flat_ids, torch.from_numpy(positions), torch.from_numpy(segments), torch.from_numpy(cu)


@pytest.mark.parametrize("spec", [PackSpec(5, 8, None), PackSpec(5, 8, (16, 20))], ids=["exact", "static"])
@pytest.mark.parametrize("mode", POOLING_MODES)
def test_packed_rows_pool_as_padded_rows_do(batch, mode, spec):
    """Each mode per segment of one stream equals the padded pool(), control tokens excluded
    from the mean modes; the tail and zero-length rows change nothing of the real ones."""
    hidden, ids, mask = batch
    flat = packed_layout(hidden, ids, mask, spec)
    exclude = torch.tensor([900])
    got = pool_segments(*flat, mode, exclude)[:3]
    torch.testing.assert_close(got, pool(hidden, ids, mask, mode, exclude))


def test_packed_rows_go_through_the_same_head(batch, tmp_path):
    hidden, ids, mask = batch
    dense = Dense(8, 3, activation_function=torch.nn.GELU())
    (tmp_path / "2_Dense").mkdir()
    dense.save(str(tmp_path / "2_Dense"))
    pooler = Pooler(("cls", "weightedmean"), (tmp_path / "2_Dense",), normalize=True, exclude_ids=torch.tensor([900]))
    flat = packed_layout(hidden, ids, mask, PackSpec(5, 8, (16,)))
    torch.testing.assert_close(pooler.packed(*flat)[:3], pooler(hidden, ids, mask))
