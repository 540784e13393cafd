"""A sparse (SPLADE) server end to end, in one process and with FRONTENDS=2: POST /embed_sparse and
TEI's POST / over real HTTP, EmbedSparse over real gRPC (our Client), against
sentence-transformers' SparseEncoder on the same directory (same non-zeros, values within 1e-4,
the declared prompt included); the dense routes refused with WrongTask, and an embed server
refusing EmbedSparse."""

import json

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import Client
from tests.conftest import ServerProcess, post_json
from tests.server.model.sparse_models import build_splade

TOL = 1e-4
PROMPTS = {"query": "query: ", "document": ""}
TEXTS = ["sparse retrieval", "x", "a longer passage about lexical expansion, inverted indexes and hybrid search " * 3]
MODES = {"one process": {}, "FRONTENDS=2": {"FRONTENDS": "2"}}


@pytest.fixture(scope="module")
def splade_dir(tmp_path_factory, model_dir) -> str:
    return build_splade(tmp_path_factory.mktemp("splade"), model_dir, prompts=PROMPTS)


@pytest.fixture(scope="module")
def judge(splade_dir):
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(splade_dir, device="cpu")

    def encode(texts, prompt_name=None) -> np.ndarray:
        return model.encode(texts, prompt_name=prompt_name, convert_to_tensor=True).to_dense().numpy()

    return encode


@pytest.fixture(scope="module", params=list(MODES), ids=list(MODES))
def sparse_server(request, splade_dir):
    server = ServerProcess({"MODEL_PATH": splade_dir, "MAX_DRAIN_TIME_MS": "600000", **MODES[request.param]}).wait_ready()
    yield server
    server.stop()


def post(server, path: str, body) -> tuple[int, object]:
    return post_json(server.http + path, body)


def assert_same(indices: np.ndarray, values: np.ndarray, want: np.ndarray) -> None:
    """One row: the judge's non-zeros, ascending, and their values within TOL."""
    assert np.array_equal(indices, np.flatnonzero(want))
    assert np.abs(values - want[indices]).max() <= TOL


def test_embed_sparse_over_http_equals_sparse_encoder(sparse_server, judge):
    status, rows = post(sparse_server, "/embed_sparse", {"inputs": TEXTS, "prompt_name": "query"})
    assert status == 200, rows
    want = judge(TEXTS, prompt_name="query")
    assert len(rows) == len(TEXTS)
    for row, w in zip(rows, want):
        assert_same(np.array([e["index"] for e in row]), np.array([e["value"] for e in row]), w)
    # the prompt really was put before each text
    assert not np.array_equal(want != 0, judge(TEXTS) != 0)
    # TEI's root route takes the same shape; one text answers a list of one
    status, rows = post(sparse_server, "/", {"inputs": TEXTS[0], "truncate": True})
    assert status == 200 and len(rows) == 1
    assert_same(np.array([e["index"] for e in rows[0]]), np.array([e["value"] for e in rows[0]]), judge(TEXTS[:1])[0])


async def test_embed_sparse_over_grpc_equals_sparse_encoder(sparse_server, judge):
    async with Client(sparse_server.target, timeout_s=60) as client:
        rows = await client.embed_sparse(TEXTS)
        prompted = await client.embed_sparse(TEXTS[:1], prompt_name="query")
    for (indices, values), w in zip(rows, judge(TEXTS)):
        assert indices.dtype == np.int32 and values.dtype == np.float32
        assert_same(indices, values, w)
    assert_same(*prompted[0], judge(TEXTS[:1], prompt_name="query")[0])
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(sparse_server.target))
    response = stub.EmbedSparse(pb.EmbedRequest(texts=TEXTS[:2]))
    assert response.dimension == judge(TEXTS[:1]).shape[1] and len(response.offsets) == 3


def test_a_sparse_server_refuses_dense_calls_and_bad_input_naming_why(sparse_server):
    status, body = post(sparse_server, "/v1/embeddings", {"input": "x", "model": "m"})
    assert status == 400 and "EmbedSparse or POST /embed_sparse" in body["error"]["message"]
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(sparse_server.target))
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(pb.EmbedRequest(texts=["x"]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "does sparse" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.EmbedSparse(pb.EmbedRequest(texts=["x"], dimensions=8))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dimensions" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.EmbedSparse(pb.EmbedRequest(texts=[" "]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "texts[0]" in e.value.details()
    status, body = post(sparse_server, "/embed_sparse", {"inputs": ["x"], "prompt_name": "nope"})
    assert status == 400 and "unknown prompt_name 'nope'; this model's prompts: document, query" in body["error"]["message"]
    status, body = post(sparse_server, "/embed_sparse", {"inputs": []})
    assert status == 422 and "inputs" in json.dumps(body)
    status, _ = post(sparse_server, "/embed_sparse", {"inputs": ["still serving"]})
    assert status == 200


def test_an_embed_server_refuses_embed_sparse(default_server):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(default_server.target))
    with pytest.raises(grpc.RpcError) as e:
        stub.EmbedSparse(pb.EmbedRequest(texts=["x"]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Embed or /v1/embeddings" in e.value.details()


def test_the_http_answer_is_the_json_of_every_entry():
    import json

    from embedserve.model.sparse_rows import to_csr
    from embedserve.transports.http_sparse import sparse_json

    rng = np.random.default_rng(2)
    dense = np.where(rng.random((4, 60)) < 0.2, rng.random((4, 60)), 0).astype(np.float32)
    dense[1] = 0
    got = json.loads(sparse_json(to_csr(dense)))
    want = [[{"index": int(k), "value": float(dense[i, k])} for k in np.flatnonzero(dense[i])] for i in range(4)]
    assert got == want and got[1] == []
