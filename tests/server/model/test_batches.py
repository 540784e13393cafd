"""The packed stream's layout (embedserve.model.batches): rows end to end, the tail of a static
shape cut into rows no longer than the pin, cu_seqlens of a fixed length. Pure numpy."""

import numpy as np

from embedserve.model.batches import PackSpec, layout


def test_a_static_stream_covers_every_token_with_rows_no_longer_than_the_pin():
    spec = PackSpec(max_len=16, max_rows=8, ladder=(32, 64))
    cu, positions, segments, size = layout(np.array([5, 16, 2]), spec)
    assert size == 32 and len(cu) == 1 + 8 + 2  # row cap + ceil(32 / 16) tail rows
    assert cu.tolist() == [0, 5, 21, 23, 32] + [32] * 6  # the tail (9 tokens) is one row; then empty rows
    assert positions.tolist() == list(range(5)) + list(range(16)) + [0, 1] + list(range(9))
    assert segments.tolist() == [0] * 5 + [1] * 16 + [2] * 2 + [3] * 9
    cu, _, _, size = layout(np.array([16, 16, 16, 1]), PackSpec(16, 8, (64,)))
    assert (size, cu[:7].tolist()) == (64, [0, 16, 32, 48, 49, 64, 64])  # a 15-token tail row


def test_an_eager_stream_is_exactly_its_rows():
    cu, positions, segments, size = layout(np.array([3, 1, 2]), PackSpec(16, 8, None))
    assert (size, cu.tolist(), positions.tolist(), segments.tolist()) == (6, [0, 3, 4, 6], [0, 1, 2, 0, 0, 1],
                                                                          [0, 0, 0, 1, 2, 2])
