"""Hostile input on real processes, in one process and with FRONTENDS=2 alike: a body small on
the wire and huge once padded, a schema error that would list every item, and a text crafted to
skew the token estimate offered load is counted on."""

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.errors import InvalidInput
from embedserve.shaping import Limits, id_lists
from tests.conftest import ServerProcess, counter, make_text
from tests.server.test_frontends import children, kill_front_ends
from tests.server.test_reliability import CAPS

MODES = {"one process": {}, "FRONTENDS=2": {"FRONTENDS": "2"}}


@pytest.fixture(scope="module", params=list(MODES))
def server(request):
    server = ServerProcess({"MODEL_PATH": "sim:50000", "BATCH_CAPS": CAPS, "MAX_DRAIN_TIME_MS": "600000",
                            **MODES[request.param]}).wait_ready()
    fronts = children(server.proc.pid)
    yield server
    server.stop()
    kill_front_ends(fronts)


def post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def peak_rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) // 1024


def test_token_id_rows_are_cut_before_any_array_is_made(server):
    """One row of 200,000 ids beside 511 short ones, 1.2 MB of JSON: padded to its longest row as
    sent it held 1.1 GB at its peak (int64, then int32) and the event loop ~4 s (with FRONTENDS,
    long enough to have its front end killed as stuck). Rows are cut at max_length first."""
    pids = [server.proc.pid, *children(server.proc.pid)]  # whichever process shapes the rows
    before = {pid: peak_rss_mib(pid) for pid in pids}
    status, body = post(server.http + "/v1/embeddings", {"model": "sim:50000", "input": [[1000] * 200_000] + [[1000]] * 511})
    assert status == 200, body[:300]
    reply = json.loads(body)
    assert len(reply["data"]) == 512 and reply["usage"]["prompt_tokens"] == 256 + 511  # cut at max_seq_length
    grown = {pid: peak_rss_mib(pid) - before[pid] for pid in pids}
    assert max(grown.values()) < 200, f"peak RSS grew by {grown} MiB"


def test_token_id_rows_over_max_length_are_refused_by_name_before_any_array_with_truncation_off():
    limits = Limits(max_texts=512, max_length=256, truncate=False)
    with pytest.raises(InvalidInput, match="row 1 has 200000 tokens, more than 256"):
        id_lists([[7] * 3, [7] * 200_000], limits, vocab_size=30522)
    with pytest.raises(InvalidInput, match="send 1 to 512 token lists, got 513"):
        id_lists([[7]] * 513, limits, vocab_size=30522)


def test_a_422_reports_a_few_errors_briefly(server):
    """FastAPI listed an error per item and per member of the input's union, each echoing its
    input: 3,000 texts where 2,048 are allowed answered 620 KB (a 1 MB body, 36 MB and seconds of
    the event loop)."""
    for body in ({"model": "sim:50000", "input": ["hello"] * 3000},
                 {"model": "sim:50000", "input": [["not an id"] * 100_000]}):
        status, reply = post(server.http + "/v1/embeddings", body)
        assert status == 422 and len(reply) < 8_000, (status, len(reply))
    status, reply = post(server.http + "/v1/embeddings", {"model": "sim:50000", "input": ["hello"] * 3000})
    detail = json.loads(reply)["detail"]
    assert any(e["type"] == "too_long" and "at most 2048 items" in e["msg"] for e in detail), detail


def test_one_crafted_text_does_not_skew_the_offered_load(server):
    """With one process, offered load is counted on an estimate (characters / learned characters
    per token) before tokenizing; one text of 4,096 characters read as one token had made the
    estimate ~1/50th of the tokens computed, and the autoscaler's demand with it. (Front ends
    send real token counts: exact.)"""
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.target))
    rng = np.random.default_rng(7)
    for _ in range(20):  # the estimate has learned this traffic
        stub.Embed(pb.EmbedRequest(texts=[make_text(rng, 50)]), timeout=30)
    stub.Embed(pb.EmbedRequest(texts=["a" + " " * 4095]), timeout=30)  # [CLS] a [SEP]
    offered0 = counter(server.http, "embedfleet_offered_tokens_total")
    real0 = counter(server.http, "embedfleet_tokens_total", kind="real")
    for _ in range(10):
        stub.Embed(pb.EmbedRequest(texts=[make_text(rng, 50)]), timeout=30)
    offered = counter(server.http, "embedfleet_offered_tokens_total") - offered0
    real = counter(server.http, "embedfleet_tokens_total", kind="real") - real0
    assert 0.7 < offered / real < 1.3, (offered, real)
