"""LLM rerankers end to end, on real servers over real HTTP and gRPC, against the judge:
sentence-transformers 6.2's CrossEncoder.predict on the same directory (its default activation,
Sigmoid, included; raw_scores against it with none), scores within 1e-4.

Two of the layouts of tests/server/model/llm_reranker_models.py: the one sentence-transformers
saves (CrossEncoder + LogitScore, a Qwen3-Reranker-style chat template, a default prompt as the
instruction), reranking under TASK=auto, padded rows; and the plain *ForCausalLM checkpoint with a
ChatML template under TASK=rerank, over two front ends (they tokenize the prompts) and packed rows
(the reference attention on CPU). Pairs of very different lengths, some longer than the model
reads (cut, the template's tail restored), several batches of at most four rows."""

from __future__ import annotations


import grpc
import numpy as np
import pytest

from tests.conftest import ServerProcess, counter, post_json
from tests.server.model.llm_reranker_models import MAX_LENGTH, build

TOL = 1e-4
QUERY = "how far away from the earth is the moon on an average day of the year"
TEXTS = ["the moon is about 384,400 kilometres", "cheese is made from milk",
         "the distance between the earth and the moon changes " * 20, "paris", "lunar distance", "yes no",
         "the moon orbits the earth; the distance between the earth and the moon changes over the month"]
SERVER_ENV = {"MAX_DRAIN_TIME_MS": "600000", "BATCH_CAPS": "64:4,128:4", "MAX_TEXTS_PER_REQUEST": "12"}


def post(url, body):
    return post_json(url, body)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("llm-rerankers"))


def judge(model_dir, query, texts, raw=False) -> np.ndarray:
    import torch
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(model_dir, device="cpu", **({"activation_fn": torch.nn.Identity()} if raw else {}))
    return ce.predict([(query, t) for t in texts], batch_size=4)


def pair_tokens(model_dir, query, texts) -> list[int]:
    """Each pair's tokens as CrossEncoder makes its rows (the prompt, cut at max length)."""
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(model_dir, device="cpu")
    features = ce.preprocess([(query, t) for t in texts], prompt=ce._resolve_prompt(None, None))
    return features["attention_mask"].sum(dim=1).tolist()


def by_index(results, key="score") -> np.ndarray:
    return np.array([r[key] for r in sorted(results, key=lambda r: r["index"])])


@pytest.fixture(scope="module")
def declared(dirs):
    server = ServerProcess({**SERVER_ENV, "MODEL_PATH": dirs["st"]}).wait_ready()
    yield server
    server.stop()


def test_the_pairs_are_cut_and_scores_spread(dirs):
    """What the tests below rest on: a pair longer than the model reads, others whole, and raw
    scores that rank."""
    lengths = pair_tokens(dirs["st"], QUERY, TEXTS)
    assert max(lengths) == MAX_LENGTH and min(lengths) < MAX_LENGTH
    raw = judge(dirs["st"], QUERY, TEXTS, raw=True)
    assert raw.max() - raw.min() > 0.5


def test_declared_llm_reranker_over_http(declared, dirs):
    assert declared.health()[1]["task"] == "rerank"
    want, raw = judge(dirs["st"], QUERY, TEXTS), judge(dirs["st"], QUERY, TEXTS, raw=True)
    real = counter(declared.http, "embedfleet_tokens_total", kind="real")
    code, body = post(declared.http + "/rerank", {"query": QUERY, "texts": TEXTS, "return_text": True})
    assert code == 200, body
    assert np.abs(by_index(body) - want).max() <= TOL
    assert [r["index"] for r in body] == list(np.argsort(-want, kind="stable"))
    assert all(r["text"] == TEXTS[r["index"]] for r in body)
    # the rows computed are the prompts CrossEncoder makes, token for token in number
    assert counter(declared.http, "embedfleet_tokens_total", kind="real") - real == sum(
        pair_tokens(dirs["st"], QUERY, TEXTS))
    code, body = post(declared.http + "/rerank", {"query": QUERY, "texts": TEXTS, "raw_scores": True})
    assert code == 200 and np.abs(by_index(body) - raw).max() <= TOL
    code, body = post(declared.http + "/v1/rerank", {"query": QUERY, "documents": TEXTS, "top_n": 3})
    assert code == 200, body
    assert [r["index"] for r in body["results"]] == list(np.argsort(-want, kind="stable"))[:3]
    assert all(abs(r["relevance_score"] - want[r["index"]]) <= TOL for r in body["results"])
    assert body["usage"]["total_tokens"] == sum(pair_tokens(dirs["st"], QUERY, TEXTS))
    code, body = post(declared.http + "/", {"query": QUERY, "texts": TEXTS[:2]})  # TEI's root route
    assert code == 200 and np.abs(by_index(body) - want[:2]).max() <= TOL
    code, body = post(declared.http + "/rerank", {"query": "moon", "texts": ["lunar distance"]})  # one pair
    assert code == 200 and abs(body[0]["score"] - judge(dirs["st"], "moon", ["lunar distance"])[0]) <= TOL


async def test_declared_llm_reranker_over_grpc(declared, dirs):
    from embedserve.client import Client

    async with Client(declared.target, timeout_s=120) as client:
        scores = await client.rerank(QUERY, TEXTS)
        assert scores.shape == (len(TEXTS),)
        assert np.abs(scores - judge(dirs["st"], QUERY, TEXTS)).max() <= TOL
        raw = await client.rerank(QUERY, TEXTS, raw_scores=True)
        assert np.abs(raw - judge(dirs["st"], QUERY, TEXTS, raw=True)).max() <= TOL
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.rerank(QUERY, TEXTS, truncate=False)  # the long pair is refused, by name
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "the pair (query, texts[2])" in e.value.details()
        fits = await client.rerank(QUERY, TEXTS[:2], truncate=False)
        assert np.abs(fits - judge(dirs["st"], QUERY, TEXTS[:2])).max() <= TOL
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.embed(["a"])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Rerank" in e.value.details()
        assert (await client.health()).task == "rerank"


async def test_plain_causal_lm_with_task_rerank_over_front_ends_and_packed_rows(dirs):
    """TASK=rerank on the plain checkpoint: served as CrossEncoder(path) serves it ("yes"/"no",
    the ChatML template, Sigmoid); FRONTENDS=2 tokenize the prompts; ATTENTION=packed rows."""
    from embedserve.client import Client

    server = ServerProcess({**SERVER_ENV, "MODEL_PATH": dirs["plain"], "TASK": "rerank", "FRONTENDS": "2",
                            "ATTENTION": "packed"}).wait_ready()
    try:
        health = server.health()[1]
        assert health["task"] == "rerank" and health["attention"] == "packed"
        want, raw = judge(dirs["plain"], QUERY, TEXTS), judge(dirs["plain"], QUERY, TEXTS, raw=True)
        offered = counter(server.http, "embedfleet_offered_tokens_total")
        for _ in range(3):  # over both front ends, likely
            code, body = post(server.http + "/rerank", {"query": QUERY, "texts": TEXTS})
            assert code == 200, body
            assert np.abs(by_index(body) - want).max() <= TOL
        assert counter(server.http, "embedfleet_offered_tokens_total") - offered == 3 * sum(
            pair_tokens(dirs["plain"], QUERY, TEXTS))
        async with Client(server.target, timeout_s=120) as client:
            got = await client.rerank(QUERY, TEXTS, raw_scores=True)
            assert np.abs(got - raw).max() <= TOL
        code, body = post(server.http + "/v1/rerank", {"query": QUERY, "documents": TEXTS})
        assert code == 200 and [r["index"] for r in body["results"]] == list(np.argsort(-want, kind="stable"))
    finally:
        server.stop()


def test_plain_causal_lm_under_task_auto_stays_an_embedder(dirs):
    """The plain checkpoint declares nothing: TASK=auto serves it as a (decoder) embedder, and
    its rerank routes answer 400 naming the embedding ones."""
    server = ServerProcess({**SERVER_ENV, "MODEL_PATH": dirs["plain"]}).wait_ready()
    try:
        assert server.health()[1]["task"] == "embed"
        code, body = post(server.http + "/embed", {"inputs": ["the moon", "cheese"]})
        assert code == 200 and np.array(body).shape == (2, 64)
        code, body = post(server.http + "/rerank", {"query": QUERY, "texts": TEXTS})
        assert code == 400 and "does embed" in body["error"]["message"]
    finally:
        server.stop()
