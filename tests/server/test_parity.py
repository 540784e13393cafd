"""Each model served as its authors declared it: our vectors against
`SentenceTransformer(model).encode(texts)`, the ecosystem's reference, over real gRPC and HTTP.
The packaged all-MiniLM-L6-v2 as shipped, and variants built from its weights and saved by
sentence-transformers itself (CLS pooling without Normalize, max pooling, several modes with a
Dense layer, prompts), on texts that include ones longer than max_seq_length."""

import json
import urllib.request

import grpc
import numpy as np
import pytest
import torch

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import decode_embeddings
from tests.conftest import ServerProcess, make_text

TOL = 1e-4
CAPS = "16:4,32:4,64:4,128:2,256:2,512:1"
PROMPTS = {"query": "query: ", "passage": "passage: "}


@pytest.fixture(scope="module")
def texts():
    rng = np.random.default_rng(5)
    # short, medium, and past max_seq_length (128 and 256 in the variants below)
    return [make_text(rng, n) for n in (1, 9, 40, 150, 400)]


def variant(model_dir, out, pooling, dense=False, normalize=True, max_seq_length=256, prompts=None, default=None):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    modules = [Transformer(model_dir, max_seq_length=max_seq_length), Pooling(384, pooling_mode=pooling)]
    width = 384 * (len(pooling) if isinstance(pooling, tuple) else 1)
    if dense:
        torch.manual_seed(0)
        modules.append(Dense(width, 128, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, prompts=prompts, default_prompt_name=default).save(str(out))
    return str(out)


VARIANTS = ["packaged", "cls-no-normalize", "max", "cls+mean-dense", "prompts", "packed"]
# Packed rows on CPU (the reference attention; every other part is what a GPU runs), streams
# padded to the token ladder as with CUDA graphs, batches mixing lengths up to a small budget.
PACKED = {"ATTENTION": "packed", "STATIC_SHAPES": "true", "MAX_TOKENS_PER_BATCH": "1024"}


@pytest.fixture(scope="module")
def dense_variant(model_dir, tmp_path_factory):
    """CLS and mean pooling under a Dense layer: one directory, served padded and packed."""
    return variant(model_dir, tmp_path_factory.mktemp("cls+mean-dense"), ("cls", "mean"), dense=True)


@pytest.fixture(scope="module")
def served(request, model_dir, tmp_path_factory):
    """(server, the reference SentenceTransformer loaded from the same directory)."""
    from sentence_transformers import SentenceTransformer

    if request.param == "packaged":
        # The packaged model as shipped is the session's default server: the test's texts (two
        # rows of bucket 16, one of 64, two of 256) batch alike under its caps and CAPS.
        server = request.getfixturevalue("default_server")
        assert server.health()[1]["attention"] == "padded"
        yield server, SentenceTransformer(model_dir, device="cpu")
        return
    out = tmp_path_factory.mktemp(request.param)
    path = {
        "cls-no-normalize": lambda: variant(model_dir, out, "cls", normalize=False, max_seq_length=128),
        "max": lambda: variant(model_dir, out, "max"),
        "cls+mean-dense": lambda: request.getfixturevalue("dense_variant"),
        "prompts": lambda: variant(model_dir, out, "weightedmean", prompts=PROMPTS, default="query"),
        "packed": lambda: request.getfixturevalue("dense_variant"),
    }[request.param]()
    env = PACKED if request.param == "packed" else {}
    server = ServerProcess({"MODEL_PATH": path, "BATCH_CAPS": CAPS, "MAX_DRAIN_TIME_MS": "600000", **env}).wait_ready()
    assert server.health()[1]["attention"] == ("packed" if env else "padded")
    yield server, SentenceTransformer(path, device="cpu")
    server.stop()


def embed(server, texts, prompt_name=""):
    with grpc.insecure_channel(server.target) as channel:
        return decode_embeddings(pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=texts, prompt_name=prompt_name)))


@pytest.mark.parametrize("served", VARIANTS, indirect=True)
def test_vectors_are_sentence_transformers_own(served, texts):
    server, reference = served
    out = embed(server, texts)
    expected = reference.encode(texts, convert_to_numpy=True)
    assert out.shape == expected.shape
    assert np.abs(out - expected).max() <= TOL
    health = server.health()[1]
    assert health["max_length"] == reference.max_seq_length  # reported as served
    assert health["normalize"] == any(type(m).__name__ == "Normalize" for m in reference)


@pytest.mark.parametrize("served", ["prompts"], indirect=True)
def test_prompts_by_name_and_by_default(served, texts):
    server, reference = served
    assert np.abs(embed(server, texts, "passage") - reference.encode(texts, prompt_name="passage")).max() <= TOL
    default = embed(server, texts)
    assert np.abs(default - reference.encode(texts)).max() <= TOL  # the declared default: "query: "
    assert np.abs(default - embed(server, texts, "query")).max() <= 1e-6
    with pytest.raises(grpc.RpcError) as e:
        embed(server, texts, "document-x")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown prompt_name 'document-x'" in e.value.details() and "passage, query" in e.value.details()
    health = server.health()[1]
    assert (health["prompts"], health["default_prompt_name"]) == (["document", "passage", "query"], "query")


@pytest.mark.parametrize("served", ["prompts"], indirect=True)
def test_prompts_over_http_and_their_tokens_are_counted(served, texts):
    server, reference = served

    def post(path, body):
        req = urllib.request.Request(server.http + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    tei = np.array(post("/embed", {"inputs": texts[:2], "prompt_name": "passage"}))
    assert np.abs(tei - reference.encode(texts[:2], prompt_name="passage")).max() <= TOL
    name = server.health()[1]["model"].rstrip("/").split("/")[-1]  # a directory serves as its last name
    openai = post("/v1/embeddings", {"model": name, "input": texts[:2], "prompt_name": "passage"})
    vectors = np.array([d["embedding"] for d in openai["data"]])
    assert np.abs(vectors - reference.encode(texts[:2], prompt_name="passage")).max() <= TOL
    with_prompt = sum(len(reference.tokenize(["passage: " + t])["input_ids"][0]) for t in texts[:2])
    assert openai["usage"]["prompt_tokens"] == with_prompt
