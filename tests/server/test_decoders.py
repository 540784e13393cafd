"""LLM-based embedders: decoders (Qwen3, Mistral) with last-token pooling, an instruction prompt
and a tokenizer that appends eos through its post-processor and declares left padding, against
sentence-transformers on the same directory within 1e-4. Our rows are right-padded (the
tokenizer's own padding is ignored): under causal attention the last real token of a short row
must be read, not a pad, positions count from each row's start, and a row's vector must not
depend on the rows it is batched with. Over a real server (gRPC Embed with the prompt, HTTP,
pre-tokenized Infer, right-padded), and the packed-rows refusal on CPU: ATTENTION=packed stops
the start with the reason; ATTENTION=auto, asked for packed rows, serves padded ones and says why
in /health's attention."""

import json
import urllib.request

import grpc
import numpy as np
import pytest
import torch

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.model_stack import attention_field
from embedserve.client import decode_embeddings
from embedserve.config import Settings
from embedserve.model.batches import Batch
from embedserve.model.encoder import Encoder, Placement
from embedserve.prepare import prepare
from tests.conftest import ServerProcess
from tests.server.model.decoder_models import EOS, build_decoder

TOL = 1e-4
# Rows of very different lengths (1 word to ~60 tokens with the prompt), in one batch.
TEXTS = ["red", "what is a dense vector embedding model for search and retrieval of long passages with the server "
         "batch token text and more words for the long row " * 2, "fast shoes", "how"]


def rows(tokenizer, texts, prompt=""):
    ids, lengths = tokenizer.encode(texts, prompt=prompt)
    mask = (np.arange(ids.shape[1]) < lengths[:, None]).astype(np.int64)
    return Batch(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask), len(texts), int(lengths.sum()), [])


@pytest.fixture(scope="module", params=["qwen3", "mistral"])
def decoder(request, tmp_path_factory):
    return build_decoder(tmp_path_factory.mktemp(request.param), request.param)


def test_decoder_vectors_equal_sentence_transformers_whatever_they_are_batched_with(decoder):
    from sentence_transformers import SentenceTransformer

    settings = Settings(model_path=decoder)
    m = prepare(settings)
    assert m.head.pooling == ("lasttoken",) and m.head.normalize
    enc = Encoder(decoder, settings, Placement(torch.device("cpu"), torch.float32, False, False), [], m.task, m.head)
    st = SentenceTransformer(decoder, device="cpu")
    assert st.tokenizer.padding_side == "left"  # as declared; ours pads right
    eos = st.tokenizer.convert_tokens_to_ids(EOS)
    for name in (None, "query"):
        prompt = m.head.prompt(name)
        batch = rows(m.tokenizer, TEXTS, prompt)
        # the tokenizer's post-processor appended eos to every row, and rows really differ in length
        lengths = batch.attention_mask.sum(1)
        assert (batch.input_ids[torch.arange(len(TEXTS)), lengths - 1] == eos).all()
        assert int(lengths.max()) > 4 * int(lengths.min())
        got = enc.run(batch)
        want = st.encode(TEXTS, prompt_name=name)
        assert np.abs(got - want).max() <= TOL
        alone = np.concatenate([enc.run(rows(m.tokenizer, [t], prompt)) for t in TEXTS])
        assert np.abs(got - alone).max() <= 1e-5


def test_a_decoder_runs_packed_rows_equal_to_sentence_transformers(decoder):
    """Packed rows (ATTENTION=auto on a GPU asks for them; here the reference attention on CPU):
    causal attention within each row, positions from each row's start, the last token of each
    segment."""
    from sentence_transformers import SentenceTransformer

    asked = Placement(torch.device("cpu"), torch.float32, False, False, False, "packed")
    m = prepare(Settings(model_path=decoder))
    served = Encoder(decoder, Settings.from_env({"ATTENTION": "auto"}), asked, [], m.task, m.head)
    assert served.attention == "packed" and served.declined is None
    prompt = m.head.prompt("query")
    ids, lengths = m.tokenizer.encode(TEXTS, prompt=prompt)
    batch = packed(ids, lengths)
    want = SentenceTransformer(decoder, device="cpu").encode(TEXTS, prompt_name="query")
    assert np.abs(served.run(batch)[: len(TEXTS)] - want).max() <= TOL


def packed(ids: np.ndarray, lengths: np.ndarray):
    """Token rows → one packed stream, as the batcher lays it out (model.batches.layout)."""
    from embedserve.model.batches import PackedBatch, PackSpec, layout

    spec = PackSpec(max_len=int(lengths.max()), max_rows=len(lengths), ladder=None)
    cu, positions, segments, size = layout(lengths, spec)
    stream = np.concatenate([row[:n] for row, n in zip(ids, lengths)]).astype(np.int64)
    return PackedBatch(torch.from_numpy(stream), torch.from_numpy(positions).long(), torch.from_numpy(segments).long(),
                       torch.from_numpy(cu), spec.max_len, len(lengths), int(lengths.sum()), [])


def test_attention_field_says_why_packed_rows_were_declined():
    assert attention_field("padded", "model type 'llama' is a decoder this server does not pack") == \
        "padded (model type 'llama' is a decoder this server does not pack)"
    assert attention_field("packed", None) == "packed"


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    path = build_decoder(tmp_path_factory.mktemp("qwen3-served"), "qwen3")
    server = ServerProcess({"MODEL_PATH": path, "MAX_DRAIN_TIME_MS": "600000"}).wait_ready()
    yield server, path
    server.stop()


def test_a_served_decoder_equals_sentence_transformers_over_grpc_and_http(qwen3_server):
    from sentence_transformers import SentenceTransformer

    server, path = qwen3_server
    st = SentenceTransformer(path, device="cpu")
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.target))
    got = decode_embeddings(stub.Embed(pb.EmbedRequest(texts=TEXTS, prompt_name="query")))
    assert np.abs(got - st.encode(TEXTS, prompt_name="query")).max() <= TOL
    # Infer stays right-padded: the tokenizer's ids, padded on the right by the caller
    enc = [st.tokenizer(t)["input_ids"] for t in TEXTS]
    width = max(map(len, enc))
    ids = np.array([e + [0] * (width - len(e)) for e in enc], dtype="<i4")
    mask = np.array([[1] * len(e) + [0] * (width - len(e)) for e in enc], dtype="<i4")
    out = decode_embeddings(stub.Infer(pb.InferRequest(input_ids=ids.tobytes(), attention_mask=mask.tobytes(),
                                                       shape=list(ids.shape))))
    assert np.abs(out - st.encode(TEXTS)).max() <= TOL
    body = json.dumps({"inputs": TEXTS, "prompt_name": "query"}).encode()
    request = urllib.request.Request(server.http + "/embed", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert np.abs(np.array(json.loads(r.read())) - got).max() <= TOL


def test_attention_packed_serves_a_decoder_and_refuses_one_it_does_not_pack(tmp_path):
    """ATTENTION=packed on CPU (the reference attention): a Qwen3 embedder is served from packed
    rows, equal to sentence-transformers; a Llama one (not checked here) stops the start, naming why."""
    from sentence_transformers import SentenceTransformer

    path = build_decoder(tmp_path / "qwen3", "qwen3")
    server = ServerProcess({"MODEL_PATH": path, "ATTENTION": "packed", "MAX_DRAIN_TIME_MS": "600000"}).wait_ready()
    try:
        assert server.health()[1]["attention"] == "packed"
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.target))
        got = decode_embeddings(stub.Embed(pb.EmbedRequest(texts=TEXTS, prompt_name="query")))
        assert np.abs(got - SentenceTransformer(path, device="cpu").encode(TEXTS, prompt_name="query")).max() <= TOL
    finally:
        server.stop()
    refused = ServerProcess({"MODEL_PATH": build_decoder(tmp_path / "llama", "llama"), "ATTENTION": "packed"})
    with pytest.raises(RuntimeError, match="exited"):
        refused.wait_ready(timeout=120)
    assert "ATTENTION=packed: model type 'llama' is a decoder this server does not pack" in refused.log()
