"""Several models on one device (MODELS), on real processes: each model served in a shared pod
answers as the same model served alone (the same requests, one at a time, so the same batches),
on every task and over gRPC and HTTP; requests address models by name on every transport, an
unknown name is refused naming the served ones, each route answers for its model's task; the
pod's metrics and /health speak per model and in busy seconds; models that do not fit the
device's memory stop the start with the numbers in the termination message."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.model.device import MISFIT_PREFIX
from tests.conftest import ServerProcess, free_port

TEXTS = ["a shared device", "every model its own budget", "the pod scaled on the sum of their device time"]
QUERY = "which pod serves several models?"


def post(base: str, path: str, body: dict) -> tuple[int, object]:
    request = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def entries(tmp_path_factory, model_dir) -> list[dict]:
    """One model of each task: the packaged MiniLM (embed), tiny random BERTs (rerank, classify;
    the packaged tokenizer at max length 128) and a tiny SPLADE (sparse)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from tests.server.model.sparse_models import build_splade

    root = tmp_path_factory.mktemp("shared-models")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.model_max_length = 128
    torch.manual_seed(0)
    out = [{"name": "dense", "model": model_dir}]
    for task, labels in (("rerank", 1), ("classify", 3)):
        config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=128, num_labels=labels)
        BertForSequenceClassification(config).eval().save_pretrained(root / task)
        tok.save_pretrained(root / task)
        out.append({"name": task, "model": str(root / task), "task": task})
    out.append({"name": "sparse", "model": build_splade(root / "sparse", model_dir), "task": "sparse"})
    return out


@pytest.fixture(scope="module")
def pods(entries):
    """The shared pod and each model alone, started together (their warm-ups overlap)."""
    shared = ServerProcess({"MODELS": json.dumps(entries)})
    alone = {e["name"]: ServerProcess({"MODEL_PATH": e["model"], "SERVED_MODEL_NAME": e["name"],
                                       **({"TASK": e["task"]} if "task" in e else {})}) for e in entries}
    try:
        for p in (shared, *alone.values()):
            p.wait_ready(300)
        yield shared, alone
    finally:
        for p in (shared, *alone.values()):
            p.stop()


def stub(p: ServerProcess):
    return pb_grpc.InferenceStub(grpc.insecure_channel(p.target))


def test_each_model_answers_as_it_does_alone(pods):
    shared, alone = pods
    s = stub(shared)
    # embed, over gRPC and HTTP (OpenAI names the model, TEI's route takes the prefix)
    mine = s.Embed(pb.EmbedRequest(texts=TEXTS, model="dense"))
    theirs = stub(alone["dense"]).Embed(pb.EmbedRequest(texts=TEXTS))
    np.testing.assert_allclose(np.frombuffer(mine.embeddings, "<f4"), np.frombuffer(theirs.embeddings, "<f4"), atol=1e-6)
    _, a = post(shared.http, "/v1/embeddings", {"model": "dense", "input": TEXTS})
    _, b = post(alone["dense"].http, "/v1/embeddings", {"model": "dense", "input": TEXTS})
    assert a["model"] == "dense"
    np.testing.assert_allclose([d["embedding"] for d in a["data"]], [d["embedding"] for d in b["data"]], atol=1e-6)
    _, a = post(shared.http, "/models/dense/embed", {"inputs": TEXTS})
    np.testing.assert_allclose(a, [d["embedding"] for d in b["data"]], atol=1e-6)
    # rerank
    mine = s.Rerank(pb.RerankRequest(query=QUERY, texts=TEXTS, model="rerank")).scores
    theirs = stub(alone["rerank"]).Rerank(pb.RerankRequest(query=QUERY, texts=TEXTS)).scores
    np.testing.assert_allclose(mine, theirs, atol=1e-6)
    status, a = post(shared.http, "/v1/rerank", {"model": "rerank", "query": QUERY, "documents": TEXTS})
    assert status == 200 and a["model"] == "rerank"
    np.testing.assert_allclose(sorted(r["relevance_score"] for r in a["results"]), sorted(theirs), atol=1e-6)
    # sparse
    mine = s.EmbedSparse(pb.EmbedRequest(texts=TEXTS, model="sparse"))
    theirs = stub(alone["sparse"]).EmbedSparse(pb.EmbedRequest(texts=TEXTS))
    assert mine.indices == theirs.indices and list(mine.offsets) == list(theirs.offsets)
    np.testing.assert_allclose(np.frombuffer(mine.values, "<f4"), np.frombuffer(theirs.values, "<f4"), atol=1e-6)
    # classify (HTTP only, as alone)
    _, a = post(shared.http, "/models/classify/classify", {"inputs": TEXTS, "all_scores": True})
    _, b = post(alone["classify"].http, "/classify", {"inputs": TEXTS, "all_scores": True})
    assert [r["label"] for r in a] == [r["label"] for r in b]
    for x, y in zip(a, b):
        np.testing.assert_allclose(list(x["scores"].values()), list(y["scores"].values()), atol=1e-6)


def test_models_are_addressed_by_name_and_the_unknown_refused(pods, entries):
    shared, alone = pods
    names = [e["name"] for e in entries]
    listed = json.loads(get(shared.http + "/v1/models"))
    assert [m["id"] for m in listed["data"]] == names  # the default first
    status, body = post(shared.http, "/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert all(repr(n) in body["error"]["message"] for n in names)
    with pytest.raises(grpc.RpcError) as e:
        stub(shared).Embed(pb.EmbedRequest(texts=["x"], model="nope"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and all(repr(n) in e.value.details() for n in names)
    # Each route answers for the task of the model it addresses.
    status, body = post(shared.http, "/v1/embeddings", {"model": "rerank", "input": "x"})
    assert status == 400 and "rerank" in body["error"]["message"]
    assert post(shared.http, "/models/rerank/embed", {"inputs": "x"})[0] == 400
    assert post(shared.http, "/models/sparse/embed_sparse", {"inputs": "x"})[0] == 200
    # The prefix alone is its TEI root (a client's base URL), with that route's body budget (over 64 KiB).
    big = ["a retrieval stack on one device " * 100] * 40
    status, rows = post(shared.http, "/models/dense", {"inputs": big})
    assert status == 200 and len(rows) == 40
    with pytest.raises(grpc.RpcError) as e:
        stub(shared).Rerank(pb.RerankRequest(query="q", texts=["x"], model="dense"))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # No model named: the default's (the first listed), as a one-model server's paths.
    _, a = post(shared.http, "/embed", {"inputs": "x"})
    _, b = post(alone["dense"].http, "/embed", {"inputs": "x"})
    np.testing.assert_allclose(a, b, atol=1e-6)
    health = stub(shared).HealthCheck(pb.HealthCheckRequest(model="sparse"))
    assert list(health.models) == names and health.task == "sparse"


async def test_the_client_names_its_model(pods):
    from embedserve.client import Client

    shared, alone = pods
    async with Client(shared.target, model="rerank") as ranker, Client(alone["rerank"].target) as theirs:
        np.testing.assert_allclose(await ranker.rerank(QUERY, TEXTS), await theirs.rerank(QUERY, TEXTS), atol=1e-6)
        dense = await ranker.embed(TEXTS, model="dense")  # a call's own model, over the Client's
        assert dense.shape == (3, 384)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ranker.embed(TEXTS)  # the Client's model: a reranker
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_metrics_and_health_speak_per_model_and_in_busy_seconds(pods, entries):
    from prometheus_client.parser import text_string_to_metric_families

    shared, _ = pods
    post(shared.http, "/v1/embeddings", {"model": "dense", "input": TEXTS})
    families = {f.name: f for f in text_string_to_metric_families(get(shared.metrics + "/metrics"))}
    names = {e["name"] for e in entries}
    rates = {s.labels["model"]: s.value for s in families["embedfleet_service_rate_tokens_per_second"].samples}
    assert set(rates) == names and all(r > 0 for r in rates.values())
    tasks = {s.labels["model"]: s.labels["task"] for s in families["embedfleet_model_info"].samples}
    assert tasks == {e["name"]: e.get("task", "embed") for e in entries}
    offered = {s.labels["model"]: s.value for s in families["embedfleet_offered_tokens"].samples}
    assert offered["dense"] > 0
    # The pod's own: totals with no model label, its demand in device seconds, one device.
    assert [s.labels for s in families["embedfleet_queued_requests"].samples] == [{}]
    assert families["embedfleet_offered_busy_seconds"].samples[0].value > 0
    assert families["embedfleet_capacity_busy_seconds_per_second"].samples[0].value == 1.0
    _, health = shared.health()
    assert [m["name"] for m in health["models"]] == [e["name"] for e in entries]
    assert {m["name"]: m["task"] for m in health["models"]} == tasks


def test_front_ends_address_every_model(model_dir):
    """FRONTENDS=2: each front end tokenizes for every model and names it to the model process."""
    entries = [{"name": "sim", "model": "sim:200000"}, {"name": "mini", "model": model_dir}]
    shared = ServerProcess({"MODELS": json.dumps(entries), "FRONTENDS": "2"})
    alone = ServerProcess({"MODEL_PATH": model_dir})
    try:
        shared.wait_ready(300), alone.wait_ready(300)
        mine = stub(shared).Embed(pb.EmbedRequest(texts=TEXTS, model="mini"))
        theirs = stub(alone).Embed(pb.EmbedRequest(texts=TEXTS))
        np.testing.assert_allclose(np.frombuffer(mine.embeddings, "<f4"), np.frombuffer(theirs.embeddings, "<f4"),
                                   atol=1e-6)
        _, sim = post(shared.http, "/embed", {"inputs": TEXTS})
        assert np.asarray(sim).shape == (3, 384)
        status, body = post(shared.http, "/v1/embeddings", {"model": "nope", "input": "x"})
        assert status == 404 and "'sim', 'mini'" in body["error"]["message"]
    finally:
        shared.stop(), alone.stop()


def test_models_that_do_not_fit_stop_the_start_with_the_numbers(tmp_path):
    """The simulated device declares its size; the second model would pass it with the margin."""
    message = tmp_path / "termination-log"
    env = {"MODELS": json.dumps([{"name": "big", "model": "sim:50000@3GiB"}, {"name": "bigger", "model": "sim:50000@4GiB"}]),
           "DEVICE_MEMORY_BYTES": str(6 * 2**30), "TERMINATION_MESSAGE_PATH": str(message),
           "GRPC_PORT": str(free_port()), "HTTP_HEALTH_PORT": str(free_port()), "METRICS_PORT": str(free_port()),
           "BATCH_CAPS": "16:8,32:8,64:8,128:8,256:8,512:8", "WARM_START": "false", "BIND_HOST": "127.0.0.1"}
    import os

    done = subprocess.run([sys.executable, "-m", "embedserve"], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 1
    said = message.read_text()
    assert said.startswith(MISFIT_PREFIX), said
    assert "big 3.00 GiB + bigger 4.00 GiB + margin 1.00 GiB = 8.00 GiB > device 6.00 GiB" in said
    assert said in done.stdout + done.stderr  # and in the log


def test_a_hung_device_fails_every_models_requests():
    """One model's batch hangs the device all its models share: the others' requests, the one
    waiting for its turn included, fail at once (UNAVAILABLE: another pod serves them), none hangs."""
    import time

    from embedserve.model.simulated import HANG_TOKEN
    from tests.server.test_reliability import CAPS, infer_request

    entries = [{"name": "a", "model": "sim:50000"}, {"name": "b", "model": "sim:50000"}]
    server = ServerProcess({"MODELS": json.dumps(entries), "BATCH_CAPS": CAPS, "WATCHDOG_FLOOR_S": "1",
                            "WATCHDOG_MULTIPLE": "2"}).wait_ready()
    try:
        s = stub(server)
        hung = infer_request([101, HANG_TOKEN, 102])
        hung.model = "a"
        first = s.Infer.future(hung, timeout=30)
        deadline = time.monotonic() + 60
        while server.health()[1]["models"][0]["gpu_queue_depth"] == 0:  # a's batch handed to its worker
            assert time.monotonic() < deadline, "a's batch never reached its worker"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as e:  # b's rows wait for a turn the hung batch never gives
            s.Embed(pb.EmbedRequest(texts=["behind the hung batch"], model="b"), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            first.result()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # not DEADLINE_EXCEEDED: none waited out its deadline
        assert server.health()[0] == 503
    finally:
        server.stop()
