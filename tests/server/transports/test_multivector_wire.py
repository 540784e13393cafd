"""Token vectors on the wire (transports/multivector_wire.py, frontends/token_rows_ipc.py): the
gRPC answer decoded by the Client is what was computed (float32 exactly; quantized as
encodings.quantize quantizes a dense row), an answer over the bound is refused naming its
vectors, and TokenRows cross IPC unchanged."""

import numpy as np
import pytest

from embedserve.client import decode_multivector
from embedserve.errors import ReplyTooLarge
from embedserve.frontends import token_rows_ipc
from embedserve.model.token_rows import TokenRows
from embedserve.transports import encodings
from embedserve.transports.multivector_wire import multivector_response


def rows() -> TokenRows:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((9, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return TokenRows(vectors, np.array([0, 4, 4, 9]))  # a text with no vector in the middle


def test_float_and_quantized_answers_decode_to_what_was_computed():
    r, q = rows(), encodings.Quantization(1.0)
    got = decode_multivector(multivector_response(r, "float", q, True))
    assert [g.shape for g in got] == [(4, 16), (0, 16), (5, 16)]
    assert all(np.array_equal(g, r.row(i)) for i, g in enumerate(got))
    for encoding in ("int8", "uint8", "binary", "ubinary"):
        got = decode_multivector(multivector_response(r, encoding, q, True))
        want = encodings.quantize(r.vectors, encoding, q, True)
        assert np.array_equal(np.concatenate(got), want) and [len(g) for g in got] == [4, 0, 5]


def test_an_answer_over_the_bound_is_refused_naming_its_vectors():
    with pytest.raises(ReplyTooLarge, match="9 token vectors"):
        multivector_response(rows(), "float", encodings.Quantization(1.0), True, limit=256)


def test_token_rows_cross_ipc_unchanged():
    r = rows()
    header, payload = token_rows_ipc.reply(r, tokens=12)
    back = token_rows_ipc.rows_of(header, memoryview(payload))
    assert header["tokens"] == 12 and np.array_equal(back.vectors, r.vectors) and back.offsets.tolist() == [0, 4, 4, 9]
    assert token_rows_ipc.rows_of({"rows": 1, "dim": 2, "tokens": 3}, b"") is None  # dense rows' reply
