"""encodings.py, the vector operations every transport shares, against sentence-transformers'
quantize_embeddings and truncate/normalize (the judge), on vectors with the shapes the server sends:
unit rows, rows that are not unit, a dimension not a multiple of 8, values on and past the range's
ends."""

import base64

import numpy as np
import pytest
import torch
from sentence_transformers.util import quantize_embeddings, truncate_embeddings

from embedserve.errors import InvalidInput
from embedserve.transports import encodings


def unit_rows(n: int, d: int, seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.mark.parametrize("precision", encodings.QUANTIZED)
@pytest.mark.parametrize("d, r", [(384, 1.0), (37, 0.25), (8, 2.0)])
def test_quantize_equals_sentence_transformers_byte_for_byte(precision, d, r):
    rows = np.concatenate([unit_rows(64, d), 3 * unit_rows(8, d, seed=1),  # past the range: clipped
                           np.full((1, d), r, np.float32), np.full((1, d), -r, np.float32),  # its ends
                           np.zeros((1, d), np.float32)])
    ours = encodings.quantize(rows, precision, r)
    judge = quantize_embeddings(rows, precision, ranges=np.array([[-r] * d, [r] * d]))
    assert ours.dtype == judge.dtype == encodings.dtype_of(precision)
    assert ours.shape == judge.shape == (len(rows), encodings.row_bytes(precision, d))
    assert ours.tobytes() == judge.tobytes()


def test_quantized_levels_span_the_byte():
    """-r lands on the lowest level, 1.5 steps in on the next, 0 in the middle; r on 254, as in
    sentence-transformers' float32 arithmetic (2 / (2 / 255) floors to 254), past r on 255."""
    r, step = 1.0, 2.0 / 255
    rows = np.array([[-r, -r + 1.5 * step, 0.0, r, r + step]], np.float32)
    assert encodings.quantize(rows, "uint8", r).tolist() == [[0, 1, 127, 254, 255]]
    assert encodings.quantize(rows, "int8", r).tolist() == [[-128, -127, -1, 126, 127]]


def test_binary_packs_signs_eight_to_a_byte():
    rows = np.array([[1, -1, 0, 2, 0.5, -3, 1e-9, -1e-9, 7]], np.float32)  # 9 dims: 2 bytes, the last padded
    assert encodings.quantize(rows, "ubinary", 1.0).tolist() == [[0b10011010, 0b10000000]]
    assert encodings.quantize(rows, "binary", 1.0).tolist() == [[0b10011010 - 128, 0b10000000 - 128]]


@pytest.mark.parametrize("dims", [1, 7, 128, 383])
def test_truncated_renormalized_equals_sentence_transformers(dims):
    rows = unit_rows(16, 384)
    judge = torch.nn.functional.normalize(truncate_embeddings(torch.from_numpy(rows), dims), p=2, dim=1).numpy()
    ours = encodings.truncated(rows, dims, renormalize=True)
    assert ours.dtype == np.float32 and ours.shape == (16, dims)
    assert np.abs(ours - judge).max() <= 1e-6
    assert np.abs(np.linalg.norm(ours, axis=1) - 1).max() <= 1e-6


def test_truncated_without_renormalizing_is_the_first_dimensions():
    rows = 5 * unit_rows(4, 64)
    assert np.array_equal(encodings.truncated(rows, 10, renormalize=False), rows[:, :10])
    assert encodings.truncated(rows, 64, renormalize=True) is rows  # all of them: untouched
    zero = np.zeros((1, 64), np.float32)
    assert np.array_equal(encodings.truncated(zero, 8, renormalize=True), zero[:, :8])  # no division by 0


@pytest.mark.parametrize("asked, declared, expected", [
    (None, None, 384), (0, None, 384), (None, 256, 256), (0, 256, 256), (64, 256, 64), (300, 256, 300),
    (384, None, 384), (None, 1000, 384)])
def test_output_dimensions(asked, declared, expected):
    assert encodings.output_dimensions(asked, declared, 384) == expected


@pytest.mark.parametrize("asked, message", [(385, "dimensions=385 exceeds the model's 384"),
                                            (-1, "dimensions=-1: must be positive")])
def test_output_dimensions_refused_name_the_field(asked, message):
    with pytest.raises(InvalidInput, match=message):
        encodings.output_dimensions(asked, None, 384)


def test_json_encodings():
    rows = unit_rows(3, 16)
    assert encodings.encoded(rows, "float", 1.0) == rows.tolist()
    decoded = [np.frombuffer(base64.b64decode(s), "<f4") for s in encodings.encoded(rows, "base64", 1.0)]
    assert np.array_equal(np.stack(decoded), rows)
    ints = encodings.encoded(rows, "int8", 1.0)
    assert all(isinstance(v, int) for row in ints for v in row)
    with pytest.raises(InvalidInput, match="encoding 'int4'"):
        encodings.quantize(rows, "int4", 1.0)
