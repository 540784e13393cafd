import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedserve.errors import InvalidInput
from embedserve.batching.infer_decode import decode

VOCAB = 100


def encode(ids, mask):
    return np.asarray(ids, "<i4").tobytes(), np.asarray(mask, "<i4").tobytes()


def test_decodes_a_view_of_the_request_bytes_without_copying():
    ids_b, mask_b = encode([[5, 6, 7], [8, 9, 0]], [[1, 1, 1], [1, 1, 0]])
    ids, lengths = decode(ids_b, mask_b, [2, 3], VOCAB, 10)
    assert ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert lengths.tolist() == [3, 2]
    assert not ids.flags.owndata  # a view of the bytes object


@pytest.mark.parametrize(
    "ids, mask, shape, message",
    [
        (b"\x00" * 6, b"\x00" * 8, [1, 2], "not a multiple of 4"),
        (np.ones(4, "<i4").tobytes(), np.ones(4, "<i4").tobytes(), [1, 3], "shape \\[1, 3\\] needs 3"),
        (np.ones(4, "<i4").tobytes(), np.ones(4, "<i4").tobytes(), [4], "shape must be \\[rows, seq\\]"),
        (np.ones(4, "<i4").tobytes(), np.ones(4, "<i4").tobytes(), [2, 1, 2], "shape must be"),
        (*encode([[-1, 2]], [[1, 1]]), [1, 2], "must not be negative"),
        (*encode([[1, VOCAB]], [[1, 1]]), [1, 2], "vocabulary size 100"),
        (*encode([[1, 2]], [[1, 2]]), [1, 2], "0 or 1"),
        (*encode([[1, 2], [3, 4]], [[1, 1], [0, 0]]), [2, 2], "row 1 has no attended tokens"),
        (*encode([[1, 2]], [[0, 1]]), [1, 2], "right-padded"),
        (b"", b"", [0, 4], "rows and seq must be >= 1"),
        (*encode([[1]] * 11, [[1]] * 11), [11, 1], "MAX_TEXTS_PER_REQUEST=10"),
    ],
)
def test_bad_input_is_named(ids, mask, shape, message):
    with pytest.raises(InvalidInput, match=message):
        decode(ids, mask, shape, VOCAB, 10)


def test_padding_positions_may_hold_any_id():
    ids, lengths = decode(*encode([[1, -7]], [[1, 0]]), [1, 2], VOCAB, 10)
    assert lengths.tolist() == [1]


@settings(max_examples=400, deadline=None)
@given(
    ids=st.binary(max_size=64),
    mask=st.binary(max_size=64),
    shape=st.lists(st.integers(-3, 20), max_size=3),
)
def test_arbitrary_bytes_decode_or_raise_the_one_validation_error(ids, mask, shape):
    try:
        out, lengths = decode(ids, mask, shape, VOCAB, 16)
    except InvalidInput:
        return
    rows, seq = shape
    m = np.frombuffer(mask, "<i4").reshape(rows, seq)
    assert out.shape == (rows, seq)
    assert (lengths >= 1).all() and (lengths == m.sum(1)).all()
    assert ((out[m == 1] >= 0) & (out[m == 1] < VOCAB)).all()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_valid_inputs_always_decode(data):
    rows = data.draw(st.integers(1, 6))
    seq = data.draw(st.integers(1, 12))
    lengths = data.draw(st.lists(st.integers(1, seq), min_size=rows, max_size=rows))
    ids = data.draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=seq, max_size=seq), min_size=rows, max_size=rows))
    mask = [[1 if j < n else 0 for j in range(seq)] for n in lengths]
    out, got = decode(*encode(ids, mask), [rows, seq], VOCAB, 16)
    assert got.tolist() == lengths and out.tolist() == ids
