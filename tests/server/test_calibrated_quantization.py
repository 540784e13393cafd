"""QUANTIZE_RANGE=calibrated on real processes with the packaged model: `python -m
embedserve.prefetch` computes the calibration into a cache, a one-process server reads it from
there, and a server with FRONTENDS=2 on a cache of its own computes it at start-up (CPU, float32):
both name the same digest in /health and gRPC HealthCheck and quantize alike, byte for byte. The
judge is sentence-transformers: its quantize_embeddings with the ranges GET /quantization states
gives our int8/uint8 bytes, and those ranges are its own calibration ranges of the model's
vectors of the corpus (SentenceTransformer.encode, cut and normalized as asked)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers.util import quantize_embeddings

from embedserve.client import Client
from embedserve.model import calibration
from tests.conftest import ServerProcess
from tests.server.frontends.test_frontend import children, kill_front_ends
from tests.server.transports.test_http_api import post

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["Calibrated ranges use every level of the byte.", "a short query", "How far is the moon from the earth?",
         "A longer passage about quantization, recall, and why fixed ranges waste most of the levels of an int8."]
CALIBRATED = {"QUANTIZE_RANGE": "calibrated", "MAX_DRAIN_TIME_MS": "600000"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    filled = tmp_path_factory.mktemp("filled-cache")
    job = subprocess.run([sys.executable, "-m", "embedserve.prefetch"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": f"{ROOT / 'server'}:{ROOT}", **CALIBRATED,
                              "MODEL_CACHE_DIR": str(filled)})
    assert job.returncode == 0, job.stderr[-3000:]
    files = list((filled / calibration.DIRECTORY).glob("*.npz"))
    assert len(files) == 1, job.stderr[-3000:]
    reader = ServerProcess({**CALIBRATED, "MODEL_CACHE_DIR": str(filled)}).wait_ready()
    own = tmp_path_factory.mktemp("own-cache")
    computer = ServerProcess({**CALIBRATED, "MODEL_CACHE_DIR": str(own), "FRONTENDS": "2"}).wait_ready()
    fronts = children(computer.proc.pid)
    yield {"one process, cache filled by prefetch": reader, "FRONTENDS=2, computed at start-up": computer}, own
    reader.stop()
    computer.stop()
    kill_front_ends(fronts)


def ranges(server, dimensions: int | None = None) -> dict:
    query = f"?dimensions={dimensions}" if dimensions else ""
    with urllib.request.urlopen(server.http + "/quantization" + query, timeout=10) as r:
        return json.load(r)


async def embed(server, **kw) -> np.ndarray:
    async with Client(server.target, timeout_s=60) as client:
        return await client.embed(TEXTS, **kw)


def test_prefetch_fills_the_cache_a_pod_reads_and_a_pod_without_it_computes_the_same(servers):
    pods, own_cache = servers
    reader, computer = pods.values()
    assert "calibration: int8/uint8 ranges from" in reader.log()
    assert "calibration: computed the corpus's 512 vectors on the CPU in float32" in computer.log()
    assert list((own_cache / calibration.DIRECTORY).glob("*.npz"))  # saved for the next pod
    digests = set()
    for server in pods.values():
        code, health = server.health()
        assert code == 200 and health["quantize_range"] == 0.0 and len(health["quantize_calibration"]) == 16
        digests.add(health["quantize_calibration"])

        async def grpc_health():
            async with Client(server.target) as client:
                return await client.health()

        reply = asyncio.run(grpc_health())
        assert reply.quantize_calibration == health["quantize_calibration"] and reply.quantize_range == 0.0
        assert ranges(server)["calibration"] == health["quantize_calibration"]
    assert len(digests) == 1  # one revision, one calibration, whichever pod computed it


@pytest.mark.parametrize("precision", ["int8", "uint8"])
@pytest.mark.parametrize("dims", [0, 128])
def test_quantized_bytes_are_quantize_embeddings_with_the_stated_ranges(servers, precision, dims):
    pods, _ = servers
    answers = []
    for name, server in pods.items():
        floats = asyncio.run(embed(server, dimensions=dims))
        got = asyncio.run(embed(server, dimensions=dims, encoding=precision))
        stated = ranges(server, dims or None)
        assert stated["dimensions"] == floats.shape[1] and stated["normalized"]
        expected = quantize_embeddings(floats, precision, ranges=np.array(stated["ranges"], dtype=np.float32))
        assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), name
        code, _, body = post(server.http + "/embed", {"inputs": TEXTS, "encoding": precision,
                                                      **({"dimensions": dims} if dims else {})})
        assert code == 200 and np.array(body, dtype=got.dtype).tobytes() == got.tobytes(), name
        assert np.ptp(got.astype(np.int32)) > 128  # the byte is used: a fixed [-1, 1] spans ~60 levels here
        answers.append(got.tobytes())
    assert len(set(answers)) == 1  # every pod of the revision quantizes alike


def test_grpc_gives_the_calibrated_ranges_http_does(servers):
    """rpc Quantization (Client.quantization): the ranges and the digest GET /quantization gives,
    for every width asked, in one process and with front ends."""
    pods, _ = servers

    async def over_grpc(server, dims):
        async with Client(server.target) as client:
            return await client.quantization(dimensions=dims)

    for name, server in pods.items():
        for dims in (0, 128):
            http, got = ranges(server, dims or None), asyncio.run(over_grpc(server, dims))
            assert (got.calibration, got.quantize_range, got.dimensions, got.normalized) == (
                http["calibration"], 0.0, http["dimensions"], http["normalized"]), name
            assert got.ranges.tobytes() == np.array(http["ranges"], dtype=np.float32).tobytes(), name


@pytest.mark.parametrize("dims", [None, 128])
def test_the_ranges_are_the_models_own_vectors_of_the_corpus(servers, reference, dims):
    """sentence-transformers' calibration ranges (quantize_embeddings' min and max per dimension)
    of SentenceTransformer.encode over the corpus, cut and normalized as asked: the same within
    float noise."""
    pods, _ = servers
    vectors = reference.st.encode(list(calibration.CORPUS), truncate_dim=dims, normalize_embeddings=True,
                                  convert_to_numpy=True, batch_size=64)
    judge = np.vstack((vectors.min(axis=0), vectors.max(axis=0)))
    for server in pods.values():
        stated = np.array(ranges(server, dims)["ranges"], dtype=np.float32)
        assert stated.shape == judge.shape and np.abs(stated - judge).max() <= 1e-5
