"""Multi-vector (ColBERT) end to end, on real servers over real gRPC and HTTP, against the judge:
sentence-transformers 6.2's MultiVectorEncoder on the same directory (a tiny one built with it:
tests/server/model/multivector_models.py). Token vectors of queries and documents (counts, and
values within 1e-4), quantized as dense rows are, MaxSim rerank equal to util.maxsim within 1e-4
on /rerank, /v1/rerank and gRPC Rerank, the answer bound, the other tasks' routes refused by name,
/health's task; in one process and with front ends (TokenRows over IPC)."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, post_json
from tests.server.model.multivector_models import build_colbert

QUERIES = ["what is the capital of France?", "late interaction"]
DOCUMENTS = ["Paris, the capital; of France!", "short", "ColBERT keeps a vector per token, and MaxSim scores them: "
             "for each query token its best match, summed (punctuation is skipped)."]
SERVER_ENV = {"MAX_DRAIN_TIME_MS": "600000", "BATCH_CAPS": "16:4,64:4", "BUCKETS": "16,64"}


def post(url, body):
    return post_json(url, body)


@pytest.fixture(scope="module")
def colbert(tmp_path_factory, model_dir):
    return build_colbert(tmp_path_factory.mktemp("colbert"), model_dir)


@pytest.fixture(scope="module")
def judge(colbert):
    from sentence_transformers import MultiVectorEncoder

    return MultiVectorEncoder(colbert, device="cpu")


@pytest.fixture(scope="module", params=["one process", "FRONTENDS=2"])
def server(request, colbert):
    env = {**SERVER_ENV, "MODEL_PATH": colbert}
    if request.param != "one process":
        env["FRONTENDS"] = "2"
    s = ServerProcess(env).wait_ready()
    yield s
    s.stop()


def close(got, want) -> float:
    assert len(got) == len(want)
    worst = 0.0
    for g, w in zip(got, want):
        w = w.numpy()
        g = np.asarray(g, dtype=np.float32)
        assert g.shape == w.shape, (g.shape, w.shape)
        worst = max(worst, float(np.abs(g - w).max()))
    assert worst <= 1e-4
    return worst


def grpc_call(server, rpc: str, request):
    with grpc.insecure_channel(server.target) as channel:
        return getattr(pb_grpc.InferenceStub(channel), rpc)(request, timeout=60)


def test_token_vectors_over_grpc_and_http_equal_the_encoder(server, judge):
    from embedserve.client import decode_multivector

    for is_query, texts, want in ((True, QUERIES, judge.encode_query(QUERIES)),
                                  (False, DOCUMENTS, judge.encode_document(DOCUMENTS))):
        got = decode_multivector(grpc_call(server, "EmbedMultiVector", pb.MultiVectorRequest(texts=texts, is_query=is_query)))
        close(got, want)
        status, body = post(server.http + "/embed_multivector", {"inputs": texts, "is_query": is_query})
        assert status == 200, body
        close(body, want)
    status, body = post(server.http + "/", {"inputs": "one text"})  # TEI's root: this server's route
    assert status == 200 and len(body) == 1 and len(body[0][0]) == 16


def test_quantized_token_vectors_are_the_dense_rows_quantization(server, judge):
    from sentence_transformers.util.quantization import quantize_embeddings

    from embedserve.client import decode_multivector

    want = judge.encode_document(DOCUMENTS)
    r = 1.0  # QUANTIZE_RANGE's default
    ranges = np.array([[-r] * 16, [r] * 16], dtype=np.float32)
    for encoding in ("int8", "ubinary"):
        got = decode_multivector(grpc_call(server, "EmbedMultiVector", pb.MultiVectorRequest(
            texts=DOCUMENTS, encoding=pb.Encoding.Value(encoding.upper()))))
        for g, w in zip(got, want):
            expected = quantize_embeddings(w.numpy(), precision=encoding, ranges=ranges)
            # A component within rounding of a level's edge may land on either side.
            assert g.shape == expected.shape and np.abs(g.astype(int) - expected.astype(int)).max() <= 1
        status, body = post(server.http + "/embed_multivector", {"inputs": DOCUMENTS, "encoding": encoding})
        assert status == 200 and [np.asarray(b).shape for b in body] == [g.shape for g in got]


def test_rerank_is_maxsim_on_every_route(server, judge):
    from sentence_transformers.util import maxsim

    want = maxsim(judge.encode_query(QUERIES[:1]), judge.encode_document(DOCUMENTS))[0].numpy()
    order = np.argsort(-want, kind="stable").tolist()
    status, body = post(server.http + "/rerank", {"query": QUERIES[0], "texts": DOCUMENTS})
    assert status == 200, body
    assert [r["index"] for r in body] == order
    assert max(abs(r["score"] - want[r["index"]]) for r in body) <= 1e-4
    status, body = post(server.http + "/v1/rerank", {"query": QUERIES[0], "documents": DOCUMENTS, "top_n": 2})
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == order[:2]
    assert max(abs(r["relevance_score"] - want[r["index"]]) for r in body["results"]) <= 1e-4
    assert body["usage"]["total_tokens"] > 12  # the query's 12 (expanded) and the documents'
    got = grpc_call(server, "Rerank", pb.RerankRequest(query=QUERIES[0], texts=DOCUMENTS))
    assert np.abs(np.array(got.scores) - want).max() <= 1e-4


def test_the_client_embeds_multi_vector(server, judge):
    from embedserve.client import Client

    async def run():
        async with Client(server.target) as client:
            return await client.embed_multivector(QUERIES, is_query=True)

    close(asyncio.run(run()), judge.encode_query(QUERIES))


def test_other_tasks_routes_are_refused_by_name_and_health_names_the_task(server):
    status, body = post(server.http + "/embed", {"inputs": "x"})
    assert status == 400 and "EmbedMultiVector or POST /embed_multivector" in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        grpc_call(server, "Embed", pb.EmbedRequest(texts=["x"]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "multivector" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # an encoding the enum does not name: refused, named
        grpc_call(server, "EmbedMultiVector", pb.MultiVectorRequest(texts=["x"], encoding=99))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "encoding=99" in e.value.details()
    assert server.health()[1]["task"] == "multivector"
    with urllib.request.urlopen(server.metrics + "/metrics", timeout=10) as r:
        assert 'task="multivector"' in r.read().decode()


def test_answers_over_the_reply_bound_are_refused_and_the_server_serves_on(colbert):
    s = ServerProcess({**SERVER_ENV, "MODEL_PATH": colbert, "MAX_REPLY_BYTES": str(2**20),
                       "BATCH_CAPS": "16:4,64:32"}).wait_ready()
    try:
        # 300 texts of 64 tokens: ~19,000 token vectors, 1.2 MB as float32 (more as JSON).
        texts = [f"document {i} " + "about token vectors and their late interaction " * 12 for i in range(300)]
        with pytest.raises(grpc.RpcError) as e:
            grpc_call(s, "EmbedMultiVector", pb.MultiVectorRequest(texts=texts))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "MAX_REPLY_BYTES" in e.value.details()
        status, body = post(s.http + "/embed_multivector", {"inputs": texts})
        assert status == 400 and "MAX_REPLY_BYTES" in body["error"]["message"]
        status, _ = post(s.http + "/embed_multivector", {"inputs": texts[:2]})
        assert status == 200
    finally:
        s.stop()


def test_a_multi_vector_server_refuses_embed_all_naming_its_own_route(server):
    """TEI's /embed_all is an embedding model's (its raw token states): another task's 400."""
    status, body = post(server.http + "/embed_all", {"inputs": "x"})
    assert status == 400 and "/embed_multivector" in body["error"]["message"], body


def test_an_embedding_server_refuses_embed_multi_vector_naming_its_task(default_server):
    with pytest.raises(grpc.RpcError) as e:
        grpc_call(default_server, "EmbedMultiVector", pb.MultiVectorRequest(texts=["x"]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "TASK=embed" in e.value.details()
    status, body = post(default_server.http + "/embed_multivector", {"inputs": "x"})
    assert status == 400 and "TASK=embed" in body["error"]["message"]
