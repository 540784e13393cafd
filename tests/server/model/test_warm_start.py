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
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from embedserve.model import warm_key, warm_start
from embedserve.model.batches import PackSpec
from embedserve.model.shapes import served_shapes
from embedserve.model.simulated import SimulatedAccelerator
from embedserve.model.warm_start import Unusable, WarmStart
from embedserve.model.worker import WarmupPlan, WarmupResult

NOW = 1_800_000_000.0
PLAN = WarmupPlan(buckets=(16, 32), max_batch_size=16, max_tokens_per_batch=512, static=False, fixed_caps=None,
                  pad_id=0, vocab_size=30522)
VERSIONS = {"torch": "2.13.0", "cuda": "", "transformers": "5.24.0", "embedserve": "0.2.0", "embedserve_code": "ab12"}
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


def key(revision="files:abc", device=warm_key.device_name("cpu", threads=2, cores=2), versions=VERSIONS, plan=PLAN,
        shaping=SHAPING):
    return warm_key.make_key(revision, device, "torch.float32", versions, plan, shaping)


def start(cache: Path, runner=None, plan=PLAN, k=None, mode="true", clock=None):
    """One start's warm-up: → (the result, its WarmStart, the runner)."""
    runner = runner or Recording()
    ws = WarmStart(cache, lambda: k or key(plan=plan), mode, **({"clock": clock} if clock else {}))
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
    # One batch per bucket at its cap, then the first timed again: the check, not the sweep the
    # first start ran.
    assert runner.shapes == [(16, first.caps[16]), (32, first.caps[32])] + [(16, first.caps[16])] * warm_start.RATE_PROBES
    assert len(first_runner.shapes) > 4 * len(runner.shapes)
    assert any("reused" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)


def test_with_static_shapes_every_captured_shape_is_run_again(tmp_path):
    plan = dataclasses.replace(PLAN, static=True, max_batch_size=32)
    first, _, _ = start(tmp_path, plan=plan)
    result, ws, runner = start(tmp_path, plan=plan)
    assert ws.state == "reused" and result.caps == first.caps
    shapes = served_shapes(plan.buckets, first.caps, True)
    assert runner.shapes == shapes + [shapes[0]] * warm_start.RATE_PROBES  # then the first, timed
    assert {length for length, _ in runner.shapes} == {8, 16, 24, 32}  # the midpoints too


@pytest.mark.parametrize("changed", [
    {"revision": "files:other"},  # another model (directory digest or hub commit)
    {"device": "NVIDIA H100 80GB HBM3"},
    {"device": warm_key.device_name("cpu", threads=2, cores=4)},  # another CPU limit (CFS quota): other rates
    {"device": warm_key.device_name("cpu", threads=4, cores=2)},
    {"versions": {**VERSIONS, "torch": "2.14.0"}},
    {"versions": {**VERSIONS, "embedserve": "0.3.0"}},
    {"versions": {**VERSIONS, "embedserve_code": "cd34"}},  # a commit that changed how the sweep measures
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
    # A writer of a shared cache setting the service-rate prior past any device: minutes to fade.
    "rate past any device": lambda p: _edit(p, lambda d: d["result"]["rates"].update({"16": 1e300})),
    # ... or past this device, under MAX_RATE: the timed probe batch bounds it (rates_problem).
    "rate 200 times this device's": lambda p: _edit(p, lambda d: d["result"]["rates"].update(
        {"32": 200 * d["result"]["rates"]["32"]})),
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


def test_a_cache_directory_in_the_way_of_a_file_is_a_warning(tmp_path, caplog):
    (tmp_path / warm_start.DIRECTORY).write_text("not a directory")
    result, ws, _ = start(tmp_path)
    assert ws.state == "measured" and set(result.caps) == set(PLAN.buckets)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("cannot save" in w and str(ws.path) in w for w in warnings), warnings
    assert [p.name for p in tmp_path.iterdir()] == [warm_start.DIRECTORY]


def test_a_read_only_cache_is_said_once_at_info_not_warned_of_at_every_start(tmp_path, caplog):
    """A pre-filled claim mounted readOnly: expected, so no warning every start (as root, which
    writes anywhere, the process takes another user's rights for the while)."""
    caplog.set_level(logging.INFO)
    cache = Path(tempfile.mkdtemp(prefix="warm-start-ro-"))  # not under pytest's 0700 base: readable by all
    cache.chmod(0o555)
    as_root = os.geteuid() == 0
    try:
        if as_root:
            os.seteuid(65534)
        result, ws, _ = start(cache)
    finally:
        if as_root:
            os.seteuid(0)
        cache.chmod(0o755)
        empty = not any(cache.iterdir())
        shutil.rmtree(cache)
    assert ws.state == "measured" and set(result.caps) == set(PLAN.buckets) and empty
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    (said,) = [r.getMessage() for r in caplog.records if "read-only" in r.getMessage()]
    assert "cannot keep it for the next" in said


def test_warm_start_off_neither_reads_nor_writes(warmed):
    cache, _, path, _ = warmed
    path.unlink()
    _, ws, _ = start(cache, mode="false")
    assert ws.state == "measured" and not any((cache / warm_start.DIRECTORY).iterdir())


def test_the_revision_of_a_hub_snapshot_is_its_commit(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "models--org--m" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    assert warm_key.revision(snapshot) == f"hub:{commit}"


def test_the_revision_of_a_directory_follows_its_files_but_not_the_weights_bytes(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 384}')
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    first = warm_key.revision(model)
    (model / "model.safetensors").write_bytes(b"\1" * 1000)  # same size: the probe's to catch
    assert warm_key.revision(model) == first
    (model / "model.safetensors").write_bytes(b"\1" * 1001)
    second = warm_key.revision(model)
    (model / "config.json").write_text('{"hidden_size": 768}')
    third = warm_key.revision(model)
    (model / "tokenizer.json").write_text("{}")
    assert len({first, second, third, warm_key.revision(model)}) == 4


@pytest.mark.parametrize("environ, device, compiles, expected", [
    ({}, "cuda", True, {"TORCHINDUCTOR_CACHE_DIR": "embedfleet-warmup/compile/inductor",
                        "TRITON_CACHE_DIR": "embedfleet-warmup/compile/triton"}),
    ({"TRITON_CACHE_DIR": "/mine"}, "cuda", True, {"TORCHINDUCTOR_CACHE_DIR": "embedfleet-warmup/compile/inductor"}),
    ({}, "cuda", False, {}),  # CUDA graphs alone compile nothing
    ({}, "cpu", True, {}),
])
def test_shared_torch_compile_caches_go_beside_the_warm_up_files(tmp_path, environ, device, compiles, expected):
    env = warm_start.compile_cache_env(environ, tmp_path, device, compiles, shared=True)
    assert env == {name: str(tmp_path / path) for name, path in expected.items()}
    assert all(Path(path).is_dir() for path in env.values())  # made, and written to (its probe file gone)
    assert all(not any(Path(path).iterdir()) for path in env.values())


def test_torch_compile_caches_stay_in_the_pod_unless_the_setting_shares_them(tmp_path):
    """Inductor unpickles and imports what its cache holds: on a cache volume other services
    write, theirs would be code run in this pod. By default (COMPILE_CACHE=pod) nothing is set and
    nothing is made under the cache."""
    from embedserve.config import Settings

    assert Settings.from_env({}).compile_cache == "pod"
    assert Settings.from_env({"COMPILE_CACHE": "shared"}).compile_cache == "shared"
    assert warm_start.compile_cache_env({}, tmp_path, "cuda", True) == {}
    assert not any(tmp_path.iterdir())


def test_torch_compile_caches_stay_in_their_defaults_where_the_cache_cannot_be_written(tmp_path, caplog):
    """Inductor raises on a cache directory it cannot make: a read-only cache would crash-loop the
    pod. (As root, which writes anywhere: a directory under a regular file cannot be made.)"""
    (tmp_path / "file").write_text("")
    assert warm_start.compile_cache_env({}, tmp_path / "file", "cuda", True, shared=True) == {}
    (said,) = [r for r in caplog.records if "torch.compile" in r.getMessage()]
    assert str(tmp_path / "file") in said.getMessage() and "defaults" in said.getMessage()


def test_packed_measurements_round_trip_and_are_checked_against_the_plan():
    plan = dataclasses.replace(PLAN, static=True, max_tokens_per_batch=256)
    spec = PackSpec.for_plan(32, plan.max_batch_size, plan.max_tokens_per_batch, True)
    result = WarmupResult({}, {128: 5000.0}, spec, 128)
    probe = {"values": [0.1] * 8, "norm": 1.0, "sum": 2.0, "dim": 384}
    doc = json.loads(json.dumps(warm_start.encode(key(plan=plan), result, probe, NOW, "pod-a")))
    assert warm_start.decode(doc, key(plan=plan), plan, NOW) == (result, probe)
    for budget in (16, 100, 512):  # below the longest row, not a captured size, above the most tokens
        bad = json.loads(json.dumps(warm_start.encode(key(plan=plan), WarmupResult({}, {budget: 1.0}, spec, budget),
                                                      probe, NOW, "pod-a")))
        with pytest.raises(Unusable, match="token budget"):
            warm_start.decode(bad, key(plan=plan), plan, NOW)


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


# Staleness: measured_at and the host are kept; a file past MAX_AGE_S, and WARM_START=refresh, measure again.

def test_a_file_older_than_its_age_limit_is_measured_again_without_a_warning(warmed, caplog):
    cache, _, path, _ = warmed
    doc = json.loads(path.read_text())
    assert doc["host"] and abs(doc["measured_at"] - __import__("time").time()) < 600
    caplog.set_level(logging.INFO)
    late = doc["measured_at"] + warm_start.MAX_AGE_S + 3600
    _, ws, runner = start(cache, clock=lambda: late)
    assert ws.state == "measured" and len(runner.shapes) > len(PLAN.buckets) + 1
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any(str(path) in r.getMessage() and "days ago" in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text())["measured_at"] == late  # rewritten: the next start reuses it
    assert start(cache, clock=lambda: late + 60)[1].state == "reused"


def test_refresh_measures_and_overwrites_a_good_file(warmed):
    cache, _, path, _ = warmed
    before = json.loads(path.read_text())["measured_at"]
    _, ws, runner = start(cache, mode="refresh", clock=lambda: before + 10)
    assert ws.state == "measured" and len(runner.shapes) > len(PLAN.buckets) + 1
    assert json.loads(path.read_text())["measured_at"] == before + 10
    assert start(cache)[1].state == "reused"
    with pytest.raises(ValueError, match="refresh"):
        WarmStart(cache, key, "sometimes")


@pytest.mark.parametrize("value, mode", [(None, "true"), ("refresh", "refresh"), ("REFRESH", "refresh"), ("yes", "true"),
                                         ("true", "true"), ("off", "false"), ("0", "false")])
def test_warm_start_reads_true_false_in_any_boolean_spelling_and_refresh(value, mode):
    from embedserve.config import ConfigError, Settings

    assert Settings.from_env({} if value is None else {"WARM_START": value}).warm_start == mode
    with pytest.raises(ConfigError, match="WARM_START='sometimes'.*refresh"):
        Settings.from_env({"WARM_START": "sometimes"})


def test_a_stale_temporary_file_is_removed_on_save_and_a_fresh_one_kept(tmp_path):
    directory = tmp_path / warm_start.DIRECTORY
    directory.mkdir()
    stale, fresh = directory / ".x.json.1.tmp", directory / ".x.json.2.tmp"
    for f in (stale, fresh):
        f.write_text("{")
    os.utime(stale, (0, __import__("time").time() - warm_start.STALE_TMP_S - 60))
    start(tmp_path)
    assert not stale.exists() and fresh.exists()


# The probe's tolerance: kernel noise passes, other weights do not, whatever the output's size.

def _probe(row):
    return warm_start.probe_of(np.asarray([row]))


@pytest.mark.parametrize("dim, scale", [(384, 1.0), (1, 0.003), (1, 4.0)])  # a normalized embedding; logits
def test_the_probe_accepts_kernel_noise_and_refuses_other_weights(dim, scale):
    rng = np.random.default_rng(dim)
    row = rng.normal(size=dim)
    row = row / np.linalg.norm(row) * scale if dim > 1 else np.array([scale])
    noise = rng.normal(scale=0.004, size=dim) * max(1.0, np.abs(row).max())  # bf16's rounding, a few times over
    assert warm_start.probe_differs(_probe(row + noise), _probe(row)) is None
    other = rng.normal(size=dim)
    other = other / np.linalg.norm(other) * scale if dim > 1 else np.array([scale + 1.5])  # another model's logit
    assert "not the ones measured" in warm_start.probe_differs(_probe(other), _probe(row))


# The key app.Server builds (warm_key.server_key): each input that shapes the measurements changes it.

def test_every_input_that_shapes_the_measurements_changes_the_servers_key():
    import torch

    from embedserve.model.encoder import Placement

    placement = Placement(torch.device("cuda:0"), torch.bfloat16, False, True, True, "padded")
    base = dict(revision_="hub:" + "0" * 40, device="NVIDIA H200 sm_90 132 SMs 143000 MiB driver 12080",
                versions=VERSIONS, plan=PLAN, placement=placement, task="embed", head={"pooling": "mean"},
                exclude_ids=[101, 102], trust_remote_code=False)
    changes = {
        "attention": {"placement": dataclasses.replace(placement, attention="packed")},
        "cuda_graphs": {"placement": dataclasses.replace(placement, cuda_graphs=False)},
        "static shapes": {"placement": dataclasses.replace(placement, static_shapes=False)},
        "compile": {"placement": dataclasses.replace(placement, compile=True)},
        "dtype": {"placement": dataclasses.replace(placement, dtype=torch.float16)},
        "device index": {"placement": dataclasses.replace(placement, device=torch.device("cuda:1"))},
        "buckets": {"plan": dataclasses.replace(PLAN, buckets=(16, 32, 64))},
        "max batch size": {"plan": dataclasses.replace(PLAN, max_batch_size=32)},
        "max tokens": {"plan": dataclasses.replace(PLAN, max_tokens_per_batch=1024)},
        "batch caps": {"plan": dataclasses.replace(PLAN, fixed_caps={16: 8, 32: 8})},
        "head": {"head": {"pooling": "cls"}},
        "no head": {"head": None},
        "task": {"task": "rerank"},
        "exclude tokens": {"exclude_ids": [101]},
        "remote code": {"trust_remote_code": True},
        "revision": {"revision_": "hub:" + "1" * 40},
        "GPU": {"device": "NVIDIA H200 sm_90 132 SMs 143000 MiB driver 12090"},
        "code": {"versions": {**VERSIONS, "embedserve_code": "ef56"}},
    }
    names = {"base": warm_start.file_for("/c", warm_key.server_key(**base))}
    for what, change in changes.items():
        names[what] = warm_start.file_for("/c", warm_key.server_key(**{**base, **change}))
    assert len(set(names.values())) == len(names), names
    # The same inputs, the same file: exclude_ids in another order too.
    assert warm_key.server_key(**{**base, "exclude_ids": [102, 101]}) == warm_key.server_key(**base)


def test_the_device_names_what_one_model_name_hides():
    assert warm_key.device_name("cpu", threads=2, cores=2) != warm_key.device_name("cpu", threads=2, cores=1)
    assert warm_key.device_name("cuda", "NVIDIA A100 sm_80 98 SMs 40000 MiB driver 1") == \
        "NVIDIA A100 sm_80 98 SMs 40000 MiB driver 1"
    assert warm_key.device_name("cpu", sim_rate=5e6) == "simulated 5e+06 tokens/s"
    assert len(warm_key.code_digest()) == 16 and warm_key.code_digest() == warm_key.code_digest()


# Packed rows through WarmStart: the token budget measured, saved, reused after one batch per stream size.

class PackedRows:
    """A packed-rows runner: each row the mean of its tokens' vectors in a fixed table (a real,
    if tiny, model of what packed attention returns: one vector per row)."""

    attention = "packed"
    table = np.random.default_rng(1).normal(size=(30522, 32)).astype(np.float32)

    def __init__(self, shift: float = 0.0):
        self.dim, self.shift = 32, shift
        self.tokens: list[int] = []

    def run(self, batch):
        self.tokens.append(int(batch.input_ids.shape[0]))
        ids, cu = batch.input_ids.numpy(), batch.cu_seqlens.numpy()
        return np.stack([self.table[ids[cu[i]:cu[i + 1]]].mean(axis=0) for i in range(batch.rows)]) + self.shift

    def memory(self):
        return {}


def test_packed_rows_are_reused_after_one_batch_per_stream_size_and_a_changed_model_refused(tmp_path, caplog):
    plan = dataclasses.replace(PLAN, static=True, max_tokens_per_batch=256)
    first, ws, runner = start(tmp_path, runner=PackedRows(), plan=plan)
    assert ws.state == "measured" and first.packing and first.token_budget
    again, ws, runner2 = start(tmp_path, runner=PackedRows(), plan=plan)
    assert ws.state == "reused" and again == first
    sizes = [t for t in first.packing.ladder if t <= first.token_budget]
    assert runner2.tokens == sizes + [sizes[0]] * warm_start.RATE_PROBES
    assert len(runner.tokens) > len(runner2.tokens)
    _, ws, _ = start(tmp_path, runner=PackedRows(shift=0.5), plan=plan)
    assert ws.state == "measured"
    assert any("probe" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
