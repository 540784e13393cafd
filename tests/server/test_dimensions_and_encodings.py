"""Matryoshka dimensions and output encodings on every surface, end to end, against
sentence-transformers: gRPC Embed and Infer (through embedserve.client.Client), HTTP /embed and
/v1/embeddings (the openai client, raw JSON for our quantized extension). Quantized bytes are
judged by `quantize_embeddings(st_vectors, precision, ranges=[[-r] * d, [r] * d])`.

A second server serves a copy of the packaged model that declares truncate_dim 128 and a prompt,
with QUANTIZE_RANGE=0.5, in front ends (FRONTENDS=2): the declared default, /health and
embedfleet_model_info, and /tokenize with the prompt there."""

import asyncio
import base64
import json
import shutil
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from sentence_transformers.util import quantize_embeddings

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import Client
from tests.conftest import ServerProcess
from tests.server.transports.test_http_api import MODEL_ID, post
from tests.server.transports.test_http_tei import hf_tokens

TEXTS = ["Matryoshka embeddings keep their meaning when cut short.", "A second text, a little longer than the first one.",
         "short", "vectors quantized to bytes and bits"]
PRECISIONS = ("int8", "uint8", "binary", "ubinary")


def st_vectors(st, texts, dims=None, prompt_name=None):
    """What a sentence-transformers user computes: its encode, truncated, then normalized."""
    return st.encode(list(texts), truncate_dim=dims, normalize_embeddings=True, prompt_name=prompt_name,
                     convert_to_numpy=True)


def judge(vectors: np.ndarray, precision: str, r: float) -> np.ndarray:
    d = vectors.shape[1]
    return quantize_embeddings(vectors, precision, ranges=np.array([[-r] * d, [r] * d]))


def assert_same_quantized(ours: np.ndarray, vectors: np.ndarray, precision: str, r: float) -> None:
    """Ours equals the judge's bytes. Our floats and sentence-transformers' differ in the last bits
    (~1e-8), so a component lying within 1e-6 of a level's edge (or of 0, for bits) could fall
    either side: such components are left out, and counted."""
    expected = judge(vectors, precision, r)
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    if precision.endswith("int8"):
        position = (vectors.astype(np.float64) + r) / (2 * r / 255)
        edge = np.abs(position - np.round(position)) < 1e-6 * 255 / (2 * r)
        ours_v, expected_v = ours, expected
    else:
        edge = np.abs(vectors) < 1e-6
        width = vectors.shape[1]
        ours_v = np.unpackbits(ours.view(np.uint8) ^ (0x80 if precision == "binary" else 0), axis=1)[:, :width]
        expected_v = np.unpackbits(expected.view(np.uint8) ^ (0x80 if precision == "binary" else 0), axis=1)[:, :width]
    # all-MiniLM-L6-v2 has three dead dimensions (127, 223, 319: ~1e-33 or ~1e-8 in every vector),
    # whose sign is noise: up to 3 per row, and one more for a level's edge.
    assert edge.sum() <= 4 * len(vectors), f"{edge.sum()} components on a level's edge: pick other texts"
    assert np.array_equal(ours_v[~edge], expected_v[~edge])
    if not edge.any():
        assert ours.tobytes() == expected.tobytes()


def run(coro):
    return asyncio.run(coro)


async def client_embed(target, texts, **kw):
    async with Client(target, timeout_s=60) as client:
        return await client.embed(texts, **kw)


@pytest.mark.parametrize("dims", [0, 384, 128, 7])
def test_grpc_embed_dimensions(default_server, reference, dims):
    got = run(client_embed(default_server.target, TEXTS, dimensions=dims))
    expected = st_vectors(reference.st, TEXTS, dims or None)
    assert got.dtype == np.float32 and got.shape == (len(TEXTS), dims or 384)
    assert np.abs(got - expected).max() <= 1e-5


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("dims", [0, 100])
def test_grpc_embed_quantized(default_server, reference, precision, dims):
    got = run(client_embed(default_server.target, TEXTS, dimensions=dims, encoding=precision))
    assert_same_quantized(got, st_vectors(reference.st, TEXTS, dims or None), precision, 1.0)
    floats = run(client_embed(default_server.target, TEXTS, dimensions=dims))
    from embedserve.transports.encodings import quantize
    assert got.tobytes() == quantize(floats, precision, 1.0).tobytes()  # the same rows, then quantized


def test_grpc_infer_dimensions_and_encoding(default_server, reference):
    enc = reference.tok(TEXTS, padding=True, truncation=True, max_length=256, return_tensors="np")
    ids, mask = enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)

    async def calls():
        async with Client(default_server.target, timeout_s=60) as client:
            return await client.infer(ids, mask, dimensions=64), await client.infer(ids, mask, 64, "ubinary")

    floats, bits = run(calls())
    expected = st_vectors(reference.st, TEXTS, 64)
    assert floats.shape == (4, 64) and np.abs(floats - expected).max() <= 1e-5
    assert bits.shape == (4, 8) and bits.dtype == np.uint8
    assert_same_quantized(bits, expected, "ubinary", 1.0)


@pytest.mark.parametrize("request_fields, names", [
    ({"dimensions": 385}, "dimensions=385 exceeds the model's 384"),
    ({"dimensions": -3}, "dimensions=-3"),
    ({"encoding": 9}, "encoding=9 is not an Encoding"),
])
def test_grpc_bad_dimensions_or_encoding(default_server, request_fields, names):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(default_server.target))
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(pb.EmbedRequest(texts=["x"], **request_fields), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and names in e.value.details()
    assert stub.Embed(pb.EmbedRequest(texts=["still serving"]), timeout=60).shape == [1, 384]


def test_grpc_truncate_field(default_server):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(default_server.target))
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(pb.EmbedRequest(texts=["word " * 700], truncate=False), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncation is off" in e.value.details()
    assert stub.Embed(pb.EmbedRequest(texts=["word " * 700], truncate=True), timeout=60).shape == [1, 384]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_http_embed_encodings(default_server, reference, precision):
    code, _, body = post(default_server.http + "/embed", {"inputs": TEXTS, "dimensions": 100, "encoding": precision})
    assert code == 200 and all(isinstance(v, int) for row in body for v in row)
    expected = st_vectors(reference.st, TEXTS, 100)
    dtype = judge(expected, precision, 1.0).dtype
    assert_same_quantized(np.array(body, dtype=dtype), expected, precision, 1.0)


def test_http_embed_float_and_base64(default_server, reference):
    expected = st_vectors(reference.st, TEXTS, 128)
    code, _, floats = post(default_server.http + "/embed", {"inputs": TEXTS, "dimensions": 128})
    assert code == 200 and np.abs(np.array(floats) - expected).max() <= 1e-5
    code, _, b64 = post(default_server.http + "/embed", {"inputs": TEXTS, "dimensions": 128, "encoding": "base64"})
    decoded = np.stack([np.frombuffer(base64.b64decode(s), "<f4") for s in b64])
    assert code == 200 and np.array_equal(decoded, np.array(floats, dtype=np.float32))


def test_openai_client_base64_and_dimensions(default_server, reference):
    import openai

    client = openai.OpenAI(base_url=default_server.http + "/v1", api_key="unused", max_retries=0)
    for dims in (None, 128, 16):
        for fmt in ("float", "base64"):  # the openai client decodes base64 itself
            kw = {} if dims is None else {"dimensions": dims}
            reply = client.embeddings.create(model=MODEL_ID, input=TEXTS, encoding_format=fmt, **kw)
            rows = [d.embedding for d in sorted(reply.data, key=lambda d: d.index)]
            # Asked for base64 by name, the client hands the strings back as they came.
            got = np.stack([np.frombuffer(base64.b64decode(r), "<f4") if isinstance(r, str) else np.array(r, np.float32)
                            for r in rows])
            assert np.abs(got - st_vectors(reference.st, TEXTS, dims)).max() <= 1e-5, (dims, fmt)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_openai_route_quantized_extension(default_server, reference, precision):
    code, _, body = post(default_server.http + "/v1/embeddings",
                         {"model": MODEL_ID, "input": TEXTS, "encoding_format": precision, "dimensions": 64})
    assert code == 200
    rows = [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]
    expected = st_vectors(reference.st, TEXTS, 64)
    assert_same_quantized(np.array(rows, dtype=judge(expected, precision, 1.0).dtype), expected, precision, 1.0)


@pytest.mark.parametrize("path, body, status, names", [
    ("/embed", {"inputs": "x", "dimensions": 385}, 400, "dimensions=385 exceeds the model's 384"),
    ("/v1/embeddings", {"model": MODEL_ID, "input": "x", "dimensions": 385}, 400, "dimensions=385 exceeds the model's 384"),
    ("/embed", {"inputs": "x", "dimensions": 0}, 422, "dimensions"),
    ("/embed", {"inputs": "x", "dimensions": -1}, 422, "dimensions"),
    ("/v1/embeddings", {"model": MODEL_ID, "input": "x", "dimensions": 0}, 422, "dimensions"),
    ("/embed", {"inputs": "x", "encoding": "int4"}, 422, "encoding"),
    ("/v1/embeddings", {"model": MODEL_ID, "input": "x", "encoding_format": "int4"}, 422, "encoding_format"),
])
def test_http_bad_dimensions_or_encoding(default_server, path, body, status, names):
    code, _, reply = post(default_server.http + path, body)
    assert code == status and names in json.dumps(reply), reply


def test_health_states_the_quantize_range(default_server):
    code, health = default_server.health()
    assert code == 200 and health["quantize_range"] == 1.0
    assert health["embedding_dimension"] == health["model_dimension"] == 384 and health["truncate_dim"] == 0

    async def grpc_health():
        async with Client(default_server.target) as client:
            return await client.health()

    assert run(grpc_health()).quantize_range == 1.0


# -- A model that declares truncate_dim and a prompt, served by front ends ---------------------

DECLARED_DIM, PROMPTS, RANGE = 128, {"query": "query: ", "passage": "passage: "}, 0.5


@pytest.fixture(scope="module")
def matryoshka(tmp_path_factory, model_dir):
    """The packaged model's files, its config_sentence_transformers.json stating truncate_dim and
    prompts (default: query), served with FRONTENDS=2 and QUANTIZE_RANGE=0.5."""
    from sentence_transformers import SentenceTransformer

    out = tmp_path_factory.mktemp("matryoshka")
    for f in Path(model_dir).iterdir():
        (out / f.name).symlink_to(f) if f.is_file() else shutil.copytree(f, out / f.name)
    (out / "config_sentence_transformers.json").unlink()
    (out / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": PROMPTS, "default_prompt_name": "query", "truncate_dim": DECLARED_DIM}))
    server = ServerProcess({"MODEL_PATH": str(out), "FRONTENDS": "2", "QUANTIZE_RANGE": str(RANGE),
                            "MAX_DRAIN_TIME_MS": "600000"}).wait_ready()
    # What a sentence-transformers user runs: truncate_dim is given to the constructor (it is not saved).
    yield server, SentenceTransformer(str(out), device="cpu", truncate_dim=DECLARED_DIM)
    server.stop()


def test_declared_truncate_dim_is_the_default_in_front_ends(matryoshka):
    server, st = matryoshka
    expected = st.encode(TEXTS, normalize_embeddings=True)  # its default prompt (query) and truncate_dim
    assert expected.shape == (4, DECLARED_DIM)
    got = run(client_embed(server.target, TEXTS))
    assert got.shape == (4, DECLARED_DIM) and np.abs(got - expected).max() <= 1e-5
    code, _, body = post(server.http + "/embed", {"inputs": TEXTS})
    assert code == 200 and np.abs(np.array(body) - expected).max() <= 1e-5
    full = st.encode(TEXTS, normalize_embeddings=True, truncate_dim=384, prompt_name="passage")
    got = run(client_embed(server.target, TEXTS, dimensions=384, prompt_name="passage"))
    assert got.shape == (4, 384) and np.abs(got - full).max() <= 1e-5  # more than declared: up to the model's


@pytest.mark.parametrize("precision", PRECISIONS)
def test_quantize_range_in_front_ends(matryoshka, precision):
    server, st = matryoshka
    expected = st.encode(TEXTS, normalize_embeddings=True)
    got = run(client_embed(server.target, TEXTS, encoding=precision))
    assert_same_quantized(got, expected, precision, RANGE)
    code, _, body = post(server.http + "/embed", {"inputs": TEXTS, "encoding": precision})
    assert code == 200 and np.array(body, dtype=got.dtype).tobytes() == got.tobytes()


def test_health_and_model_info_show_the_served_dimension(matryoshka):
    server, _ = matryoshka
    code, health = server.health()
    assert code == 200 and health["embedding_dimension"] == DECLARED_DIM and health["model_dimension"] == 384
    assert health["truncate_dim"] == DECLARED_DIM and health["quantize_range"] == RANGE

    async def grpc_health():
        async with Client(server.target) as client:
            return await client.health()

    reply = run(grpc_health())
    assert reply.embedding_dimension == DECLARED_DIM and reply.quantize_range == RANGE
    with urllib.request.urlopen(server.http + "/metrics", timeout=10) as r:
        info = next(line for line in r.read().decode().splitlines() if line.startswith("embedfleet_model_info{"))
    assert f'dimension="{DECLARED_DIM}"' in info and f'truncate_dim="{DECLARED_DIM}"' in info


def test_tokenize_and_decode_in_front_ends_with_the_prompt(matryoshka, reference):
    server, st = matryoshka
    for name, prompt in (("query", "query: "), (None, "query: "), ("passage", "passage: ")):
        code, _, body = post(server.http + "/tokenize", {"inputs": TEXTS, "prompt_name": name})
        assert code == 200 and body == [hf_tokens(reference.tok, prompt + t) for t in TEXTS], name
        # What the model reads is what sentence-transformers feeds it.
        features = st.tokenize([prompt + t for t in TEXTS])
        for row, ids, mask in zip(body, features["input_ids"].tolist(), features["attention_mask"].tolist()):
            assert [t["id"] for t in row] == [i for i, m in zip(ids, mask) if m]
    ids = [[t["id"] for t in row] for row in post(server.http + "/tokenize", {"inputs": TEXTS})[2]]
    code, _, texts = post(server.http + "/decode", {"ids": ids})
    assert code == 200 and texts == [reference.tok.decode(i, skip_special_tokens=True) for i in ids]
    assert texts[2] == "query : short"  # the prompt is part of what the model reads
    code, _, reply = post(server.http + "/decode", {"ids": [[30522]]})
    assert code == 400 and "outside the vocabulary" in reply["error"]["message"]


def test_similarity_in_front_ends(matryoshka):
    from sentence_transformers.util import cos_sim

    server, st = matryoshka
    source, others = TEXTS[0], TEXTS[1:]
    # Cosine over the served vectors (the declared 128 dimensions, the default prompt).
    expected = cos_sim(st.encode(source, normalize_embeddings=True), st.encode(others, normalize_embeddings=True))[0]
    code, _, got = post(server.http + "/", {"inputs": {"source_sentence": source, "sentences": others}})
    assert code == 200 and np.abs(np.array(got) - expected.numpy()).max() <= 1e-5
