"""MAX_REPLY_BYTES, honoured by every kind of answer: refused before any work where the request
says how large its answer will be (vectors: inputs × dimensions × encoding), else as soon as the
answer is known to outgrow it (/tokenize's tokens, a sparse model's non-zero entries), with a 400
/ INVALID_ARGUMENT naming the size; never cut silently. On real processes, a server of 1 MiB."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, counter

MIB = 2**20


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def small():
    server = ServerProcess({"MODEL_PATH": "sim:1000000", "MAX_DRAIN_TIME_MS": "600000",
                            "MAX_REPLY_BYTES": str(MIB), "MAX_TEXTS_PER_REQUEST": "1024"}).wait_ready()
    yield server
    server.stop()


def test_vectors_over_the_bound_are_refused_before_any_work(small):
    computed = counter(small.metrics, "embedfleet_tokens_total", kind="real")
    status, reply = post(small.http + "/v1/embeddings", {"model": "sim:1000000", "input": ["hello"] * 200})
    assert status == 400 and reply["error"]["code"] == "reply_too_large", reply
    assert "MAX_REPLY_BYTES=1048576" in reply["error"]["message"] and "base64" in reply["error"]["message"]
    status, reply = post(small.http + "/embed", {"inputs": ["hello"] * 200})
    assert status == 400 and "MAX_REPLY_BYTES" in reply["error"]["message"]
    assert counter(small.metrics, "embedfleet_tokens_total", kind="real") == computed  # nothing computed
    # What fits is served: fewer dimensions, or base64 (a sixth of floats as JSON)
    status, reply = post(small.http + "/v1/embeddings", {"model": "sim:1000000", "input": ["hello"] * 200,
                                                         "encoding_format": "base64"})
    assert status == 200 and len(reply["data"]) == 200
    status, reply = post(small.http + "/v1/embeddings", {"model": "sim:1000000", "input": ["hello"] * 200,
                                                         "dimensions": 64})
    assert status == 200 and len(reply["data"][0]["embedding"]) == 64


def test_grpc_vectors_over_the_bound_are_refused_naming_it(small):
    computed = counter(small.metrics, "embedfleet_tokens_total", kind="real")
    with grpc.insecure_channel(small.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as e:  # 700 rows of 384 float32: 1.08 MB
            stub.Embed(pb.EmbedRequest(texts=["hello"] * 700), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "MAX_REPLY_BYTES=1048576" in e.value.details()
        assert counter(small.metrics, "embedfleet_tokens_total", kind="real") == computed
        assert stub.Embed(pb.EmbedRequest(texts=["hello"] * 512), timeout=30).shape == [512, 384]  # 786 KB
        assert stub.Embed(pb.EmbedRequest(texts=["hello"] * 700, encoding=pb.INT8), timeout=30).shape == [700, 384]


def test_tokenize_is_refused_once_its_answer_outgrows_the_bound(small):
    status, reply = post(small.http + "/tokenize", {"inputs": ["!" * 4000] * 64, "truncate": False})
    assert status == 400 and reply["error"]["code"] == "reply_too_large", reply
    status, reply = post(small.http + "/tokenize", {"inputs": ["hello world"] * 64})
    assert status == 200 and len(reply) == 64


def test_sparse_rows_over_the_bound_are_refused_over_http_and_grpc(tmp_path_factory, model_dir):
    from tests.server.model.sparse_models import build_splade

    path = build_splade(tmp_path_factory.mktemp("splade"), model_dir)
    server = ServerProcess({"MODEL_PATH": path, "TASK": "sparse", "MAX_DRAIN_TIME_MS": "600000",
                            "MAX_REPLY_BYTES": str(MIB)}).wait_ready()
    try:
        texts = [f"sparse retrieval passage number {i} about embeddings and vocabularies" for i in range(300)]
        status, reply = post(server.http + "/embed_sparse", {"inputs": texts})
        assert status == 400 and "non-zero entries" in reply["error"]["message"], reply
        assert post(server.http + "/embed_sparse", {"inputs": texts[:4]})[0] == 200
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                stub.EmbedSparse(pb.EmbedRequest(texts=(texts * 2)[:500]), timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "MAX_REPLY_BYTES" in e.value.details()
    finally:
        server.stop()
