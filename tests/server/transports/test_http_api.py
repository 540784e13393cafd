"""The HTTP JSON API on real processes: the official openai client, TEI-style /embed,
classification on a tiny model built here, schemathesis over the OpenAPI document, overload."""

import base64
import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

import embedserve
from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import decode_embeddings
from tests.conftest import ServerProcess

MODEL_ID = "all-MiniLM-L6-v2"


def post(url, body, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read() or b"null")


@pytest.fixture(scope="module")
def openai_client(default_server):
    import openai

    return openai.OpenAI(base_url=default_server.http + "/v1", api_key="unused", max_retries=0)


def grpc_embed(server, texts):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.target))
    return decode_embeddings(stub.Embed(pb.EmbedRequest(texts=texts)))


def test_openai_client_gets_the_grpc_vectors(default_server, openai_client):
    texts = ["the openai client", "speaks to embedfleet", "over HTTP"]
    reply = openai_client.embeddings.create(model=MODEL_ID, input=texts)
    got = np.array([d.embedding for d in sorted(reply.data, key=lambda d: d.index)], dtype=np.float32)
    assert np.abs(got - grpc_embed(default_server, texts)).max() <= 1e-5
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(texts) * 3
    assert [m.id for m in openai_client.models.list().data] == [MODEL_ID]


def test_base64_and_dimensions(default_server, openai_client):
    text = ["matryoshka dimensions"]
    full = grpc_embed(default_server, text)[0]
    b64 = openai_client.embeddings.create(model=MODEL_ID, input=text, encoding_format="base64")
    raw = b64.data[0].embedding
    vec = np.frombuffer(base64.b64decode(raw), "<f4") if isinstance(raw, str) else np.asarray(raw, np.float32)
    assert np.abs(vec - full).max() <= 1e-5
    small = np.array(openai_client.embeddings.create(model=MODEL_ID, input=text, dimensions=128).data[0].embedding)
    assert small.shape == (128,) and abs(np.linalg.norm(small) - 1) < 1e-5
    assert np.abs(small - full[:128] / np.linalg.norm(full[:128])).max() <= 1e-5


def test_token_id_input_is_the_infer_path(default_server, reference):
    ids = reference.tok("pre-tokenized input")["input_ids"]
    code, _, body = post(default_server.http + "/v1/embeddings", {"model": MODEL_ID, "input": [ids, ids[:3]]})
    assert code == 200 and len(body["data"]) == 2
    assert np.abs(np.array(body["data"][0]["embedding"]) - reference.embed(["pre-tokenized input"])[0]).max() <= 1e-5
    assert body["usage"]["prompt_tokens"] == len(ids) + 3


@pytest.mark.parametrize("body, status, message", [
    ({"model": "other-model", "input": "x"}, 404, "not served here"),
    ({"model": MODEL_ID, "input": ""}, 422, "at least 1 character"),
    ({"model": MODEL_ID, "input": []}, 422, "at least 1 item"),
    ({"model": MODEL_ID, "input": ["ok", "   "]}, 422, "pattern"),
    ({"model": MODEL_ID, "input": [[1, 99999999]]}, 400, "token ids must be in"),
    ({"model": MODEL_ID, "input": "x", "dimensions": 9999}, 400, "exceeds"),
    ({"model": MODEL_ID}, 422, "input"),
])
def test_bad_requests_get_json_errors(default_server, body, status, message):
    code, _, reply = post(default_server.http + "/v1/embeddings", body)
    assert code == status and message in json.dumps(reply)


def test_tei_embed(default_server):
    code, _, body = post(default_server.http + "/embed", {"inputs": ["tei style", "second"]})
    assert code == 200 and np.abs(np.array(body) - grpc_embed(default_server, ["tei style", "second"])).max() <= 1e-5
    code, _, body = post(default_server.http + "/embed", {"inputs": "one", "normalize": False})
    assert code == 422  # a normalizing server's schema only allows normalize: true
    code, _, body = post(default_server.http + "/embed", {"inputs": "word " * 700, "truncate": False})
    assert code == 400 and "longer than 256 tokens" in body["error"]["message"]
    code, _, body = post(default_server.http + "/embed", {"inputs": "word " * 700, "truncate": True})
    assert code == 200 and len(body[0]) == 384
    # Another task's routes: 400 naming this server's own (WrongTask), and none in its OpenAPI document.
    for path in ("/classify", "/rerank", "/v1/rerank", "/embed_sparse"):
        code, _, body = post(default_server.http + path, {"inputs": "not a classifier"})
        assert code == 400 and "use Embed or /v1/embeddings" in body["error"]["message"], (path, body)
    with urllib.request.urlopen(default_server.http + "/openapi.json", timeout=10) as r:
        document = json.load(r)
    assert not {"/classify", "/rerank", "/embed_sparse"} & set(document["paths"])
    assert document["info"]["version"] == embedserve.__version__  # the package's, never a copy of it


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, model_dir):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    out = tmp_path_factory.mktemp("tiny-classifier")
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, num_labels=3,
                        id2label={0: "negative", 1: "neutral", 2: "positive"},
                        label2id={"negative": 0, "neutral": 1, "positive": 2})
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    server = ServerProcess({"MODEL_PATH": str(out), "MAX_DRAIN_TIME_MS": "600000"}).wait_ready()
    yield server, model, tok
    server.stop()


def test_classification_matches_a_direct_forward(classifier):
    import torch

    server, model, tok = classifier
    texts = ["what a great day", "this is terrible", "it is a chair"]
    code, _, body = post(server.http + "/classify", {"inputs": texts, "all_scores": True})
    assert code == 200
    with torch.inference_mode():
        probs = torch.stack([model(**tok(t, return_tensors="pt")).logits.softmax(-1)[0] for t in texts]).numpy()
    for row, expected in zip(body, probs):
        assert row["label"] == model.config.id2label[int(expected.argmax())]
        assert abs(row["score"] - expected.max()) <= 1e-5
        assert np.abs(np.array([row["scores"][model.config.id2label[i]] for i in range(3)]) - expected).max() <= 1e-5
    code, _, body = post(server.http + "/classify", {"inputs": "single"})
    assert code == 200 and body[0]["scores"] is None
    for path in ("/embed", "/v1/embeddings", "/rerank"):  # another task's: 400 naming /classify
        code, _, body = post(server.http + path, {"inputs": "x"})
        assert code == 400 and "use POST /classify" in body["error"]["message"], (path, body)
    code, _, body = post(server.http + "/tokenize", {"inputs": "single"})  # every task's
    assert code == 200 and body[0][0]["special"]


def test_overload_over_http_is_429_with_retry_after():
    server = ServerProcess({"MODEL_PATH": "sim:300", "MAX_DRAIN_TIME_MS": "50",
                            "BATCH_CAPS": "16:1,32:1,64:1,128:1,256:1,512:1"}).wait_ready()
    try:
        import concurrent.futures

        body = {"model": "sim:300", "input": "a text of some length to fill the queue quickly"}
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda _: post(server.http + "/v1/embeddings", body), range(32)))
        codes = {code for code, _, _ in replies}
        assert codes <= {200, 429} and 429 in codes
        for code, headers, reply in replies:
            if code == 429:
                assert int(headers["Retry-After"]) >= 1 and reply["error"]["type"] == "rate_limit_error"
    finally:
        server.stop()


def test_openapi_schemathesis_finds_no_server_errors(default_server):
    """A bounded property-based run over the OpenAPI document: no 5xx, responses as documented."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(default_server.http + "/openapi.json")
    for path, method in (("/v1/embeddings", "POST"), ("/embed", "POST"), ("/v1/models", "GET")):
        operation = schema[path][method]

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=operation.as_strategy())
        def run(case):
            case.call_and_validate()  # raises on a 5xx, an undocumented status or a schema violation

        run()
