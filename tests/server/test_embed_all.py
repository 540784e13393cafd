"""TEI's POST /embed_all on an embedding server (the packaged model), in one process and with
FRONTENDS=2: per input, every token's last hidden state, equal to transformers' own
`last_hidden_state` of the same text (sentence-transformers' tokenization and max length) within
1e-4; /embed's answers are unchanged by /embed_all requests batched beside them; token states
over MAX_REPLY_BYTES are refused before any work (400 naming it); another task's server answers
400 naming its own routes."""

import asyncio

import numpy as np
import pytest

from tests.conftest import ServerProcess, post_json

TOL = 1e-4
TEXTS = ["the quick brown fox jumps over the lazy dog", "a",
         "Token states: one vector per token, the special ones included, before pooling. " * 4]
MODES = {"one process": {}, "FRONTENDS=2": {"FRONTENDS": "2"}}


@pytest.fixture(scope="module", params=list(MODES), ids=list(MODES))
def server(request):
    # MAX_REPLY_BYTES at its floor (1 MiB): a few long texts' token states pass it.
    s = ServerProcess({"MAX_DRAIN_TIME_MS": "600000", "MAX_REPLY_BYTES": str(2**20), **MODES[request.param]}).wait_ready()
    yield s
    s.stop()


def states(reference, text: str) -> np.ndarray:
    torch = reference.torch
    enc = reference.tok(text, truncation=True, max_length=reference.max_length, return_tensors="pt")
    with torch.inference_mode():
        return reference.model(**enc).last_hidden_state[0].float().numpy()


def test_each_token_state_equals_transformers(server, reference):
    status, rows = post_json(server.http + "/embed_all", {"inputs": TEXTS})
    assert status == 200, rows
    worst = 0.0
    for got, text in zip(rows, TEXTS):
        want = states(reference, text)
        got = np.asarray(got, dtype=np.float32)
        assert got.shape == want.shape  # every token, [CLS] and [SEP] included
        worst = max(worst, float(np.abs(got - want).max()))
    print(f"/embed_all max abs diff {worst:.2g}")
    assert worst <= TOL
    status, one = post_json(server.http + "/embed_all", {"inputs": TEXTS[0]})  # a text alone: a list of one
    assert status == 200 and np.allclose(one[0], rows[0], atol=TOL)


def test_embeddings_beside_token_states_are_unchanged(server, reference):
    """Requests of both kinds at once (their rows share batches): /embed answers the pooled
    vectors as alone, /embed_all the states."""
    want = reference.embed(TEXTS)

    async def go():
        calls = [asyncio.to_thread(post_json, server.http + path, {"inputs": TEXTS})
                 for path in ["/embed", "/embed_all"] * 8]
        return await asyncio.gather(*calls)

    for i, (status, body) in enumerate(asyncio.run(go())):
        assert status == 200, body
        if i % 2 == 0:
            assert float(np.abs(np.asarray(body, dtype=np.float32) - want).max()) <= TOL
        else:
            assert [len(r) for r in body] == [reference.tokens(t) for t in TEXTS]


def test_token_states_over_the_reply_limit_are_refused_before_any_work(server):
    # 64 texts of ~128 tokens x 384 dims x 4 bytes: ~12 MB of float32, over 1 MiB
    status, body = post_json(server.http + "/embed_all", {"inputs": [TEXTS[2]] * 64})
    assert status == 400 and "MAX_REPLY_BYTES" in body["error"]["message"], body
    status, _ = post_json(server.http + "/embed_all", {"inputs": TEXTS})  # it serves on
    assert status == 200
