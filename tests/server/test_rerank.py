"""Rerank end to end, on real servers over real HTTP and gRPC, against the judge:
sentence-transformers' CrossEncoder on the same model directory (its default activation
included), scores within 1e-4.

The cross-encoders are built here from the packaged MiniLM's weights (a BERT of token types: a
BertForSequenceClassification of one label, its classifier seeded), the type-1 embedding pushed
away from type 0 so scores computed without token types would be wrong, and the tokenizer's
max length 32 so the test pairs are cut (longest first). Three directories: saved through
CrossEncoder (config_sentence_transformers.json says CrossEncoder; sigmoid), a plain checkpoint
(detected by TEI's rule; sigmoid, CrossEncoder's default), and one saved with torch.nn.Identity as
its activation and a default prompt (the activation is read, not assumed; the prompt goes before
each query, as CrossEncoder puts it).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from tests.conftest import ServerProcess, counter, post_json

MAX_LENGTH = 32
QUERY = "how far away from the earth is the moon on an average day of the year"
TEXTS = [
    "the moon is about 384,400 kilometres from the earth",
    "cheese is made from milk",
    "the moon orbits the earth at an average distance of three hundred and eighty four thousand "
    "kilometres, about thirty times the diameter of the earth, and it takes a month to go round",
    "paris",
    "lunar distance",
    "the distance between the earth and the moon changes over the month, from 363,000 to 405,000 km",
]
PROMPT = "query: "  # the identity model's declared default prompt, before each query
SERVER_ENV = {"MAX_DRAIN_TIME_MS": "600000", "BATCH_CAPS": "16:4,32:4", "MAX_TEXTS_PER_REQUEST": "12"}


def post(url, body):
    return post_json(url, body)


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_dir):
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertForSequenceClassification

    root = tmp_path_factory.mktemp("cross-encoders")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.model_max_length = MAX_LENGTH
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(model_dir, num_labels=1).eval()
    with torch.no_grad():
        types = model.bert.embeddings.token_type_embeddings.weight
        types[1] = types[0] + 0.5 * torch.randn_like(types[1])  # type 1 must matter
        model.classifier.weight.mul_(200)  # scores spread over the sigmoid's range
    dirs = {name: root / name for name in ("plain", "cross_encoder", "identity")}
    model.save_pretrained(dirs["plain"])
    tok.save_pretrained(dirs["plain"])
    CrossEncoder(str(dirs["plain"]), device="cpu").save(str(dirs["cross_encoder"]))
    CrossEncoder(str(dirs["plain"]), device="cpu", activation_fn=torch.nn.Identity(), prompts={"query": PROMPT},
                 default_prompt_name="query").save(str(dirs["identity"]))
    return {name: str(d) for name, d in dirs.items()}


def judge(model_dir, query, texts, raw=False) -> np.ndarray:
    """CrossEncoder.predict on the directory, its own activation (or none: raw)."""
    import torch
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(model_dir, device="cpu", **({"activation_fn": torch.nn.Identity()} if raw else {}))
    return ce.predict([(query, t) for t in texts], batch_size=4, convert_to_numpy=True)


def pair_tokens(model_dir, query, texts, cut=True) -> list[int]:
    """Each pair's real tokens, [CLS]/[SEP] included, as the HF tokenizer counts them (cut as
    CrossEncoder cuts them, or whole)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok([query] * len(texts), texts, **({"truncation": "longest_first", "max_length": MAX_LENGTH} if cut else {}))
    return [len(ids) for ids in enc["input_ids"]]


@pytest.fixture(scope="module")
def reranker(models):
    server = ServerProcess({**SERVER_ENV, "MODEL_PATH": models["cross_encoder"]}).wait_ready()
    yield server
    server.stop()


def test_the_test_pairs_are_cut_and_token_types_matter(models):
    """What the tests below rest on: some pairs are longer than the model reads (longest_first
    truncation decides their tokens), and scores computed without token types would differ."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["plain"])
    whole = [len(tok(QUERY, t)["input_ids"]) for t in TEXTS]
    assert max(whole) > MAX_LENGTH and min(whole) < MAX_LENGTH
    model = AutoModelForSequenceClassification.from_pretrained(models["plain"]).eval()
    enc = tok([QUERY] * len(TEXTS), TEXTS, truncation="longest_first", max_length=MAX_LENGTH, padding=True,
              return_tensors="pt")
    with torch.inference_mode():
        typed = model(**enc).logits[:, 0]
        untyped = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits[:, 0]
    assert float((typed - untyped).abs().max()) > 0.1
    np.testing.assert_allclose(judge(models["plain"], QUERY, TEXTS, raw=True), typed.numpy(), atol=1e-4)


def test_rerank_matches_cross_encoder(reranker, models):
    want = judge(models["cross_encoder"], QUERY, TEXTS)
    assert want.max() - want.min() > 0.1  # a ranking worth testing
    code, body = post(reranker.http + "/rerank", {"query": QUERY, "texts": TEXTS, "return_text": True})
    assert code == 200, body
    assert [r["index"] for r in body] == list(np.argsort(-want, kind="stable"))
    got = np.array([r["score"] for r in sorted(body, key=lambda r: r["index"])])
    assert np.abs(got - want).max() <= 1e-4
    assert all(r["text"] == TEXTS[r["index"]] for r in body)
    # raw_scores: the logits, CrossEncoder with no activation
    code, raw = post(reranker.http + "/rerank", {"query": QUERY, "texts": TEXTS, "raw_scores": True})
    assert code == 200 and all("text" not in r for r in raw)
    got_raw = np.array([r["score"] for r in sorted(raw, key=lambda r: r["index"])])
    assert np.abs(got_raw - judge(models["cross_encoder"], QUERY, TEXTS, raw=True)).max() <= 1e-4
    # TEI's root route takes the rerank shape on a reranking server
    code, root = post(reranker.http + "/", {"query": QUERY, "texts": TEXTS})
    assert code == 200 and [r["index"] for r in root] == [r["index"] for r in body]


def test_v1_rerank_cohere_shape(reranker, models):
    want = judge(models["cross_encoder"], QUERY, TEXTS)
    order = list(np.argsort(-want, kind="stable"))
    docs = [TEXTS[0], {"text": TEXTS[1]}, *TEXTS[2:]]  # strings and Cohere's objects alike
    code, body = post(reranker.http + "/v1/rerank", {"model": "cross_encoder", "query": QUERY, "documents": docs,
                                                     "top_n": 3, "return_documents": True})
    assert code == 200, body
    assert [r["index"] for r in body["results"]] == order[:3]
    for r in body["results"]:
        assert abs(r["relevance_score"] - want[r["index"]]) <= 1e-4
        assert r["document"] == {"text": TEXTS[r["index"]]}
    assert body["model"] == "cross_encoder" and body["id"]
    assert body["usage"]["total_tokens"] == sum(pair_tokens(models["cross_encoder"], QUERY, TEXTS))
    # top_n above the count: all of them (as Cohere); no top_n: all; return_documents off by default
    for extra in ({"top_n": 100}, {}):
        code, body = post(reranker.http + "/v1/rerank", {"query": QUERY, "documents": TEXTS, **extra})
        assert code == 200 and [r["index"] for r in body["results"]] == order
        assert all("document" not in r for r in body["results"])
    code, body = post(reranker.http + "/v1/rerank", {"model": "other", "query": QUERY, "documents": TEXTS})
    assert code == 404 and "cross_encoder" in body["error"]["message"]


@pytest.mark.parametrize("path, body, status, names", [
    # what the schema says is refused there (422, the field in its loc), the rest by the service (400)
    ("/rerank", {"query": QUERY, "texts": []}, 422, '"texts"'),
    ("/rerank", {"query": "", "texts": ["a"]}, 422, '"query"'),
    ("/rerank", {"query": "  ", "texts": ["a"]}, 422, '"query"'),
    ("/rerank", {"query": QUERY, "texts": ["a", " "]}, 422, '"texts", 1'),
    ("/rerank", {"query": QUERY, "texts": ["a"] * 13}, 422, "at most 12 items"),
    ("/rerank", {"query": QUERY, "texts": TEXTS, "truncate": False}, 400, "the pair (query, texts[{first}])"),
    ("/rerank", {"texts": ["a"]}, 422, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": []}, 422, '"documents"'),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, 422, '"query"'),
    ("/v1/rerank", {"query": QUERY, "documents": ["a", {"text": ""}]}, 422, '"documents", 1'),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"] * 13}, 422, "at most 12 items"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, 422, '"top_n"'),
    ("/v1/rerank", {"query": QUERY, "documents": TEXTS, "truncate": False}, 400, "the pair (query, documents[{first}])"),
    ("/v1/embeddings", {"model": "cross_encoder", "input": "a"}, 400, "use Rerank, POST /rerank or /v1/rerank"),
    ("/embed", {"inputs": "a"}, 400, "does rerank"),
])
def test_bad_input_is_named(reranker, models, path, body, status, names):
    whole = pair_tokens(models["cross_encoder"], QUERY, TEXTS, cut=False)
    names = names.replace("{first}", str(next(i for i, n in enumerate(whole) if n > MAX_LENGTH)))
    code, reply = post(reranker.http + path, body)
    assert code == status, reply
    assert names in json.dumps(reply)
    assert post(reranker.http + "/rerank", {"query": "q", "texts": ["a"]})[0] == 200  # still serving


async def test_grpc_rerank_through_our_client(reranker, models):
    from embedserve.client import Client

    async with Client(reranker.target, timeout_s=60) as client:
        scores = await client.rerank(QUERY, TEXTS)  # in text order
        assert scores.shape == (len(TEXTS),) and scores.dtype == np.float32
        assert np.abs(scores - judge(models["cross_encoder"], QUERY, TEXTS)).max() <= 1e-4
        raw = await client.rerank(QUERY, TEXTS, raw_scores=True)
        assert np.abs(raw - judge(models["cross_encoder"], QUERY, TEXTS, raw=True)).max() <= 1e-4
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.rerank(QUERY, TEXTS, truncate=False)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "the pair (query, texts[" in e.value.details()
        fits = await client.rerank("moon", ["lunar distance"], truncate=False)  # short pairs are not refused
        assert np.abs(fits - judge(models["cross_encoder"], "moon", ["lunar distance"])).max() <= 1e-4
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.rerank("", ["a"])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "query" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.embed(["a"])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Rerank" in e.value.details()
        assert (await client.health()).task == "rerank"


def test_health_and_model_info_say_rerank(reranker):
    assert reranker.health()[1]["task"] == "rerank"
    info = {k: v for k, v in _model_info(reranker.http).items()}
    assert info["task"] == "rerank" and info["dimension"] == "1"


def _model_info(http: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(http + "/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "embedfleet_model_info":
                return sample.labels
    return {}


def test_pairs_are_rows_counted_in_real_tokens(reranker, models):
    """A request's pairs are rows like any others: ten pairs, at most four rows a batch, run in
    three batches or more; the tokens computed are the pairs' real tokens, specials included,
    exactly (the HF tokenizer's count)."""
    texts = [f"{t} ({i})" for i, t in enumerate(TEXTS + TEXTS[:4])]
    real = counter(reranker.http, "embedfleet_tokens_total", kind="real")
    batches = counter(reranker.http, "embedfleet_batch_size_count")
    code, body = post(reranker.http + "/rerank", {"query": QUERY, "texts": texts})
    assert code == 200 and len(body) == 10
    assert counter(reranker.http, "embedfleet_batch_size_count") - batches >= 3
    assert counter(reranker.http, "embedfleet_tokens_total", kind="real") - real == sum(
        pair_tokens(models["cross_encoder"], QUERY, texts))
    want = judge(models["cross_encoder"], QUERY, texts)
    got = np.array([r["score"] for r in sorted(body, key=lambda r: r["index"])])
    assert np.abs(got - want).max() <= 1e-4


def test_frontends_rerank_with_the_declared_activation(models):
    """FRONTENDS=2: the front ends tokenize the pairs and apply the activation the model process
    told them (here torch.nn.Identity, as declared: not the sigmoid default), its declared prompt
    before the query; the offered tokens (admitted on the real rows there) rose by exactly the
    pairs' tokens."""
    server = ServerProcess({**SERVER_ENV, "MODEL_PATH": models["identity"], "FRONTENDS": "2"}).wait_ready()
    try:
        want = judge(models["identity"], QUERY, TEXTS)
        assert want.min() < 0 or want.max() > 1  # not a sigmoid's
        from sentence_transformers import CrossEncoder

        unprompted = CrossEncoder(models["identity"], device="cpu").predict([(QUERY, t) for t in TEXTS], prompt="")
        assert np.abs(unprompted - want).max() > 1e-3  # the prompt makes a difference
        offered = counter(server.http, "embedfleet_offered_tokens_total")
        for _ in range(3):  # over both front ends, likely
            code, body = post(server.http + "/rerank", {"query": QUERY, "texts": TEXTS})
            assert code == 200, body
            got = np.array([r["score"] for r in sorted(body, key=lambda r: r["index"])])
            assert np.abs(got - want).max() <= 1e-4
        assert [r["index"] for r in body] == list(np.argsort(-want, kind="stable"))
        assert counter(server.http, "embedfleet_offered_tokens_total") - offered == 3 * sum(
            pair_tokens(models["identity"], PROMPT + QUERY, TEXTS))
        code, body = post(server.http + "/v1/rerank", {"query": QUERY, "documents": TEXTS, "top_n": 2})
        assert code == 200 and [r["index"] for r in body["results"]] == list(np.argsort(-want, kind="stable"))[:2]
        assert server.health()[1]["task"] == "rerank"
    finally:
        server.stop()


def test_a_plain_checkpoint_of_one_label_reranks(models):
    """TEI's rule: no sentence-transformers files, *ForSequenceClassification, one label:
    served as rerank under TASK=auto, with CrossEncoder's default activation (sigmoid)."""
    server = ServerProcess({**SERVER_ENV, "MODEL_PATH": models["plain"]}).wait_ready()
    try:
        assert server.health()[1]["task"] == "rerank"
        code, body = post(server.http + "/rerank", {"query": QUERY, "texts": TEXTS})
        assert code == 200, body
        got = np.array([r["score"] for r in sorted(body, key=lambda r: r["index"])])
        assert np.abs(got - judge(models["plain"], QUERY, TEXTS)).max() <= 1e-4
    finally:
        server.stop()


async def test_an_embedding_server_refuses_rerank(default_server):
    from embedserve.client import Client

    async with Client(default_server.target, timeout_s=30) as client:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.rerank("q", ["a"])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Embed or /v1/embeddings" in e.value.details()
        assert (await client.health()).task == "embed"
    for path, body in (("/rerank", {"query": "q", "texts": ["a"]}), ("/v1/rerank", {"query": "q", "documents": ["a"]})):
        code, reply = post(default_server.http + path, body)
        assert code == 400 and "does embed" in reply["error"]["message"]


def test_openapi_schemathesis_finds_no_server_errors(reranker):
    """A bounded property-based run over a reranking server's OpenAPI document: no 5xx,
    responses as documented (the refusals of the embedding paths are not in it)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    document = json.loads(urllib.request.urlopen(reranker.http + "/openapi.json", timeout=10).read())
    assert {"/rerank", "/v1/rerank", "/"} <= set(document["paths"])
    assert not {"/v1/embeddings", "/embed"} & set(document["paths"])
    schema = schemathesis.openapi.from_url(reranker.http + "/openapi.json")
    for path in ("/rerank", "/v1/rerank", "/"):
        operation = schema[path]["POST"]

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=operation.as_strategy())
        def run(case):
            case.call_and_validate()  # raises on a 5xx, an undocumented status or a schema violation

        run()


def test_task_rerank_on_a_model_of_several_labels_is_a_start_up_error(tmp_path, model_dir):
    """TASK=rerank forces rerank, but one score per pair needs one label: a classifier of three
    labels does not start, and its log says why."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(model_dir)
    config = BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=3)
    BertForSequenceClassification(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    server = ServerProcess({**SERVER_ENV, "MODEL_PATH": str(tmp_path), "TASK": "rerank"})
    try:
        with pytest.raises(RuntimeError, match="server exited"):
            server.wait_ready(timeout=120)
        assert "TASK=rerank needs a *ForSequenceClassification checkpoint of one label" in server.log()
        assert "it has 3 labels" in server.log()
    finally:
        server.stop()
