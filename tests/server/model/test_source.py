"""MODEL_PATH sources: S3 for real against moto's S3 server on loopback; hub errors offline."""

import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import decode_embeddings
from embedserve.model.source import ModelSourceError, needed, resolve
from tests.conftest import ONE_ROW_CAPS, ServerProcess, free_port

# What serving needs of the packaged model (its README, .gitattributes and data_config.json are
# not weights, configuration or tokenizer... data_config.json is JSON, so it comes along).
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.txt", "modules.json", "sentence_bert_config.json",
               "config_sentence_transformers.json", "data_config.json", "1_Pooling/config.json")
# Beside them in the bucket, as in real repositories: exports, a second copy of the weights, and
# a sibling model whose name starts with this one's.
NOT_NEEDED = ("onnx/model.onnx", "onnx/config.json", "openvino/openvino_model.xml", "pytorch_model.bin",
              "rust_model.ot", "tf_model.h5", "README.md")


@pytest.fixture(scope="module")
def s3(model_dir):
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3")
    client.create_bucket(Bucket="models")
    for name in MODEL_FILES:
        client.upload_file(str(Path(model_dir) / name), "models", f"minilm/v1/{name}")
    for name in NOT_NEEDED:
        client.put_object(Bucket="models", Key=f"minilm/v1/{name}", Body=b"not needed")
    client.put_object(Bucket="models", Key="minilm/v1-large/config.json", Body=b"{}")
    yield env
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_s3_download_is_complete_and_cached(s3, model_dir, tmp_path):
    target = resolve("s3://models/minilm/v1", str(tmp_path))
    got = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert got == sorted(MODEL_FILES)  # no exports, no second copy, nothing of minilm/v1-large
    assert (target / "model.safetensors").read_bytes() == (Path(model_dir) / "model.safetensors").read_bytes()
    (target / "vocab.txt").write_text("changed")  # a second resolve uses the cache, no download
    assert resolve("s3://models/minilm/v1", str(tmp_path)) == target
    assert (target / "vocab.txt").read_text() == "changed"


def test_s3_errors_are_clear_and_say_whether_retrying_can_help(s3, tmp_path, monkeypatch):
    with pytest.raises(ModelSourceError, match="no model files under nothing-here/") as empty:
        resolve("s3://models/nothing-here", str(tmp_path))
    with pytest.raises(ModelSourceError, match="S3 download failed.*NoSuchBucket") as no_bucket:
        resolve("s3://no-such-bucket/x", str(tmp_path))
    assert empty.value.permanent and no_bucket.value.permanent
    # An endpoint that does not answer may answer later (one attempt: botocore's own retries aside).
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(ModelSourceError, match="S3 download failed.*Could not connect") as unreachable:
        resolve("s3://models/minilm/v1", str(tmp_path / "other"))
    assert not unreachable.value.permanent and unreachable.value.__cause__ is not None


def test_server_serves_a_model_from_s3(s3, tmp_path, reference):
    server = ServerProcess({**s3, "MODEL_PATH": "s3://models/minilm/v1", "MODEL_CACHE_DIR": str(tmp_path),
                            "BATCH_CAPS": ONE_ROW_CAPS}).wait_ready()
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.target))
        out = decode_embeddings(stub.Embed(pb.EmbedRequest(texts=["served from s3"])))
        assert np.abs(out - reference.embed(["served from s3"])).max() <= 1e-5
    finally:
        assert server.stop() == 0


def test_only_what_serving_needs_is_downloaded_from_a_repository_listing():
    """sentence-transformers/all-MiniLM-L6-v2's files on the hub (2025), as the listing gives them."""
    listing = [".gitattributes", "1_Pooling/config.json", "README.md", "config.json", "config_sentence_transformers.json",
               "data_config.json", "model.safetensors", "modules.json", "onnx/model.onnx", "onnx/model_O1.onnx",
               "onnx/model_qint8_avx512.onnx", "openvino/openvino_model.bin", "openvino/openvino_model.xml",
               "pytorch_model.bin", "rust_model.ot", "sentence_bert_config.json", "special_tokens_map.json",
               "tf_model.h5", "tokenizer.json", "tokenizer_config.json", "train_script.py", "vocab.txt"]
    assert needed(listing) == [
        "1_Pooling/config.json", "config.json", "config_sentence_transformers.json", "data_config.json",
        "model.safetensors", "modules.json", "sentence_bert_config.json", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json", "vocab.txt"]
    # A module with only .bin weights keeps them; the repository's code only when trusted.
    older = ["config.json", "pytorch_model.bin", "2_Dense/config.json", "2_Dense/pytorch_model.bin", "modeling_x.py"]
    assert needed(older) == ["config.json", "pytorch_model.bin", "2_Dense/config.json", "2_Dense/pytorch_model.bin"]
    assert "modeling_x.py" in needed(older, trust_remote_code=True)


def test_hub_repo_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="cannot fetch from the hub .HF_HUB_OFFLINE is set") as offline:
        resolve("sentence-transformers/not-cached-here", str(tmp_path))
    assert not offline.value.permanent  # not in the cache, the hub not asked: it may be there


def test_missing_local_directory(tmp_path):
    with pytest.raises(ModelSourceError, match="no such model directory") as absent:
        resolve(str(tmp_path / "absent"), str(tmp_path))
    assert absent.value.permanent


def test_server_exits_nonzero_with_the_reason_when_the_model_is_missing(tmp_path):
    server = ServerProcess({"MODEL_PATH": str(tmp_path / "absent")})
    assert server.proc.wait(120) == 1
    assert "no such model directory" in server.log()
    server.stop()
