"""Vectors as a request asks for them: the first N dimensions (Matryoshka), then an encoding:
float32, float32 as base64, or quantized as sentence-transformers' `quantize_embeddings` does it.
Pure numpy, one place for gRPC and HTTP alike.

Quantization uses ranges fixed before any request, never ones calibrated on the request: a vector
then quantizes the same whatever else its request holds and on whichever pod answers, so an index
built from many requests is coherent. Either [-r, r] for every dimension, r = QUANTIZE_RANGE (the
result equals `quantize_embeddings(vectors, precision, ranges=np.array([[-r] * d, [r] * d]))` byte
for byte), or, QUANTIZE_RANGE=calibrated, each dimension's min and max over the model's own vectors
of a fixed corpus (embedserve.model.calibration), cut and normalized as the request's vectors are:
`quantize_embeddings(vectors, precision, calibration_embeddings=those)` byte for byte.
"""

from __future__ import annotations

import base64
import collections
import threading

import numpy as np

from embedserve.errors import InvalidInput, ReplyTooLarge

FLOAT, BASE64 = "float", "base64"
QUANTIZED = ("int8", "uint8", "binary", "ubinary")
ENCODINGS = (FLOAT, BASE64, *QUANTIZED)
LEVELS = 255  # steps between a range's ends: 256 levels of a byte


def check_dimensions(asked: int | None, model_dim: int = 0) -> None:
    """What is refused before any work (no admission room, no model time spent on it): a negative
    count (gRPC's int32; HTTP's schema refuses 0 and below itself), and more than the model
    computes (`model_dim`, once known)."""
    if asked is not None and asked < 0:
        raise InvalidInput(f"dimensions={asked}: must be positive (0: the model's default)")
    if asked and model_dim and asked > model_dim:
        raise InvalidInput(f"dimensions={asked} exceeds the model's {model_dim} dimensions")


def output_dimensions(asked: int | None, declared: int | None, model_dim: int) -> int:
    """How many leading dimensions to send: `asked` (None or 0: the model's declared
    truncate_dim, else all of them). More than the model computes is the caller's error, named."""
    check_dimensions(asked)
    if not asked:
        return min(declared, model_dim) if declared else model_dim
    if asked > model_dim:
        raise InvalidInput(f"dimensions={asked} exceeds the model's {model_dim} dimensions")
    return asked


def truncated(rows: np.ndarray, dimensions: int, renormalize: bool) -> np.ndarray:
    """The first `dimensions` of each row; L2-normalized again when the full rows were (a cut unit
    vector is shorter than 1: as sentence-transformers' encode(truncate_dim=, normalize_embeddings=True),
    not as its truncate_dim alone, which leaves the cut vector as it is)."""
    if dimensions >= rows.shape[1]:
        return rows
    cut = rows[:, :dimensions]
    if not renormalize:
        return cut
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return (cut / np.where(norms == 0, 1, norms)).astype(np.float32, copy=False)


class Quantization:
    """The ranges int8 and uint8 map onto their 256 levels: fixed, [-r, r] of every dimension
    (`r`, QUANTIZE_RANGE), or calibrated: per dimension, the min and max of `calibration` (the
    model's float32 vectors of the calibration corpus, as served: `normalized` says whether the
    server's vectors are unit-length), cut and normalized as the quantized rows were. `digest`
    names a calibration (model.calibration.digest); "" for a fixed range."""

    CACHED = 64  # widths (and normalizations) whose ranges are kept: each is one pass over the corpus, or 2 x d values

    def __init__(self, r: float = 1.0, calibration: np.ndarray | None = None, normalized: bool = True,
                 digest: str = ""):
        self.r, self.calibration, self.normalized, self.digest = r, calibration, normalized, digest
        self._ranges: collections.OrderedDict[tuple[int, bool], np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()  # front ends and the one process call this from the event loop, tests from threads

    @property
    def calibrated(self) -> bool:
        return self.calibration is not None

    def health(self) -> dict:
        """What /health and gRPC HealthCheck say of it: `quantize_range` r (0 when calibrated) and
        `quantize_calibration` the calibration's digest ("" for a fixed range)."""
        return {"quantize_range": 0.0 if self.calibrated else self.r, "quantize_calibration": self.digest}

    def ranges(self, dimensions: int, normalized: bool = True) -> np.ndarray:
        """float32 [2, dimensions]: each dimension's start and end, for rows of that width
        (`normalized`: the rows were L2-normalized, and again after a cut, as encodings.truncated)."""
        if self.calibration is not None and not 0 < dimensions <= self.calibration.shape[1]:
            raise InvalidInput(f"dimensions={dimensions}: the calibration has {self.calibration.shape[1]}")
        key = (dimensions, normalized if self.calibration is not None else None)  # a fixed range: one per width
        with self._lock:
            found = self._ranges.get(key)
            if found is not None:
                self._ranges.move_to_end(key)
                return found
        if self.calibration is None:
            found = np.full((2, dimensions), self.r, dtype=np.float32)
            found[0] = -found[0]
            return self._keep(key, found)
        vectors = self.calibration
        if normalized and not self.normalized:  # a request that asks normalized vectors of a model that gives raw ones
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = (vectors / np.where(norms == 0, 1, norms)).astype(np.float32)
        vectors = truncated(vectors, dimensions, normalized)
        return self._keep(key, np.vstack((vectors.min(axis=0), vectors.max(axis=0))).astype(np.float32))

    def _keep(self, key: tuple, found: np.ndarray) -> np.ndarray:
        found.flags.writeable = False  # shared by every request of that width
        with self._lock:
            self._ranges[key] = found
            while len(self._ranges) > self.CACHED:
                self._ranges.popitem(last=False)
        return found


def quantize(rows: np.ndarray, encoding: str, r: "float | Quantization", normalized: bool = True) -> np.ndarray:
    """float32 rows → `encoding`'s rows: int8/uint8 [n, d] (each component over its dimension's
    range in 256 levels, clipped outside: `r` a Quantization, or a float for the fixed [-r, r]),
    binary/ubinary [n, ceil(d / 8)] (1 where > 0, 8 bits to a byte, binary's bytes offset by
    -128). The arithmetic is sentence-transformers' own, in float32, so the bytes are the same."""
    rows = np.asarray(rows, dtype=np.float32)
    if encoding in ("int8", "uint8"):
        d = rows.shape[1]
        ranges = (r if isinstance(r, Quantization) else Quantization(r)).ranges(d, normalized)
        starts = ranges[0, :]
        steps = (ranges[1, :] - starts) / LEVELS
        steps = np.where(steps == 0, 1, steps)  # as sentence-transformers: a flat dimension is one level
        levels = np.clip(np.floor((rows - starts) / steps), 0, LEVELS)
        return levels.astype(np.uint8) if encoding == "uint8" else (levels - 128).astype(np.int8)
    if encoding in ("binary", "ubinary"):
        bits = np.packbits(rows > 0, axis=-1)
        return bits if encoding == "ubinary" else (bits.astype(np.int16) - 128).astype(np.int8)
    raise InvalidInput(f"encoding {encoding!r}: expected one of {', '.join(QUANTIZED)}")


# The most bytes one value takes in an answer, a separator included: a float32 as JSON writes its
# float64 ("-1.2345678901234567e-05,"), a quantized byte ("-128,"), and per row its fields.
JSON_FLOAT_BYTES, JSON_BYTE_BYTES, JSON_ROW_BYTES = 25, 5, 64


def reply_bytes(rows: int, dimensions: int, encoding: str, json_text: bool) -> int:
    """The most an answer of `rows` vectors of `dimensions` takes in `encoding`: as JSON
    (`json_text`: HTTP) or as the protobuf's bytes (gRPC). Known before any work, so an answer
    over MAX_REPLY_BYTES is refused before the request is admitted."""
    stored = dimensions if encoding in (FLOAT, BASE64, "int8", "uint8") else row_bytes(encoding, dimensions)
    if not json_text:
        return rows * stored * (4 if encoding == FLOAT else 1) + 64
    per_value = {FLOAT: JSON_FLOAT_BYTES, BASE64: 0}.get(encoding, JSON_BYTE_BYTES)
    per_row = 4 * -(-dimensions * 4 // 3) + 2 if encoding == BASE64 else stored * per_value  # base64: 4 per 3 bytes, quoted
    return rows * (per_row + JSON_ROW_BYTES) + 256


def most_rows(limit: int, dimensions: int, encoding: str, json_text: bool, extra_per_row: int = 0) -> int:
    """The most rows of `dimensions` whose answer (reply_bytes, plus `extra_per_row` and one more
    of it: a ragged answer's offsets) fits `limit`; 0 when none or no dimensions. Pure."""
    if dimensions <= 0:
        return 0
    per_row = reply_bytes(2, dimensions, encoding, json_text) - reply_bytes(1, dimensions, encoding, json_text) + extra_per_row
    return max(0, (limit - reply_bytes(0, dimensions, encoding, json_text) - extra_per_row) // per_row)


def check_reply(rows: int, dimensions: int, encoding: str, json_text: bool, limit: int) -> None:
    """Refuse (ReplyTooLarge, naming the sizes and what to ask instead) an answer over `limit`."""
    size = reply_bytes(rows, dimensions, encoding, json_text)
    if size > limit:
        cheaper = "" if encoding != FLOAT else (", a smaller encoding (base64 is a sixth the size of floats as JSON)"
                                                if json_text else ", a quantized encoding")
        raise ReplyTooLarge(f"the answer to {rows} inputs of {dimensions} dimensions ({encoding}) would be up to "
                            f"{size} bytes, over MAX_REPLY_BYTES={limit}: send fewer inputs, ask for fewer "
                            f"dimensions{cheaper}")


def dtype_of(encoding: str) -> np.dtype:
    """The numpy dtype a quantized encoding's bytes are read as."""
    return np.dtype(np.int8 if encoding in ("int8", "binary") else np.uint8)


def row_bytes(encoding: str, dimensions: int) -> int:
    """Bytes per row of a quantized encoding: one per dimension, or one per 8 (bits)."""
    return (dimensions + 7) // 8 if encoding in ("binary", "ubinary") else dimensions


def base64_rows(rows: np.ndarray) -> list[str]:
    """Each row's float32 little-endian bytes in base64 (OpenAI's encoding_format=base64)."""
    return [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in rows]


def encoded(rows: np.ndarray, encoding: str, r: "float | Quantization", normalized: bool = True) -> list:
    """Rows as JSON carries them: lists of floats, base64 strings, or lists of ints (quantized)."""
    if encoding == FLOAT:
        return rows.tolist()
    if encoding == BASE64:
        return base64_rows(rows)
    return quantize(rows, encoding, r, normalized).tolist()
