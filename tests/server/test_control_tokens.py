"""EXCLUDE_TOKENS, captured-shape padding (STATIC_SHAPES on CPU) and TRUNCATE=false, on a copy of
the packaged model whose tokenizer learned control tokens."""

import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import decode_embeddings
from tests.conftest import Reference, ServerProcess

CONTROL = ["[product]", "[query]"]


@pytest.fixture(scope="module")
def control_model(tmp_path_factory, model_dir):
    from transformers import AutoModel, AutoTokenizer

    out = tmp_path_factory.mktemp("control-model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_tokens(CONTROL, special_tokens=True)
    model = AutoModel.from_pretrained(model_dir)
    model.resize_token_embeddings(len(tok))
    tok.save_pretrained(out)
    model.save_pretrained(out)
    for name in ("modules.json", "sentence_bert_config.json", "1_Pooling"):  # served as the original declares
        src = Path(model_dir) / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, out / name)
    return str(out)


@pytest.fixture(scope="module")
def control_server(control_model):
    server = ServerProcess({
        "MODEL_PATH": control_model, "EXCLUDE_TOKENS": ",".join(CONTROL), "TRUNCATE": "false",
        "STATIC_SHAPES": "true", "COMPILE": "false", "MAX_DRAIN_TIME_MS": "600000",
    }).wait_ready()
    yield server
    server.stop()


def test_control_tokens_are_left_out_of_the_mean(control_server, control_model):
    ref = Reference(control_model)
    texts = ["[product] red running shoes", "[query] shoes for running [product]", "plain text, no control"]
    exclude = [ref.tok.convert_tokens_to_ids(t) for t in CONTROL]
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(control_server.target))
    out = decode_embeddings(stub.Embed(pb.EmbedRequest(texts=texts)))
    assert np.abs(out - ref.embed(texts, exclude_ids=exclude)).max() <= 1e-5
    # and the control tokens really were in the input: including them gives other vectors
    assert np.abs(out[:2] - ref.embed(texts[:2])).max() > 1e-3


def test_over_long_text_is_rejected_when_truncation_is_off(control_server):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(control_server.target))
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(pb.EmbedRequest(texts=["short", "word " * 600]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "texts[1] is longer than 256 tokens (the model's max_seq_length" in e.value.details()
    ids = np.ones((1, 600), "<i4")
    with pytest.raises(grpc.RpcError) as e:
        stub.Infer(pb.InferRequest(input_ids=ids.tobytes(), attention_mask=ids.tobytes(), shape=[1, 600]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "TRUNCATE is off" in e.value.details()
    assert decode_embeddings(stub.Embed(pb.EmbedRequest(texts=["still fine"]))).shape == (1, 384)
