"""A BGE-M3 server (TASK=auto reads its sparse_linear.pt and colbert_linear.pt as bgem3) end to end, in
one process and with FRONTENDS=2: one Embed call over real gRPC (our Client) answering dense,
sparse and ColBERT outputs of one pass, each alone, and dense by default; the same over HTTP
(/embed, /v1/embeddings with `outputs`, /embed_sparse in TEI's shape); every output against
FlagEmbedding's formulas (tests/server/model/m3_models.reference) within 1e-4, lexical weights by
token id. An embedding server refuses outputs other than dense (INVALID_ARGUMENT; HTTP: its schema's 422)."""

import asyncio
import json

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import Client
from tests.conftest import ServerProcess, post_json
from tests.server.model.m3_models import build_m3, reference

TOL = 1e-4
TEXTS = ["the quick brown fox jumps over the lazy dog", "a",
         "Sparse retrieval weighs each token of the text; dense retrieval pools them. " * 3]
# TASK=auto reads the head files as bgem3; FRONTENDS=2 says it explicitly.
MODES = {"one process, TASK=auto": {}, "FRONTENDS=2": {"FRONTENDS": "2", "TASK": "bgem3"}}


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory) -> str:
    return build_m3(tmp_path_factory.mktemp("m3"))


@pytest.fixture(scope="module")
def want(m3_dir) -> dict:
    return reference(m3_dir, TEXTS)


@pytest.fixture(scope="module", params=list(MODES), ids=list(MODES))
def m3_server(request, m3_dir):
    server = ServerProcess({"MODEL_PATH": m3_dir, "MAX_DRAIN_TIME_MS": "600000", **MODES[request.param]}).wait_ready()
    yield server
    server.stop()


def post(server, path: str, body) -> tuple[int, object]:
    return post_json(server.http + path, body)


def same_dense(got, want) -> float:
    diff = float(np.abs(np.asarray(got, dtype=np.float32) - want["dense_vecs"]).max())
    assert diff <= TOL
    return diff


def same_sparse(rows, want) -> float:
    """Per text (ids, weights): the reference's token ids exactly, weights within TOL."""
    worst = 0.0
    for (ids, values), lexical in zip(rows, want["lexical_weights"]):
        got = dict(zip(map(str, np.asarray(ids).tolist()), np.asarray(values, dtype=np.float64).tolist()))
        assert got.keys() == lexical.keys()
        worst = max([worst, *(abs(got[k] - float(w)) for k, w in lexical.items())])
    assert worst <= TOL and sum(map(len, want["lexical_weights"])) > len(TEXTS)
    return worst


def same_colbert(rows, want) -> float:
    worst = 0.0
    for got, vecs in zip(rows, want["colbert_vecs"]):
        got = np.asarray(got, dtype=np.float32)
        assert got.shape == vecs.shape
        worst = max(worst, float(np.abs(got - vecs).max()))
    assert worst <= TOL
    return worst


def test_one_embed_call_answers_all_three_outputs_equal_to_flagembedding(m3_server, want):
    async def go():
        async with Client(m3_server.target) as c:
            return await c.embed_m3(TEXTS), await c.embed_m3(TEXTS, outputs=["sparse"]), \
                await c.embed_m3(TEXTS, outputs=["colbert"]), await c.embed(TEXTS)

    both, sparse, colbert, dense = asyncio.run(go())
    print("gRPC max abs diff: dense %.2g, sparse %.2g, colbert %.2g" % (
        same_dense(both.dense, want), same_sparse(both.sparse, want), same_colbert(both.colbert, want)))
    assert sparse.dense is None and sparse.colbert is None
    same_sparse(sparse.sparse, want)
    assert colbert.dense is None and colbert.sparse is None
    same_colbert(colbert.colbert, want)
    same_dense(dense, want)  # no outputs: the dense vector, as any embedding model answers


def test_requests_asking_different_outputs_together_each_get_their_own(m3_server, want):
    """Dense-only embeddings calls beside calls asking every output, at once (rows of both in
    the same batches): each answer holds what its request asked, equal to the reference; the
    rows' outputs are told apart on the device by flags on their first ids."""
    asks = [None, ["dense", "sparse", "colbert"], ["colbert"], None, ["sparse"]] * 4

    async def go():
        async with Client(m3_server.target) as c:
            return await asyncio.gather(*(c.embed(TEXTS) if a is None else c.embed_m3(TEXTS, outputs=a) for a in asks))

    health = m3_server.health()[1]
    assert health["task"] == "bgem3" or health["models"][0]["task"] == "bgem3", health
    for asked, got in zip(asks, asyncio.run(go())):
        if asked is None:
            same_dense(got, want)
            continue
        assert (got.dense is not None) == ("dense" in asked) and (got.sparse is not None) == ("sparse" in asked)
        if "sparse" in asked:
            same_sparse(got.sparse, want)
        if "colbert" in asked:
            same_colbert(got.colbert, want)


def test_embed_response_carries_only_what_was_asked(m3_server, want):
    with grpc.insecure_channel(m3_server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        only_sparse = stub.Embed(pb.EmbedRequest(texts=TEXTS, outputs=[pb.SPARSE]))
        assert not only_sparse.embeddings and not only_sparse.HasField("multivector")
        assert list(only_sparse.sparse.offsets)[-1] == len(np.frombuffer(only_sparse.sparse.indices, "<i4"))
        assert only_sparse.sparse.dimension > 4  # the vocabulary
        default = stub.Embed(pb.EmbedRequest(texts=TEXTS))
        assert not default.HasField("sparse") and not default.HasField("multivector")
        # ColBERT vectors quantize as dense rows do: ubinary packs each one's signs
        packed = stub.Embed(pb.EmbedRequest(texts=TEXTS, outputs=[pb.MULTIVECTOR], encoding=pb.UBINARY))
        bits = np.frombuffer(packed.multivector.quantized, dtype=np.uint8).reshape(-1, 4)
        assert np.array_equal(bits, np.packbits(np.concatenate(want["colbert_vecs"]) > 0, axis=-1))
        # the sparse RPC answers a bgem3 model's lexical weights
        csr = stub.EmbedSparse(pb.EmbedRequest(texts=TEXTS))
        bounds = list(csr.offsets)
        ids, values = np.frombuffer(csr.indices, "<i4"), np.frombuffer(csr.values, "<f4")
        same_sparse([(ids[a:b], values[a:b]) for a, b in zip(bounds, bounds[1:])], want)
        with pytest.raises(grpc.RpcError) as e:
            stub.Embed(pb.EmbedRequest(texts=TEXTS, outputs=[7]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Output" in e.value.details()


def test_http_routes_answer_the_asked_outputs(m3_server, m3_dir, want):
    status, rows = post(m3_server, "/embed", {"inputs": TEXTS, "outputs": ["dense", "sparse", "colbert"]})
    assert status == 200, rows
    print("HTTP max abs diff: dense %.2g, sparse %.2g, colbert %.2g" % (
        same_dense([r["dense"] for r in rows], want),
        same_sparse([([e["index"] for e in r["sparse"]], [e["value"] for e in r["sparse"]]) for r in rows], want),
        same_colbert([r["colbert"] for r in rows], want)))
    status, rows = post(m3_server, "/embed", {"inputs": TEXTS})  # default: TEI's list of vectors
    assert status == 200 and isinstance(rows[0], list)
    same_dense(rows, want)
    status, rows = post(m3_server, "/embed", {"inputs": TEXTS[0], "outputs": ["colbert"]})
    assert status == 200 and set(rows[0]) == {"colbert"}
    same_colbert([rows[0]["colbert"]], {"colbert_vecs": want["colbert_vecs"][:1]})

    status, body = post(m3_server, "/v1/embeddings", {"input": TEXTS, "model": "bge-m3-tiny", "outputs": ["sparse", "dense"]})
    assert status == 200, body
    data = body["data"]
    assert [d["index"] for d in data] == [0, 1, 2] and all(d["object"] == "embedding" for d in data)
    same_dense([d["embedding"] for d in data], want)
    same_sparse([([e["index"] for e in d["sparse"]], [e["value"] for e in d["sparse"]]) for d in data], want)
    status, body = post(m3_server, "/v1/embeddings", {"input": TEXTS, "model": "bge-m3-tiny"})  # an OpenAI client's call
    assert status == 200 and set(body["data"][0]) == {"object", "index", "embedding"}
    same_dense([d["embedding"] for d in body["data"]], want)

    # Token ids (the OpenAI shape): the asked outputs too, flagged by the server once the ids are checked
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(m3_dir)(t)["input_ids"] for t in TEXTS]
    status, body = post(m3_server, "/v1/embeddings", {"input": ids, "model": "bge-m3-tiny", "outputs": ["sparse", "colbert"]})
    assert status == 200, body
    same_sparse([([e["index"] for e in d["sparse"]], [e["value"] for e in d["sparse"]]) for d in body["data"]], want)
    same_colbert([d["colbert"] for d in body["data"]], want)
    # TEI's raw token states are an embed model's: refused, naming the task, never an empty 200
    status, body = post(m3_server, "/embed_all", {"inputs": TEXTS})
    assert status == 400 and "bgem3" in body["error"]["message"], body

    status, rows = post(m3_server, "/embed_sparse", {"inputs": TEXTS})  # TEI's sparse shape
    assert status == 200
    same_sparse([([e["index"] for e in r], [e["value"] for e in r]) for r in rows], want)
    status, body = post(m3_server, "/embed", {"inputs": TEXTS, "outputs": ["tokens"]})
    assert status == 422
    status, health = m3_server.health()
    assert health["task"] == "bgem3" or health["models"][0]["task"] == "bgem3", health


def test_an_embedding_model_refuses_other_outputs(default_server):
    with grpc.insecure_channel(default_server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Embed(pb.EmbedRequest(texts=["x"], outputs=[pb.DENSE, pb.MULTIVECTOR]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "TASK=bgem3" in e.value.details()
        assert stub.Embed(pb.EmbedRequest(texts=["x"], outputs=[pb.DENSE])).shape[0] == 1
    status, body = post(default_server, "/embed", {"inputs": "x", "outputs": ["sparse"]})
    assert status == 422 and "outputs" in json.dumps(body)  # its schema says dense only
    name = default_server.health()[1]["models"][0]["name"]
    status, body = post(default_server, "/v1/embeddings", {"input": "x", "model": name, "outputs": ["dense"]})
    assert status == 200 and len(body["data"]) == 1


def test_the_client_names_an_unknown_output_before_any_call():
    async def go():
        async with Client("127.0.0.1:1") as c:  # nothing listens: the check comes first
            with pytest.raises(ValueError, match="'tokens'.*dense, sparse, colbert"):
                await c.embed_m3(["x"], outputs=["tokens"])

    asyncio.run(go())
