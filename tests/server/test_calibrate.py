"""Where QUANTIZE_RANGE=calibrated's calibration is made (embedserve.calibrate, and prefetch),
on a tiny real BERT (random weights, the packaged tokenizer): the file is keyed by the weights'
contents, a pod does not compute one too large for it and says what to run instead, and a
prefetch whose calibration fails has still fetched the model. Servers reading and computing it:
tests/server/test_calibrated_quantization.py; the file itself: tests/server/model/test_calibration.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from embedserve import calibrate
from embedserve.config import Settings
from embedserve.model import calibration
from embedserve.prepare import prepare

ROOT = Path(__file__).resolve().parents[2]


def save_tiny(path: Path, model_dir: str, seed: int) -> None:
    """A tiny BERT (hidden 32, 2 layers) with the packaged tokenizer, weights drawn from `seed`:
    another seed is a checkpoint retrained in place, its files the same sizes."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.model_max_length = 128
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertModel(config).eval().save_pretrained(path)
    tok.save_pretrained(path)


@pytest.fixture
def tiny(tmp_path, model_dir) -> Path:
    save_tiny(tmp_path / "tiny", model_dir, seed=0)
    return tmp_path / "tiny"


def settings(model: Path, cache: Path) -> Settings:
    return Settings.from_env({"MODEL_PATH": str(model), "MODEL_CACHE_DIR": str(cache), "QUANTIZE_RANGE": "calibrated"})


def test_a_checkpoint_retrained_in_place_at_the_same_sizes_gets_ranges_of_its_own(tiny, tmp_path, model_dir):
    """A local directory's revision names its weights by size: the calibration of the weights
    before was served for the new ones (silently other ranges than their vectors'). Keyed by the
    weights' contents, the new weights get their own."""
    s = settings(tiny, tmp_path / "cache")
    before = calibrate.calibrated(s, prepare(s))
    weights = tiny / "model.safetensors"
    size = weights.stat().st_size
    save_tiny(tiny, model_dir, seed=1)
    assert weights.stat().st_size == size  # the same sizes: the revision alone cannot tell
    after = calibrate.calibrated(s, prepare(s))
    assert after.digest != before.digest
    assert len(list((tmp_path / "cache" / calibration.DIRECTORY).glob("*.npz"))) == 2


def test_weights_are_hashed_again_only_when_their_size_or_mtime_changes(tiny, tmp_path):
    """What a start costs: each weights file read once per change (its digest kept in the cache by
    path, size and mtime_ns). So a file rewritten in place with its old size and mtime restored
    (which nothing but a deliberate `touch -d` does) keeps its old digest."""
    cache = tmp_path / "cache"
    weights = tiny / "model.safetensors"
    first = calibrate.contents_digest(tiny, cache)
    assert calibrate.contents_digest(tiny, cache) == first
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert calibrate.contents_digest(tiny, cache) == first  # the kept digest, by size and mtime
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert calibrate.contents_digest(tiny, cache) != first
    (tiny / "config.json").write_text((tiny / "config.json").read_text() + " ")  # the revision's to hash
    assert calibrate.contents_digest(tiny, cache) == calibrate.contents_digest(tiny, tmp_path / "other-cache")


def test_a_pod_does_not_compute_a_calibration_too_large_for_it_and_says_what_to_run(tiny, tmp_path, caplog):
    """Computing it takes a float32 copy of the weights on the CPU besides the served one (a 7B
    model's: ~30 GB, an OOM kill at every start). Above the bound a server's start fails saying
    what to run; a calibration prefetch put in the cache is read whatever the model's size."""
    from transformers import AutoModel

    params = sum(p.numel() for p in AutoModel.from_pretrained(tiny).parameters())
    assert calibrate.float32_bytes(tiny) == 4 * params  # from the safetensors headers
    s = settings(tiny, tmp_path / "cache")
    with pytest.raises(calibrate.TooLarge, match=r"python -m embedserve.prefetch.*QUANTIZE_RANGE to a number"):
        calibrate.calibrated(s, prepare(s), max_compute_bytes=4 * params - 1)
    assert not list((tmp_path / "cache").rglob("*.npz"))
    made = calibrate.calibrated(s, prepare(s), max_compute_bytes=None)  # prefetch's: no bound
    caplog.set_level(logging.INFO)
    assert calibrate.calibrated(s, prepare(s), max_compute_bytes=1).digest == made.digest
    assert "calibration: int8/uint8 ranges from" in caplog.text


def test_prefetch_whose_calibration_fails_has_fetched_the_model_and_exits_0(tiny, tmp_path):
    """A calibration that cannot be computed (here weights no CPU can load) is no reason for the
    fill Job to fail: it exited 1 and was retried forever. Now a warning, and 0."""
    (tiny / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}not safetensors")
    job = subprocess.run([sys.executable, "-m", "embedserve.prefetch"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": f"{ROOT / 'server'}:{ROOT}", "MODEL_PATH": str(tiny),
                              "MODEL_CACHE_DIR": str(tmp_path / "cache"), "QUANTIZE_RANGE": "calibrated"})
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.strip() == str(tiny)
    assert "prefetch: warning: QUANTIZE_RANGE=calibrated: the calibration was not computed" in job.stderr
    assert not list((tmp_path / "cache").rglob("*.npz"))
