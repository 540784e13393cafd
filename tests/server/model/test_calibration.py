"""QUANTIZE_RANGE=calibrated's parts (embedserve.model.calibration, transports.encodings.Quantization):
the corpus is the same in every process, the file keeps what it was given and refuses what is not
a calibration, and the ranges are sentence-transformers' calibration ranges of the same vectors,
cut and normalized as a request's are. On real servers: tests/server/test_calibrated_quantization.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from sentence_transformers.util import quantize_embeddings

from embedserve.model import calibration
from embedserve.transports import encodings
from embedserve.transports.encodings import Quantization

KEY = calibration.key("abc123", {"pooling": "mean", "normalize": True})


def unit_rows(n: int, d: int, seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32) * np.linspace(0.2, 3, d, dtype=np.float32)
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def test_the_corpus_is_the_same_in_every_process():
    """Pods compute the same calibration only from the same texts: nothing in the corpus may hang
    on hash seeds or anything else of the process."""
    code = "from embedserve.model import calibration as c; print(c.CORPUS_DIGEST, len(c.CORPUS), len(set(c.CORPUS)))"
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.split()[0] for seed in ("1", "2")}
    assert seen == {calibration.CORPUS_DIGEST}
    assert len(calibration.CORPUS) == len(set(calibration.CORPUS)) == 512


def test_a_saved_calibration_is_read_back_as_it_was(tmp_path):
    rows = unit_rows(len(calibration.CORPUS), 16)
    path = calibration.file_for(tmp_path, KEY)
    assert calibration.write(path, KEY, rows) is rows
    assert oct(path.stat().st_mode & 0o777) == "0o644"  # pods of another user read it too
    back = calibration.read(path, KEY, 16)
    assert back.dtype == np.float32 and back.tobytes() == rows.tobytes()
    assert calibration.digest(back) == calibration.digest(rows)
    assert calibration.read(calibration.file_for(tmp_path, {**KEY, "model_revision": "other"}), KEY) is None


def _save(path, key, embeddings, allow_pickle=False):
    import io
    import json

    buffer = io.BytesIO()
    np.savez(buffer, embeddings=embeddings, key=np.array(json.dumps(key, sort_keys=True)), allow_pickle=allow_pickle)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())


def _forged(path, claimed_shape, compress):
    """An archive whose embeddings' header claims `claimed_shape` (float32) over a few KiB of
    data, the key right: what a writer of the cache could leave for every pod to load."""
    import io
    import json
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": claimed_shape})
    key = io.BytesIO()
    np.save(key, np.array(json.dumps(KEY, sort_keys=True)))
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=compress) as archive:
        archive.writestr("key.npy", key.getvalue())
        archive.writestr("embeddings.npy", b"\x93NUMPY\x01\x00" + header.getvalue()[8:] + bytes(4096))


N, D = len(calibration.CORPUS), 16
BAD = {
    # 1.86 TiB claimed in a few bytes of deflate: np.load allocated it (MemoryError, every pod).
    "deflated, claiming 1.86 TiB": lambda p: _forged(p, (N, 10**9), zipfile.ZIP_DEFLATED),
    "stored, claiming 1.86 TiB": lambda p: _forged(p, (N, 10**9), zipfile.ZIP_STORED),
    "compressed": lambda p: (p.parent.mkdir(parents=True, exist_ok=True), np.savez_compressed(
        p, embeddings=unit_rows(N, D), key=np.array(__import__("json").dumps(KEY, sort_keys=True)))),
    "another key": lambda p: _save(p, {**KEY, "model_revision": "forged"}, unit_rows(N, D)),
    "not finite": lambda p: _save(p, KEY, np.full((N, D), np.nan, dtype=np.float32)),
    "too few rows": lambda p: _save(p, KEY, unit_rows(N - 1, D)),
    "another width": lambda p: _save(p, KEY, unit_rows(N, D + 1)),
    "float64": lambda p: _save(p, KEY, unit_rows(N, D).astype(np.float64)),
    # A pickled object array: np.load(allow_pickle=False) refuses to unpickle it, so no code runs.
    "pickled objects": lambda p: _save(p, KEY, np.array([object()] * 3, dtype=object), allow_pickle=True),
    "not an archive": lambda p: (p.parent.mkdir(parents=True, exist_ok=True), p.write_bytes(os.urandom(500))),
}


@pytest.mark.parametrize("damage", BAD, ids=list(BAD))
def test_a_file_that_is_not_a_usable_calibration_is_warned_of_and_not_used(tmp_path, damage, caplog):
    path = calibration.file_for(tmp_path, KEY)
    BAD[damage](path)
    caplog.set_level(logging.WARNING)
    assert calibration.read(path, KEY, D) is None
    assert [r for r in caplog.records if str(path) in r.getMessage()], caplog.text


def test_pods_that_compute_together_all_serve_the_one_saved_first(tmp_path, caplog):
    """Pods that start together without a prefetched file each compute one; a rename let the last
    writer replace the file while earlier pods kept serving theirs (on CPUs of another kind,
    other last bits: another digest). The first saved is the one every pod serves."""
    path = calibration.file_for(tmp_path, KEY)
    first, second = unit_rows(N, D, seed=1), unit_rows(N, D, seed=2)
    assert calibration.write(path, KEY, first) is first
    caplog.set_level(logging.INFO)
    served = calibration.write(path, KEY, second)
    assert served.tobytes() == first.tobytes() and "saved by another pod first" in caplog.text
    assert calibration.read(path, KEY, D).tobytes() == first.tobytes()
    assert not [f for f in path.parent.iterdir() if f != path]  # no temporary file left
    _save(path, {**KEY, "model_revision": "forged"}, first)  # what is there is no usable calibration: replaced
    assert calibration.write(path, KEY, second) is second and calibration.read(path, KEY, D).tobytes() == second.tobytes()


def test_a_dimension_with_no_spread_is_a_warning_not_a_failed_start(tmp_path, caplog):
    """A model with a dead dimension (constant over every text): quantization gives it one level,
    as sentence-transformers does. Refusing it failed every start of such a model (check raised in
    the computing pod too)."""
    flat = np.hstack([unit_rows(N, D - 1), np.zeros((N, 1), np.float32)])
    caplog.set_level(logging.WARNING)
    assert calibration.check(flat, D) is flat and "1 of 16 dimensions have no spread" in caplog.text
    path = calibration.file_for(tmp_path, KEY)
    assert calibration.write(path, KEY, flat) is flat and calibration.read(path, KEY, D).tobytes() == flat.tobytes()
    q = Quantization(calibration=flat, normalized=False)
    codes = encodings.quantize(unit_rows(4, D), "int8", q, normalized=False)
    assert codes.shape == (4, D) and len(set(codes[:, -1].tolist())) == 1


def test_a_read_only_cache_is_said_at_info(tmp_path, caplog):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    caplog.set_level(logging.INFO)
    path = calibration.file_for(tmp_path / "ro", KEY)
    if os.geteuid() == 0:  # root writes anywhere: a directory under a regular file cannot be made
        (tmp_path / "file").write_text("")
        path = calibration.file_for(tmp_path / "file", KEY)
    assert calibration.write(path, KEY, unit_rows(N, D)) is None
    assert any("cannot save" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("precision", ["int8", "uint8"])
@pytest.mark.parametrize("dims, normalized, model_normalizes", [
    (16, True, True),  # a normalizing model, every dimension
    (6, True, True),  # a cut, re-normalized (Matryoshka)
    (16, False, False),  # a model that does not normalize
    (6, False, False),
    (6, True, False),  # TEI's normalize: true on a model that does not normalize
])
def test_calibrated_ranges_are_sentence_transformers_calibration_of_the_same_vectors(precision, dims, normalized,
                                                                                      model_normalizes):
    """What the server sends equals quantize_embeddings(vectors, calibration_embeddings=the corpus's
    vectors transformed as the request's were): L2-normalized, cut, normalized again."""
    raw = unit_rows(N, D, seed=1) * np.float32(3.0)
    calib = raw / np.linalg.norm(raw, axis=1, keepdims=True) if model_normalizes else raw
    calib = calib.astype(np.float32)
    q = Quantization(calibration=calib, normalized=model_normalizes, digest=calibration.digest(calib))
    requested = unit_rows(40, D, seed=2) * np.float32(1.0 if model_normalizes else 3.0)
    if normalized and not model_normalizes:
        requested = requested / np.linalg.norm(requested, axis=1, keepdims=True)
        calib = calib / np.linalg.norm(calib, axis=1, keepdims=True)
    rows = encodings.truncated(requested.astype(np.float32), dims, normalized)
    judge_calibration = encodings.truncated(calib.astype(np.float32), dims, normalized)
    ours = encodings.quantize(rows, precision, q, normalized)
    theirs = quantize_embeddings(rows, precision, calibration_embeddings=judge_calibration)
    assert ours.dtype == theirs.dtype and ours.tobytes() == theirs.tobytes()
    assert np.ptp(ours.astype(np.int32)) > 200  # the calibrated ranges use the byte (the fixed [-1, 1] would not)
    assert q.health() == {"quantize_range": 0.0, "quantize_calibration": q.digest}


def test_a_fixed_range_is_as_before():
    rows = unit_rows(10, 12)
    assert encodings.quantize(rows, "int8", Quantization(0.3)).tobytes() == encodings.quantize(rows, "int8", 0.3).tobytes()
    assert Quantization(0.3).health() == {"quantize_range": 0.3, "quantize_calibration": ""}
    with pytest.raises(Exception, match="dimensions=17"):
        Quantization(calibration=unit_rows(N, 16)).ranges(17)


def test_a_fixed_ranges_rows_are_made_once_per_width():
    """Each int8/uint8 request asked the fixed range's [2, d] again, a 2 x d Python list each
    time; kept per width (read-only: shared), equal to what it was."""
    q = Quantization(0.3)
    first = q.ranges(384)
    assert q.ranges(384) is first and not first.flags.writeable
    assert first.tobytes() == np.array([[-0.3] * 384, [0.3] * 384]).astype(np.float32).tobytes()
