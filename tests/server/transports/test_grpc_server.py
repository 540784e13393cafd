"""The real server process, the real packaged model, real gRPC over loopback."""

import asyncio
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import Client, decode_embeddings
from tests.conftest import make_text

# The packaged model reads 256 tokens (its max_seq_length): the 512 bucket is not used, and
# longer texts are cut at 256, as sentence-transformers cuts them.
BUCKETS = (16, 32, 64, 128, 256)
TOL = 1e-5


@pytest.fixture(scope="module")
def stub(default_server):
    channel = grpc.insecure_channel(default_server.target)
    yield pb_grpc.InferenceStub(channel)
    channel.close()


def spanning_texts(reference):
    rng = np.random.default_rng(7)
    texts = [make_text(rng, n) for n in (1, 6, 12, 25, 45, 90, 170, 330, 700)]
    covered = {next(b for b in BUCKETS if b >= reference.tokens(t)) for t in texts}
    assert covered == set(BUCKETS), "the texts must land in every bucket"
    return texts


def test_embed_equals_sentence_transformers_in_every_bucket(stub, reference):
    texts = spanning_texts(reference)
    out = decode_embeddings(stub.Embed(pb.EmbedRequest(texts=texts)))
    assert out.shape == (len(texts), 384)
    assert np.abs(out - reference.embed(texts)).max() <= TOL


def test_infer_equals_the_reference_for_pretokenized_rows(stub, reference):
    texts = spanning_texts(reference)
    enc = reference.tok(texts, truncation=True, max_length=reference.max_length, padding=True, return_tensors="np")
    ids, mask = enc["input_ids"].astype("<i4"), enc["attention_mask"].astype("<i4")
    req = pb.InferRequest(input_ids=ids.tobytes(), attention_mask=mask.tobytes(), shape=list(ids.shape))
    out = decode_embeddings(stub.Infer(req))
    assert np.abs(out - reference.embed(texts)).max() <= TOL


async def test_500_concurrent_requests_each_get_their_own_rows(default_server, reference):
    # Short texts of every length up to two buckets, a few per request: what is tested is that 500
    # concurrent callers' rows, spread over buckets and batches, each come home (the model's time
    # on 2 CPU cores is what a longer corpus would add, nothing else).
    rng = np.random.default_rng(11)
    pool = list(dict.fromkeys(make_text(rng, int(n)) for n in rng.integers(1, 40, size=200)))
    expected = dict(zip(pool, reference.embed(pool)))  # the reference once per text, not per request
    requests = [list(rng.choice(pool, size=int(rng.integers(1, 6)))) for _ in range(500)]
    async with Client(default_server.target, timeout_s=120) as client:
        results = await asyncio.gather(*(client.embed(texts) for texts in requests))
    worst = max(float(np.abs(out - np.stack([expected[t] for t in texts])).max())
                for texts, out in zip(requests, results))
    assert worst <= TOL
    assert [len(out) for out in results] == [len(t) for t in requests]


@pytest.mark.parametrize(
    "request_, message",
    [
        (pb.EmbedRequest(texts=[]), "texts is empty"),
        (pb.EmbedRequest(texts=["ok", "   "]), r"texts\[1\] is empty or whitespace"),
        (pb.EmbedRequest(texts=["x"] * 513), "513 texts exceed MAX_TEXTS_PER_REQUEST=512"),
        (pb.InferRequest(input_ids=b"\x01\x00\x00", attention_mask=b"\x01\x00\x00\x00", shape=[1, 1]), "multiple of 4"),
        (pb.InferRequest(input_ids=np.array([[101, 99999]], "<i4").tobytes(),
                         attention_mask=np.ones((1, 2), "<i4").tobytes(), shape=[1, 2]), "vocabulary size 30522"),
        (pb.InferRequest(input_ids=np.ones(4, "<i4").tobytes(), attention_mask=np.ones(4, "<i4").tobytes(), shape=[2, 3]), "needs 6"),
    ],
)
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(stub, request_, message):
    method = stub.Embed if isinstance(request_, pb.EmbedRequest) else stub.Infer
    with pytest.raises(grpc.RpcError) as e:
        method(request_)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() and __import__("re").search(message, e.value.details())
    assert decode_embeddings(stub.Embed(pb.EmbedRequest(texts=["still serving"]))).shape == (1, 384)


def test_health_protocols_and_reflection(default_server, stub):
    channel = grpc.insecure_channel(default_server.target)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "embedfleet.v1.Inference"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    ours = stub.HealthCheck(pb.HealthCheckRequest())
    assert ours.status in ("healthy", "degraded") and ours.embedding_dimension == 384
    assert ours.service_rate_tokens_per_sec > 0  # seeded by warm-up
    code, fields = default_server.health()
    assert code == 200 and fields["embedding_dimension"] == 384
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"embedfleet.v1.Inference", "grpc.health.v1.Health"} <= names
    channel.close()


def test_cli_client_prints_dimension_and_values(default_server):
    out = subprocess.run(
        [sys.executable, "-m", "embedserve.client", "--target", default_server.target, "hello world", "second text"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "2 embeddings, dimension 384" in out.stdout
    assert "'hello world'" in out.stdout


async def test_quantization_gives_the_ranges_int8_codes_use(default_server):
    """rpc Quantization (Client.quantization): what HTTP GET /quantization gives, over gRPC. With
    the fixed default range, [-1, 1] at every dimension; quantize_embeddings with them is the
    server's own bytes. Calibrated ranges: tests/server/test_calibrated_quantization.py."""
    from sentence_transformers.util import quantize_embeddings

    texts = ["ranges over gRPC", "a second text, a little longer than the first"]
    async with Client(default_server.target) as client:
        q = await client.quantization(dimensions=128)
        floats = await client.embed(texts, dimensions=128)
        codes = await client.embed(texts, dimensions=128, encoding="int8")
        whole = await client.quantization()
        with pytest.raises(grpc.aio.AioRpcError) as too_wide:
            await client.quantization(dimensions=385)
    assert (q.calibration, q.quantize_range, q.dimensions, q.normalized) == ("", 1.0, 128, True)
    assert q.ranges.tobytes() == np.array([[-1.0] * 128, [1.0] * 128], dtype=np.float32).tobytes()
    assert quantize_embeddings(floats, "int8", ranges=q.ranges).tobytes() == codes.tobytes()
    assert whole.dimensions == 384 and whole.ranges.shape == (2, 384)
    assert too_wide.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "385" in too_wide.value.details()
