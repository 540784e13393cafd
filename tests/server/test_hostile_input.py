"""Hostile input on real processes, in one process and with FRONTENDS=2 alike: a body small on
the wire and huge once padded or validated, a schema error that would list every item or echo
a huge key, and texts crafted to skew the token estimate offered load is counted on."""

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.config import Settings
from embedserve.errors import InvalidInput
from embedserve.transports.http_errors import REPLY_BYTES, error_reply
from embedserve.batching.shaping import ID_ROW_BOUND, Limits, id_lists
from tests.conftest import ServerProcess, counter, make_text
from tests.server.frontends.test_frontend import children, kill_front_ends
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


def test_token_id_rows_are_cut_before_any_array_is_made(server):
    """A row as long as the schema allows beside 511 short ones: cut at max_seq_length before the
    rows are padded into one array (padded to its longest row as sent, one row of 200,000 ids beside
    511 short ones had held 1.1 GB at its peak, and the event loop ~4 s)."""
    bound = ID_ROW_BOUND * Settings().buckets[-1]
    status, body = post(server.http + "/v1/embeddings", {"model": "sim:50000", "input": [[1000] * bound] + [[1000]] * 511})
    assert status == 200, body[:300]
    reply = json.loads(body)
    assert len(reply["data"]) == 512 and reply["usage"]["prompt_tokens"] == 256 + 511  # cut at max_seq_length


def test_a_token_id_row_past_the_bound_is_refused_on_its_length(server):
    """Past ID_ROW_BOUND times the largest bucket, a row is refused by the schema on its length
    alone, briefly: its ids had been validated one by one (a 33 MB row, ~0.35 s of the event loop
    and ~100 MiB), only for all but the first 256 to be cut. Past the ids a request can use in all
    (MAX_TEXTS_PER_REQUEST × max_length), the body is refused before it is parsed (413)."""
    status, reply = post(server.http + "/v1/embeddings", {"model": "sim:50000", "input": [[1000] * 9000]})
    assert status == 422 and len(reply) <= REPLY_BYTES, (status, reply[:300])
    detail = json.loads(reply)["detail"]
    assert any(e["type"] == "too_long" and "at most 8192 items" in e["msg"] for e in detail), detail
    status, reply = post(server.http + "/v1/embeddings", {"model": "sim:50000", "input": [[1000] * 200_000]})
    assert status == 413 and b"JSON items" in reply, (status, reply[:300])


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
    assert any(e["type"] == "too_long" and "at most 512 items" in e["msg"] for e in detail), detail


@pytest.mark.parametrize("body", [
    {"input": {"K" * 1_000_000: 1}, "model": "sim:50000"},  # an error per member of the union, each echoing it
    {"input": "x", "K" * 1_000_000: 0},  # `model` missing: the error echoes the whole body
], ids=["key in input", "key beside input"])
def test_a_422_cuts_the_keys_it_echoes(server, body):
    """Keys were echoed whole: 4.0 MB and 1.0 MB replies for 1 MB bodies (~136 MB within the body
    limit, serialized on the event loop)."""
    status, reply = post(server.http + "/v1/embeddings", body)
    assert status == 422 and len(reply) <= REPLY_BYTES, (status, len(reply))
    assert "KKK... (1000000 characters)" in reply.decode()


def test_a_422_reply_is_capped_whatever_its_errors_echo():
    """Cut inputs alone do not bound it: ASCII-escaped, a character outside the BMP is 12 bytes,
    and an error may echo 8 keys and 8 values of 100 characters (19 KB each). What does not fit
    is summarised, then counted."""
    astral = "\U0001F600" * 200
    errors = [{"type": "missing", "loc": ["body", "model"], "msg": "Field required",
               "input": {str(i) + astral: astral for i in range(8)}}] * 12
    reply = error_reply(errors)
    detail = json.loads(reply)["detail"]
    assert len(reply) <= REPLY_BYTES and detail[0]["input"] == "(dict of 8 items)"
    assert detail[-1] == {"type": "too_many_errors", "loc": ["body"], "input": None,
                          "msg": f"{12 - (len(detail) - 1)} more errors not listed"}


def test_crafted_texts_do_not_skew_the_offered_load(server):
    """With one process, offered load is counted on an estimate (characters / learned characters
    per token) before tokenizing. A text of 4,096 characters read as one token had made it ~1/50th
    of the tokens computed; held to 16 characters per token, each such text was still one equal
    sample, and a steady stream of them (here one request in two) pulled the estimate towards 16:
    ordinary text's offered tokens, the autoscaler's demand, under-counted by half and more. Learned
    by tokens, they move it by their one token each. (Front ends send real token counts: exact.)"""
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.target))
    rng = np.random.default_rng(7)
    for _ in range(20):  # the estimate has learned this traffic
        stub.Embed(pb.EmbedRequest(texts=[make_text(rng, 50)]), timeout=30)
    for _ in range(30):
        stub.Embed(pb.EmbedRequest(texts=["a" + " " * 4095]), timeout=30)  # [CLS] a [SEP]
        stub.Embed(pb.EmbedRequest(texts=[make_text(rng, 50)]), timeout=30)
    offered0 = counter(server.http, "embedfleet_offered_tokens_total")
    real0 = counter(server.http, "embedfleet_tokens_total", kind="real")
    for _ in range(10):
        stub.Embed(pb.EmbedRequest(texts=[make_text(rng, 50)]), timeout=30)
    offered = counter(server.http, "embedfleet_offered_tokens_total") - offered0
    real = counter(server.http, "embedfleet_tokens_total", kind="real") - real0
    assert 0.8 < offered / real < 1.25, (offered, real)
