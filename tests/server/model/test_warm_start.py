"""Warm start (embedserve.model.warm_start): the warm-up measured once, saved under the cache
directory, reused by a start of the same key after checking one batch per shape; refused, with a
warning naming the file, when the key differs, the file is damaged or makes no sense, or the
model no longer gives the probe's output. The device is the simulated accelerator (a real
runner, milliseconds per batch); `Recording` notes every batch it is asked to run, so a test can
tell a sweep from a check."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from embedserve.model import warm_start
from embedserve.model.batches import PackSpec
from embedserve.model.shapes import served_shapes
from embedserve.model.simulated import SimulatedAccelerator
from embedserve.model.warm_start import Unusable, WarmStart
from embedserve.model.worker import WarmupPlan, WarmupResult

PLAN = WarmupPlan(buckets=(16, 32), max_batch_size=16, max_tokens_per_batch=512, static=False, fixed_caps=None,
                  pad_id=0, vocab_size=30522)
VERSIONS = {"torch": "2.13.0", "cuda": "", "transformers": "5.24.0", "embedserve": "0.2.0"}
SHAPING = {"compile": False, "attention": "padded", "task": "embed"}


class Recording:
    """A runner that runs another and notes each batch's (padded length, rows); `shift` adds to
    every output (a model whose weights changed), `nan` makes them non-finite."""

    device = None  # one simulated device for all (its projection takes a while to draw)

    def __init__(self, shift: float = 0.0, nan: bool = False):
        Recording.device = self.inner = Recording.device or SimulatedAccelerator(2e7)
        self.dim = self.inner.dim
        self.shift, self.nan = shift, nan
        self.shapes: list[tuple[int, int]] = []

    def run(self, batch):
        self.shapes.append(tuple(batch.input_ids.shape[::-1]))
        out = self.inner.run(batch) + self.shift
        return out * np.nan if self.nan else out

    def memory(self):
        return {}


def key(revision="files:abc", device="cpu Test CPU threads=2", versions=VERSIONS, plan=PLAN, shaping=SHAPING):
    return warm_start.make_key(revision, device, "torch.float32", versions, plan, shaping)


def start(cache: Path, runner=None, plan=PLAN, k=None, enabled=True):
    """One start's warm-up: → (the result, its WarmStart, the runner)."""
    runner = runner or Recording()
    ws = WarmStart(cache, lambda: k or key(plan=plan), enabled)
    return ws.warm(runner, plan), ws, runner


@pytest.fixture
def warmed(tmp_path):
    """A cache directory holding the file of a first (measured) start."""
    result, ws, runner = start(tmp_path)
    assert ws.state == "measured" and ws.path.is_file()
    return tmp_path, result, ws.path, runner


def test_a_second_start_with_the_same_key_reuses_without_a_sweep(warmed, caplog):
    cache, first, path, first_runner = warmed
    caplog.set_level(logging.INFO)
    result, ws, runner = start(cache)
    assert ws.state == "reused" and ws.path == path
    assert (result.caps, result.rates) == (first.caps, first.rates)
    assert result.service_rate == first.service_rate and result.largest_batch_s == first.largest_batch_s
    # One batch per bucket at its cap: the check, not the sweep the first start ran.
    assert runner.shapes == [(16, first.caps[16]), (32, first.caps[32])]
    assert len(first_runner.shapes) > 4 * len(runner.shapes)
    assert any("reused" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)


def test_with_static_shapes_every_captured_shape_is_run_again(tmp_path):
    plan = dataclasses.replace(PLAN, static=True, max_batch_size=32)
    first, _, _ = start(tmp_path, plan=plan)
    result, ws, runner = start(tmp_path, plan=plan)
    assert ws.state == "reused" and result.caps == first.caps
    assert runner.shapes == served_shapes(plan.buckets, first.caps, True)
    assert {length for length, _ in runner.shapes} == {8, 16, 24, 32}  # the midpoints too


@pytest.mark.parametrize("changed", [
    {"revision": "files:other"},  # another model (directory digest or hub commit)
    {"device": "NVIDIA H100 80GB HBM3"},
    {"device": "cpu Test CPU threads=4"},  # another CPU limit: other rates
    {"versions": {**VERSIONS, "torch": "2.14.0"}},
    {"versions": {**VERSIONS, "embedserve": "0.3.0"}},
    {"plan": dataclasses.replace(PLAN, max_batch_size=8)},
    {"plan": dataclasses.replace(PLAN, fixed_caps={16: 4, 32: 4})},
    {"shaping": {**SHAPING, "compile": True}},
])
def test_another_key_is_refused_even_under_the_same_file_name(warmed, changed, caplog):
    cache, _, path, _ = warmed
    other = key(**changed)
    plan = changed.get("plan", PLAN)
    # Its own file name differs: nothing to reuse.
    result, ws, runner = start(cache, plan=plan, k=other)
    assert ws.state == "measured" and ws.path != path
    # A file copied under its name is read, and its key (stored whole) compared.
    ws.path.write_bytes(path.read_bytes())
    result, ws, runner = start(cache, plan=plan, k=other)
    assert ws.state == "measured"
    assert any("another key" in r.getMessage() and str(ws.path) in r.getMessage() for r in caplog.records)


def _edit(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


DAMAGE = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "garbage": lambda p: p.write_bytes(os.urandom(300)),
    "a JSON list": lambda p: p.write_text("[1, 2]"),
    "huge": lambda p: p.write_text(" " * (warm_start.MAX_FILE_BYTES + 1)),
    "another schema": lambda p: _edit(p, lambda d: d.update(schema=0)),
    "no result": lambda p: _edit(p, lambda d: d.pop("result")),
    "cap zero": lambda p: _edit(p, lambda d: d["result"]["caps"].update({"16": 0})),
    "cap above the row limit": lambda p: _edit(p, lambda d: d["result"]["caps"].update({"32": 17})),
    "cap not a number": lambda p: _edit(p, lambda d: d["result"]["caps"].update({"32": "8"})),
    "a bucket missing": lambda p: _edit(p, lambda d: d["result"]["caps"].pop("32")),
    "negative rate": lambda p: _edit(p, lambda d: d["result"]["rates"].update({"16": -5.0})),
    "NaN rate": lambda p: _edit(p, lambda d: d["result"]["rates"].update({"16": float("nan")})),  # json reads NaN
    "infinite probe": lambda p: _edit(p, lambda d: d["probe"].update(norm=float("inf"))),
    "no probe": lambda p: _edit(p, lambda d: d.pop("probe")),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_or_nonsensical_file_is_warned_of_and_the_warm_up_measured(warmed, damage, caplog):
    cache, first, path, _ = warmed
    DAMAGE[damage](path)
    caplog.set_level(logging.INFO)
    result, ws, runner = start(cache)
    assert ws.state == "measured"
    assert len(runner.shapes) > len(PLAN.buckets) + 1  # a sweep ran
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0], warnings
    # ... and the file was written anew: the next start reuses it.
    assert start(cache)[1].state == "reused"


def test_a_model_whose_weights_changed_under_the_same_key_fails_the_probe(warmed, caplog):
    cache, _, path, _ = warmed
    result, ws, runner = start(cache, runner=Recording(shift=0.05))
    assert ws.state == "measured"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(path) in warning and "probe" in warning
    # Its own output was saved instead: reused by the next start of the changed model.
    assert start(cache, runner=Recording(shift=0.05))[1].state == "reused"


def test_non_finite_outputs_of_a_checked_batch_refuse_the_file(warmed, caplog):
    cache, _, path, _ = warmed
    _, ws, runner = start(cache, runner=Recording(nan=True))
    assert ws.state == "measured" and len(runner.shapes) > len(PLAN.buckets) + 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(path) in warnings[0] and "non-finite" in warnings[0]


@pytest.mark.parametrize("how", ["a file in the way", "read-only"])
def test_a_cache_directory_that_cannot_be_written_is_a_warning(tmp_path, how, caplog):
    if how == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        tmp_path.chmod(0o555)
    else:
        (tmp_path / warm_start.DIRECTORY).write_text("not a directory")
    try:
        result, ws, _ = start(tmp_path)
    finally:
        tmp_path.chmod(0o755)
    assert ws.state == "measured" and set(result.caps) == set(PLAN.buckets)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("cannot save" in w and str(ws.path) in w for w in warnings), warnings
    assert [p.name for p in tmp_path.iterdir()] == ([warm_start.DIRECTORY] if how != "read-only" else [])


def test_warm_start_off_neither_reads_nor_writes(warmed):
    cache, _, path, _ = warmed
    path.unlink()
    _, ws, _ = start(cache, enabled=False)
    assert ws.state == "measured" and not any((cache / warm_start.DIRECTORY).iterdir())


def test_the_revision_of_a_hub_snapshot_is_its_commit(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "models--org--m" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    assert warm_start.revision(snapshot) == f"hub:{commit}"


def test_the_revision_of_a_directory_follows_its_files_but_not_the_weights_bytes(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 384}')
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    first = warm_start.revision(model)
    (model / "model.safetensors").write_bytes(b"\1" * 1000)  # same size: the probe's to catch
    assert warm_start.revision(model) == first
    (model / "model.safetensors").write_bytes(b"\1" * 1001)
    second = warm_start.revision(model)
    (model / "config.json").write_text('{"hidden_size": 768}')
    third = warm_start.revision(model)
    (model / "tokenizer.json").write_text("{}")
    assert len({first, second, third, warm_start.revision(model)}) == 4


@pytest.mark.parametrize("environ, device, compiles, expected", [
    ({}, "cuda", True, {"TORCHINDUCTOR_CACHE_DIR": "/c/embedfleet-warmup/compile/inductor",
                        "TRITON_CACHE_DIR": "/c/embedfleet-warmup/compile/triton"}),
    ({"TRITON_CACHE_DIR": "/mine"}, "cuda", True, {"TORCHINDUCTOR_CACHE_DIR": "/c/embedfleet-warmup/compile/inductor"}),
    ({}, "cuda", False, {}),  # CUDA graphs alone compile nothing
    ({}, "cpu", True, {}),
])
def test_torch_compile_caches_go_beside_the_warm_up_files(environ, device, compiles, expected):
    assert warm_start.compile_cache_env(environ, "/c", device, compiles) == expected


def test_packed_measurements_round_trip_and_are_checked_against_the_plan():
    plan = dataclasses.replace(PLAN, static=True, max_tokens_per_batch=256)
    spec = PackSpec.for_plan(32, plan.max_batch_size, plan.max_tokens_per_batch, True)
    result = WarmupResult({}, {128: 5000.0}, spec, 128)
    probe = {"values": [0.1] * 8, "norm": 1.0, "sum": 2.0}
    doc = json.loads(json.dumps(warm_start.encode(key(plan=plan), result, probe)))
    assert warm_start.decode(doc, key(plan=plan), plan) == (result, probe)
    for budget in (16, 100, 512):  # below the longest row, not a captured size, above the most tokens
        bad = json.loads(json.dumps(warm_start.encode(key(plan=plan), WarmupResult({}, {budget: 1.0}, spec, budget),
                                                      probe)))
        with pytest.raises(Unusable, match="token budget"):
            warm_start.decode(bad, key(plan=plan), plan)


def test_a_key_that_cannot_be_made_measures_and_saves_nothing(tmp_path, caplog):
    def no_key():
        raise OSError("the model directory went away")

    ws = WarmStart(tmp_path, no_key)
    result = ws.warm(Recording(), PLAN)
    assert ws.state == "measured" and set(result.caps) == set(PLAN.buckets) and not any(tmp_path.iterdir())
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "went away" in warning


class FailingOnce(Recording):
    """A device whose first batch fails (a checked one), then recovers."""

    def run(self, batch):
        if not self.shapes:
            self.shapes.append((0, 0))
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().run(batch)


def test_a_checked_batch_that_fails_is_a_warning_and_the_sweep_decides(warmed, caplog):
    cache, _, path, _ = warmed
    _, ws, runner = start(cache, runner=FailingOnce())
    assert ws.state == "measured" and len(runner.shapes) > len(PLAN.buckets) + 1
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(path) in warning and "illegal memory access" in warning
    assert path.stat().st_mode & 0o777 == 0o644  # readable by pods of other users on a shared volume
