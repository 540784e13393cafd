"""LONG_TEXTS=window: the Pooler also returns each row's norm before Normalize (one more column),
and the vectors beside it are the very ones it returns without (embedserve.model.pooling)."""

from __future__ import annotations

import torch

from embedserve.model.pooling import Pooler


def test_the_norm_column_leaves_the_vectors_bit_for_bit():
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16)
    ids = torch.randint(0, 100, (3, 7))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    plain = Pooler(("mean",), (), True)(hidden, ids, mask)
    with_norms = Pooler(("mean",), (), True, norms=True)(hidden, ids, mask)
    assert with_norms.shape == (3, 17)
    assert torch.equal(with_norms[:, :16], plain)
    unnormalized = Pooler(("mean",), (), False)(hidden, ids, mask)
    assert torch.allclose(with_norms[:, 16], unnormalized.norm(dim=-1))
    assert torch.allclose(plain * with_norms[:, 16:], unnormalized, atol=1e-6)
    # A model that does not normalize has its vectors as they are: no column.
    assert Pooler(("mean",), (), False, norms=True)(hidden, ids, mask).shape == (3, 16)
