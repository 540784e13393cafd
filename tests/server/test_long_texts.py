"""Long texts embedded whole (LONG_TEXTS=window, a request's long_text "window"), on real servers
of the packaged all-MiniLM-L6-v2 (max length 256), over HTTP and gRPC, in one process and with
front ends. The reference is computed here from the documented rule (docs/api.md, "Long texts"),
with the model's own tokenizer and transformers' token states: the text's tokens in windows of
254 (256 less [CLS] and [SEP]) overlapping by 63, each window's mean-pooled vector before
Normalize weighed by its row's tokens, then normalized."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from tests.conftest import ServerProcess, make_text, post_json

MODEL = "all-MiniLM-L6-v2"
MOST = 1024  # MAX_TOKENS_PER_TEXT of the servers here
WINDOWED = {"LONG_TEXTS": "window", "MAX_TOKENS_PER_TEXT": str(MOST), "MAX_DRAIN_TIME_MS": "600000"}


def reference_windows(reference, text: str, most: int = MOST) -> tuple[np.ndarray, int, np.ndarray]:
    """(the pooled vector, the windows' tokens, the naive pooling of the normalized vectors), by the rule."""
    torch = reference.torch
    tok = reference.tok
    ids = tok(text, add_special_tokens=False)["input_ids"][:most]
    room = reference.max_length - 2
    stride = room - room // 4
    spans = [(0, len(ids))] if len(ids) <= room else []
    start = 0
    while not spans or spans[-1][1] < len(ids):
        spans.append((start, min(start + room, len(ids))))
        start += stride
    rows = [[tok.cls_token_id, *ids[a:b], tok.sep_token_id] for a, b in spans]
    with torch.inference_mode():
        u = np.stack([reference.model(input_ids=torch.tensor([r])).last_hidden_state[0].double().mean(0).numpy()
                      for r in rows])
    w = np.array([len(r) for r in rows], dtype=np.float64)
    pooled = (u * w[:, None]).sum(0) / w.sum()
    naive = ((u / np.linalg.norm(u, axis=1, keepdims=True)) * w[:, None]).sum(0)
    return pooled / np.linalg.norm(pooled), int(w.sum()), naive / np.linalg.norm(naive)


def long_text(seed: int, words: int) -> str:
    """Two halves of different vocabularies: windows whose norms differ (pooling them after
    Normalize would be visibly wrong)."""
    rng = np.random.default_rng(seed)
    return make_text(rng, words // 2) + " " + " ".join(rng.choice(["gpu", "cuda", "tensor", "a", "of"], words // 2))


def post(server, path: str, body: dict) -> tuple[int, dict]:
    return post_json(server.http + path, body)


@pytest.fixture(scope="module")
def windowed():
    server = ServerProcess(WINDOWED).wait_ready()
    yield server
    server.stop()


def test_long_texts_over_http_equal_the_reference(windowed, reference):
    texts = [long_text(1, 400), "a short text", long_text(2, 260)]
    status, reply = post(windowed, "/v1/embeddings", {"input": texts, "model": MODEL, "long_text": "window"})
    assert status == 200, reply
    got = np.array([d["embedding"] for d in reply["data"]], dtype=np.float32)
    tokens = 0
    for i in (0, 2):
        want, n, naive = reference_windows(reference, texts[i])
        diff = float(np.abs(got[i] - want).max())
        print(f"text {i}: {n} tokens, max abs diff {diff:.2e}; pooled after Normalize would be {np.abs(naive - want).max():.2e} off")
        assert diff < 1e-4
        assert np.abs(naive - want).max() > 1e-3  # the test can tell the two poolings apart
        tokens += n
    short = reference.embed(["a short text"])[0]
    assert np.abs(got[1] - short).max() < 1e-5
    # Usage: every window's tokens (admission counts the same rows).
    assert reply["usage"]["prompt_tokens"] == tokens + reference.tokens("a short text")


def test_long_texts_over_grpc_compose_with_dimensions(windowed, reference):
    from embedserve.client import Client

    text = long_text(3, 300)
    want = reference_windows(reference, text)[0]

    async def go():
        async with Client(windowed.target) as client:
            full = await client.embed([text], long_text="window")
            cut = await client.embed([text], dimensions=128, long_text="window")
            plain = await client.embed([text])  # not asked: cut at the max length, as ever
            return full, cut, plain

    full, cut, plain = asyncio.run(go())
    assert np.abs(full[0] - want).max() < 1e-4
    assert np.abs(cut[0] - want[:128] / np.linalg.norm(want[:128])).max() < 1e-4  # Matryoshka over the pooled vector
    assert np.abs(plain[0] - reference.embed([text])[0]).max() < 1e-5


def test_short_texts_unchanged_bit_for_bit(windowed, default_server):
    """A text that fits is the row it always was: the same bits windowed or not, and as on a
    server without LONG_TEXTS (whose forward has no norm column)."""
    text = "retrieval of passages with embedding vectors"
    answers = []
    for server, extra in ((windowed, {"long_text": "window"}), (windowed, {}), (default_server, {})):
        status, reply = post(server, "/v1/embeddings", {"input": [text], "model": MODEL, "encoding_format": "base64", **extra})
        assert status == 200, reply
        answers.append(reply["data"][0]["embedding"])
    assert answers[0] == answers[1] == answers[2]


def test_refusals_name_the_problem(windowed, default_server):
    from embedserve.client import Client

    text = long_text(4, 900)  # ~1,100 tokens: over MAX_TOKENS_PER_TEXT
    # A server that does not window says so in its schema ("" only): 422 naming the field. gRPC has
    # no schema: INVALID_ARGUMENT naming LONG_TEXTS (below).
    status, reply = post(default_server, "/v1/embeddings", {"input": ["a"], "model": MODEL, "long_text": "window"})
    assert status == 422 and "long_text" in json.dumps(reply), reply
    schema = json.loads(urllib.request.urlopen(default_server.http + "/openapi.json", timeout=30).read())
    field = schema["components"]["schemas"]["EmbeddingsRequest"]["properties"]["long_text"]
    assert field.get("enum", [field.get("const")]) == [""], field
    status, reply = post(windowed, "/v1/embeddings", {"input": ["a"], "model": MODEL, "long_text": "sliding"})
    assert status == 422, reply
    status, reply = post(windowed, "/v1/embeddings", {"input": [[101, 102]], "model": MODEL, "long_text": "window"})
    assert status == 400 and "long_text applies to texts" in reply["error"]["message"]
    # truncate false: refused past MAX_TOKENS_PER_TEXT when windowed, past the max length when not.
    status, reply = post(windowed, "/embed", {"inputs": [text], "truncate": False, "long_text": "window"})
    assert status == 400 and "MAX_TOKENS_PER_TEXT" in json.dumps(reply), reply
    status, reply = post(windowed, "/embed", {"inputs": [long_text(5, 300)], "truncate": False})
    assert status == 400 and "truncation is off" in json.dumps(reply), reply

    async def grpc_refusal():
        async with Client(default_server.target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.embed(["a"], long_text="window")
            return e.value

    error = asyncio.run(grpc_refusal())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "LONG_TEXTS" in error.details()


def test_a_text_over_max_tokens_is_cut_there(windowed, reference):
    text = long_text(4, 900)
    status, reply = post(windowed, "/embed", {"inputs": [text], "truncate": True, "long_text": "window"})
    assert status == 200, reply
    want = reference_windows(reference, text, MOST)[0]
    assert np.abs(np.array(reply[0]) - want).max() < 1e-4


def test_front_ends_window_too(reference):
    server = ServerProcess({**WINDOWED, "FRONTENDS": "2"}).wait_ready()
    try:
        texts = [long_text(6, 350), "short", long_text(7, 500)]
        status, reply = post(server, "/v1/embeddings", {"input": texts, "model": MODEL, "long_text": "window"})
        assert status == 200, reply
        tokens = 0
        for i in (0, 2):
            want, n, _ = reference_windows(reference, texts[i])
            assert np.abs(np.array(reply["data"][i]["embedding"]) - want).max() < 1e-4
            tokens += n
        assert reply["usage"]["prompt_tokens"] == tokens + reference.tokens("short")
    finally:
        server.stop()


def test_settings_bound_windowed_texts_and_the_limits_follow():
    from embedserve.config import ConfigError, Settings, text_tokens
    from embedserve.transports import http_api

    off, window = Settings.from_env({}), Settings.from_env({"LONG_TEXTS": "window"})
    assert text_tokens(off, 256) == 256 and text_tokens(window, 256) == 8192
    assert text_tokens(Settings.from_env({"LONG_TEXTS": "window", "MAX_TOKENS_PER_TEXT": "100"}), 256) == 256
    with pytest.raises(ConfigError, match="LONG_TEXTS=window"):
        Settings.from_env({"MAX_TOKENS_PER_TEXT": "4096"})
    # The message limits hold one text as long as a windowed one is read (capped as ever), and
    # are otherwise what they were: 512 texts of 256 tokens' characters hold 8,192 tokens' too.
    assert window.max_message_bytes == off.max_message_bytes
    assert http_api.budgets(window, 256) == http_api.budgets(off, 256)
    small = Settings.from_env({"LONG_TEXTS": "window", "MAX_TOKENS_PER_TEXT": "4096", "MAX_TEXTS_PER_REQUEST": "4"})
    assert small.max_message_bytes == 4096 * 16 * 4 + 2**20 > Settings.from_env({"MAX_TEXTS_PER_REQUEST": "4"}).max_message_bytes
    assert http_api.budgets(small, 256)["/embed"].body_bytes >= 4096 * 16 * 2 > http_api.budgets(
        Settings.from_env({"MAX_TEXTS_PER_REQUEST": "4"}), 256)["/embed"].body_bytes
    huge = Settings.from_env({"LONG_TEXTS": "window", "MAX_TOKENS_PER_TEXT": "100000"})
    assert huge.max_message_bytes == off.max_message_bytes  # 1.6 M characters: within 512 texts' bound
