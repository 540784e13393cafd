"""GET /quantization (an embedding server's): the ranges its int8 and uint8 encodings map onto
their 256 levels, per dimension, for vectors of a given width, so a client can quantize its own
vectors (queries computed elsewhere, an index rebuilt offline) as the server does, or dequantize
the server's: `quantize_embeddings(vectors, precision, ranges=np.array(ranges))`. Fixed ranges
(QUANTIZE_RANGE=r) are [-r, r] everywhere; calibrated ones (QUANTIZE_RANGE=calibrated) the min and
max of the model's vectors of the calibration corpus, cut to `dimensions` and normalized as a
request's vectors are, named by the digest /health and gRPC HealthCheck report."""

from __future__ import annotations

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from embedserve.transports import encodings
from embedserve.transports.hub import Hub

PATH = "/quantization"


class QuantizationRanges(BaseModel):
    quantize_range: float = Field(description="r of a fixed range [-r, r]; 0 when calibrated.")
    calibration: str = Field(description="The calibration's digest (as /health's quantize_calibration); "
                                         "empty for a fixed range.")
    dimensions: int
    normalized: bool = Field(description="Ranges for vectors L2-normalized (and again after a cut).")
    ranges: list[list[float]] = Field(description="[starts, ends]: one of each per dimension (float32 values).")


def install(router: APIRouter, server: Hub, errors: dict) -> None:
    @router.get(PATH, response_model=QuantizationRanges, responses=errors)
    async def quantization(
            dimensions: int | None = Query(None, ge=1, description="The vectors' width (default: the width "
                                           "served by default, the model's declared truncate_dim, else all)."),
            normalized: bool | None = Query(None, description="Vectors L2-normalized (default: as this model "
                                            "serves them; TEI's normalize: true on a model that does not)")):
        """The int8/uint8 ranges per dimension for vectors of `dimensions` (at most the model's)."""
        model_dim = server.model_dimension
        encodings.check_dimensions(dimensions, model_dim)
        dims = encodings.output_dimensions(dimensions, server.head.truncate_dim if server.head else None, model_dim)
        flag = bool(server.head.normalize if server.head else True) if normalized is None else normalized
        q = server.quantization
        ranges = q.ranges(dims, flag)
        return QuantizationRanges(quantize_range=q.health()["quantize_range"], calibration=q.digest, dimensions=dims,
                                  normalized=flag, ranges=ranges.tolist())
