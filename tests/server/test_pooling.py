import pytest
import torch

from embedserve.pooling import pool


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 4, generator=g)
    ids = torch.tensor([[101, 7, 900, 8, 102], [101, 9, 102, 0, 0], [101, 900, 900, 102, 0]])
    mask = (ids != 0).long()
    return hidden, ids, mask


def test_mean_excludes_padding_and_control_tokens(batch):
    hidden, ids, mask = batch
    out = pool(hidden, ids, mask, "mean", normalize=False, exclude_ids=torch.tensor([900]))
    expected = torch.stack([
        hidden[0, [0, 1, 3, 4]].mean(0), hidden[1, [0, 1, 2]].mean(0), hidden[2, [0, 3]].mean(0),
    ])
    torch.testing.assert_close(out, expected)


def test_mean_without_exclusions_and_normalized(batch):
    hidden, ids, mask = batch
    out = pool(hidden, ids, mask, "mean", normalize=True)
    raw = torch.stack([hidden[0].mean(0), hidden[1, :3].mean(0), hidden[2, :4].mean(0)])
    torch.testing.assert_close(out, raw / raw.norm(dim=1, keepdim=True))
    torch.testing.assert_close(out.norm(dim=1), torch.ones(3))


def test_cls_and_last(batch):
    hidden, ids, mask = batch
    torch.testing.assert_close(pool(hidden, ids, mask, "cls", False), hidden[:, 0])
    torch.testing.assert_close(pool(hidden, ids, mask, "last", False), hidden[[0, 1, 2], [4, 2, 3]])


def test_row_of_only_excluded_tokens_is_zero_not_nan(batch):
    hidden, ids, mask = batch
    out = pool(hidden, ids, mask, "mean", normalize=True, exclude_ids=torch.tensor([101, 9, 102]))
    assert torch.isfinite(out).all()
    assert out[1].abs().sum() == 0


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown pooling"):
        pool(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), "max", False)
