"""A hub model in a filled MODEL_CACHE_DIR, as the operator's fill Job leaves it (the real
huggingface_hub client against a hub on loopback, through `python -m embedserve.prefetch`): read
back with no network call, whether the hub is unreachable or HF_HUB_OFFLINE says so, read-only,
at the revision MODEL_REVISION names."""

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import decode_embeddings
from embedserve import prefetch
from embedserve.model import source
from tests.conftest import ONE_ROW_CAPS, ServerProcess
from tests.server.model.fake_hub import FakeHub, SilentPort

REPO = "org/minilm"
PACKAGED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "vocab.txt", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
            "1_Pooling/config.json")
ROOT = Path(__file__).resolve().parents[3]


def run(module_code: list[str], env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": f"{ROOT / 'server'}:{ROOT}", "HF_HUB_DISABLE_PROGRESS_BARS": "1", **env}
    return subprocess.run([sys.executable, *module_code], env=full, capture_output=True, text=True, timeout=timeout)


RESOLVE = ("import os, sys; from embedserve.model.source import resolve; "
           "print(resolve(os.environ['MODEL_PATH'], os.environ['MODEL_CACHE_DIR'], False, os.environ.get('MODEL_REVISION', '')))")


def read_only(root: Path) -> None:
    """As a readOnly volume mount: nothing under it can be written."""
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.fixture(scope="module")
def filled(model_dir, tmp_path_factory):
    """The cache the fill Job leaves: revision v1 is the packaged model; main is something else
    (a newer commit the fleet must not pick up), and the repository carries an ONNX export."""
    files = {name: (Path(model_dir) / name).read_bytes() for name in PACKAGED}
    hub = FakeHub(REPO, {"v1": {**files, "onnx/model.onnx": b"export"},
                         "main": {**files, "config.json": b'{"model_type": "not-this-one"}'}})
    cache = tmp_path_factory.mktemp("filled")
    job = run(["-m", "embedserve.prefetch"], {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "", "MODEL_PATH": REPO,
                                              "MODEL_REVISION": "v1", "MODEL_CACHE_DIR": str(cache)})
    hub.close()
    assert job.returncode == 0, job.stderr
    snapshot = Path(job.stdout.strip().splitlines()[-1])
    assert snapshot.parent.name == "snapshots" and snapshot.name == hub.refs["v1"]  # the commit v1 names
    assert not any("onnx" in path for path in hub.requests if "/resolve/" in path)  # only what serving needs
    # The tag resolved once, and every file fetched at the commit it named then: a branch or tag
    # that moves during the download cannot mix two commits' files.
    assert hub.requests[f"/api/models/{REPO}/revision/v1"] == 1
    downloads = [path for path in hub.requests if "/resolve/" in path]
    assert downloads and all(f"/resolve/{hub.refs['v1']}/" in path for path in downloads), downloads
    assert (snapshot.parent.parent / "refs" / "v1").read_text() == hub.refs["v1"]  # offline reads find it
    read_only(cache)
    yield cache, snapshot
    for p in [cache, *cache.rglob("*")]:  # let pytest clean up
        if not p.is_symlink():
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


def test_prefetch_downloads_the_revision_asked_for(filled, model_dir):
    _, snapshot = filled
    assert sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()) == sorted(PACKAGED)
    assert (snapshot / "config.json").read_bytes() == (Path(model_dir) / "config.json").read_bytes()


def test_a_filled_cache_is_read_without_any_network_call(filled):
    """HF_HUB_OFFLINE unset and the hub's address answering nothing: a client that asked it
    anything would hang until its timeout, and the port would have seen the connection."""
    cache, snapshot = filled
    hub = SilentPort()
    try:
        started = time.monotonic()
        out = run(["-c", RESOLVE], {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "", "MODEL_PATH": REPO,
                                    "MODEL_REVISION": "v1", "MODEL_CACHE_DIR": str(cache)})
        took = time.monotonic() - started
    finally:
        hub.close()
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == snapshot
    assert hub.accepted == 0 and took < 20, (hub.accepted, took)


def test_a_record_of_other_selection_rules_or_with_a_file_gone_is_not_trusted(filled, tmp_path):
    """The record says "complete" for the files chosen under the rules of its writer: a server
    whose rules differ (SELECTION), or a snapshot missing one of them, fetches again."""
    cache, snapshot = filled
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy, symlinks=True)
    assert source.fetched(REPO, str(copy), revision="v1") == copy / snapshot.relative_to(cache)
    record_file = next((copy / source.FETCHED).iterdir())
    record = json.loads(record_file.read_text())
    record_file.chmod(0o644)
    record_file.write_text(json.dumps({**record, "selection": "older-rules"}))
    assert source.fetched(REPO, str(copy), revision="v1") is None
    record_file.write_text(json.dumps(record))
    assert source.fetched(REPO, str(copy), revision="v1") is not None
    (copy / snapshot.relative_to(cache)).chmod(0o755)
    (copy / snapshot.relative_to(cache) / "vocab.txt").unlink()
    assert source.fetched(REPO, str(copy), revision="v1") is None


def test_a_record_naming_a_snapshot_outside_the_cache_is_not_followed(filled, tmp_path, model_dir, caplog):
    """A writer of a shared cache writes its fetch records too: a record must not make a pod load
    a model from anywhere but the cache (an absolute path, `..`, a link out of it), nor a file
    named in it lead out of the cache. Each is ignored with a warning, and the model fetched again."""
    import logging

    cache, snapshot = filled
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy, symlinks=True)
    outside = tmp_path / "elsewhere"  # a whole model, outside the cache
    shutil.copytree(model_dir, outside)
    record_file = next((copy / source.FETCHED).iterdir())
    record_file.chmod(0o644)
    record = json.loads(record_file.read_text())
    (copy / "models--org--minilm").chmod(0o755)
    (copy / "models--org--minilm" / "out").symlink_to(outside, target_is_directory=True)
    caplog.set_level(logging.WARNING)
    for forged in ({"snapshot": str(outside)}, {"snapshot": "../elsewhere"},
                   {"snapshot": "models--org--minilm/../../elsewhere"}, {"snapshot": "models--org--minilm/out"},
                   {"files": [*record["files"], "../../../../../../../../etc/hostname"]}):
        record_file.write_text(json.dumps({**record, **forged}))
        caplog.clear()
        assert source.fetched(REPO, str(copy), revision="v1") is None, forged
        assert [r for r in caplog.records if str(record_file) in r.getMessage()], forged
    record_file.write_text(json.dumps(record))
    assert source.fetched(REPO, str(copy), revision="v1") == copy / snapshot.relative_to(cache)


def test_a_record_through_a_loop_of_links_or_past_its_bounds_is_ignored(filled, tmp_path, caplog):
    """A loop of links made Path.resolve raise RuntimeError (Python 3.11), which nothing caught:
    every pod sharing the cache crashed at start-up. A record is also read within bounds (its
    size, its count of files), and what is returned is the path that was checked, resolved."""
    import logging

    cache, snapshot = filled
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy, symlinks=True)
    record_file = next((copy / source.FETCHED).iterdir())
    record_file.chmod(0o644)
    record = json.loads(record_file.read_text())
    (copy / "models--org--minilm").chmod(0o755)
    (copy / "models--org--minilm" / "a").symlink_to("b")
    (copy / "models--org--minilm" / "b").symlink_to("a")
    copied = copy / snapshot.relative_to(cache)
    copied.chmod(0o755)
    (copied / "x").symlink_to("y")
    (copied / "y").symlink_to("x")
    caplog.set_level(logging.WARNING)
    for forged in ({"snapshot": "models--org--minilm/a"}, {"files": [*record["files"], "x/config.json"]},
                   {"files": ["config.json"] * (source.MAX_RECORD_FILES + 1)},
                   {"padding": "x" * source.MAX_RECORD_BYTES}):
        record_file.write_text(json.dumps({**record, **forged}))
        caplog.clear()
        assert source.fetched(REPO, str(copy), revision="v1") is None, list(forged)
        assert [r for r in caplog.records if str(record_file) in r.getMessage()], list(forged)
    record_file.write_text(json.dumps(record))
    assert source.fetched(REPO, str(copy), revision="v1") == copied.resolve()


def test_offline_reads_the_snapshot_of_the_revision(filled):
    cache, snapshot = filled
    out = run(["-c", RESOLVE], {"HF_HUB_OFFLINE": "1", "MODEL_PATH": REPO, "MODEL_REVISION": "v1",
                                "MODEL_CACHE_DIR": str(cache)})
    assert out.returncode == 0 and Path(out.stdout.strip()) == snapshot, out.stderr
    # A revision this cache never fetched is not another one's snapshot: a clear error.
    out = run(["-c", RESOLVE], {"HF_HUB_OFFLINE": "1", "MODEL_PATH": REPO, "MODEL_REVISION": "v2",
                                "MODEL_CACHE_DIR": str(cache)})
    assert out.returncode != 0 and "'org/minilm'@v2: cannot fetch from the hub (HF_HUB_OFFLINE is set" in out.stderr


def test_prefetch_fails_with_the_reason_and_says_whether_retrying_can_help(tmp_path):
    """A revision the hub lacks is refused (prefetch.REFUSED: the fill Job fails at once); the hub
    answering 503 may pass (1: the Job retries), as may any traceback."""
    hub = FakeHub(REPO, {"main": {"config.json": b"{}"}})
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "", "MODEL_PATH": REPO, "MODEL_CACHE_DIR": str(tmp_path)}
    try:
        refused = run(["-m", "embedserve.prefetch"], {**env, "MODEL_REVISION": "no-such-tag"})
        hub.unavailable = True
        down = run(["-m", "embedserve.prefetch"], {**env, "MODEL_REVISION": "main"})
    finally:
        hub.close()
    assert refused.returncode == prefetch.REFUSED == 3, refused.stderr
    assert "prefetch failed: MODEL_PATH='org/minilm'@no-such-tag" in refused.stderr
    assert down.returncode == 1 != prefetch.REFUSED, down.stderr
    assert "prefetch failed: MODEL_PATH='org/minilm'@main: cannot fetch from the hub" in down.stderr and "503" in down.stderr
    assert hub.requests[f"/api/models/{REPO}/revision/main"] == 1  # it was the hub's answer, not a client's refusal


def test_a_server_serves_from_a_read_only_filled_cache_with_the_hub_unreachable(filled, reference):
    cache, _ = filled
    hub = SilentPort()
    server = ServerProcess({"MODEL_PATH": REPO, "MODEL_REVISION": "v1", "MODEL_CACHE_DIR": str(cache),
                            "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "", "BATCH_CAPS": ONE_ROW_CAPS,
                            "WARM_START": "false"})
    try:
        server.wait_ready()
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.target))
        out = decode_embeddings(stub.Embed(pb.EmbedRequest(texts=["from a mounted cache"])))
        assert np.abs(out - reference.embed(["from a mounted cache"])).max() <= 1e-5
        assert hub.accepted == 0
    finally:
        hub.close()
        assert server.stop() == 0
