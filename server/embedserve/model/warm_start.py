"""Warm start: the warm-up's measurements (each bucket's cap and rate, or packed rows' token
budget) kept as a file in the model cache directory and reused by the next start whose key
matches, so it skips the sweep (most of a start on a CPU; on a GPU the sweep and the captures of
sizes it then discards). The key names everything the measurements depend on: the model's
revision, the device, dtype, library versions and the settings that shape the batches.

A reused file is checked, never trusted: the start still runs one batch per shape the batcher
can form (with static shapes that is the capture, needed anyway), each must give finite outputs
of the right shape, and one fixed probe batch must give what it gave when the file was written
(weights replaced under the same name and sizes). Any file that cannot be read, does not parse,
has another schema or key, holds caps the batcher cannot form or rates that are not positive, or
fails the checks: a warning naming it and why, then the sweep. Failing to write one (a read-only
volume) is a warning too: the server serves either way.

File: <MODEL_CACHE_DIR>/embedfleet-warmup/<sha256 of the key>.json, written atomically."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import re
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from embedserve.model.batches import Batch, PackedBatch, PackSpec, random_packed
from embedserve.model.shapes import LADDER, bucket_row_limit, served_shapes
from embedserve.model.sparse_rows import SparseRows
from embedserve.model.worker import SWEEP_MAX_BATCH_S, SWEEP_MAX_REPEATS, SWEEP_MIN_TIMING_S, Runner, WarmupPlan, \
    WarmupResult, dummy_batch, warm_up

log = logging.getLogger(__name__)

DIRECTORY = "embedfleet-warmup"
# Bumped when the file's layout or the sweep's way of choosing changes: older files are refused.
SCHEMA = 1
MAX_FILE_BYTES = 1 << 20  # a warm-up file is a few kB: anything larger is not one
PROBE_SEED = 20261202
PROBE_VALUES = 8
# The probe must survive the same model on the same device giving slightly different numbers
# (autotuned kernels, another CUDA graph capture): entries may differ by 2% of themselves plus 5%
# of the row's typical entry. Other weights differ by about a whole typical entry in every value.
PROBE_RTOL, PROBE_ATOL = 0.02, 0.05
# Model files whose contents name a revision: configuration, tokenizer, the repository's code.
# Weights are named by their size only (hashing gigabytes at every start would cost what the
# sweep does); weights replaced at the same size are what the probe catches.
DESCRIPTIVE = (".json", ".txt", ".model", ".tiktoken", ".py")
DESCRIPTIVE_MAX_BYTES = 64 << 20
HUB_SNAPSHOT = re.compile(r"[0-9a-f]{40}")


class Unusable(ValueError):
    """Why a warm-up file cannot be used."""


def revision(model_dir: str | os.PathLike) -> str:
    """The model's revision: a hub snapshot's commit (its directory is .../snapshots/<commit>),
    else a digest of the directory's file names and sizes and its configuration and tokenizer
    files' contents."""
    path = Path(model_dir)
    if path.parent.name == "snapshots" and HUB_SNAPSHOT.fullmatch(path.name):
        return f"hub:{path.name}"
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
        size = f.stat().st_size
        digest.update(f"{f.relative_to(path).as_posix()}\0{size}\0".encode())
        if f.suffix in DESCRIPTIVE and size <= DESCRIPTIVE_MAX_BYTES:
            digest.update(hashlib.sha256(f.read_bytes()).digest())
    return f"files:{digest.hexdigest()}"


def device_name(device_type: str, cuda_name: str = "", threads: int = 0, sim_rate: float | None = None) -> str:
    """What the rates were measured on. A CPU's rates depend on its model and on how many
    threads torch uses (a pod's CPU limit)."""
    if sim_rate is not None:
        return f"simulated {sim_rate:g} tokens/s"
    if device_type == "cuda":
        return cuda_name
    return f"cpu {cpu_model()} threads={threads}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_versions() -> dict[str, str]:
    import torch
    import transformers

    import embedserve

    return {"torch": torch.__version__, "cuda": torch.version.cuda or "", "transformers": transformers.__version__,
            "embedserve": embedserve.__version__}


def make_key(revision_: str, device: str, dtype: str, versions: Mapping[str, str], plan: WarmupPlan,
             shaping: Mapping[str, object]) -> dict:
    """The key, as JSON holds it (compared whole on load). `shaping`: the other settings the
    runner's batches depend on (compile, graphs, attention, task, pooling, ...); the sweep's own
    constants are part of it too."""
    sweep = {"max_batch_s": SWEEP_MAX_BATCH_S, "min_timing_s": SWEEP_MIN_TIMING_S, "max_repeats": SWEEP_MAX_REPEATS}
    key = {"schema": SCHEMA, "model_revision": revision_, "device": device, "dtype": dtype,
           "versions": dict(versions), "plan": dataclasses.asdict(plan), "settings": dict(shaping), "sweep": sweep}
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def file_for(cache_dir: str | os.PathLike, key: dict) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return Path(cache_dir) / DIRECTORY / f"{name}.json"


def compile_cache_env(environ: Mapping[str, str], cache_dir: str | os.PathLike, device_type: str,
                      compiles: bool) -> dict[str, str]:
    """The variables to set so torch.compile's caches (inductor's FX graphs and autotuning,
    Triton's kernels) go beside the warm-up files, where a volume that outlives the pod keeps
    them: only on CUDA with COMPILE=true, and never over the user's own. Pure."""
    if device_type != "cuda" or not compiles:
        return {}
    base = Path(cache_dir) / DIRECTORY / "compile"
    wanted = {"TORCHINDUCTOR_CACHE_DIR": base / "inductor", "TRITON_CACHE_DIR": base / "triton"}
    return {name: str(path) for name, path in wanted.items() if not environ.get(name)}


# The file's contents.

def encode(key: dict, result: WarmupResult, probe: dict) -> dict:
    packing = dataclasses.asdict(result.packing) if result.packing else None
    return {"schema": SCHEMA, "key": key, "probe": probe,
            "result": {"caps": {str(b): c for b, c in result.caps.items()},
                       "rates": {str(b): r for b, r in result.rates.items()},
                       "token_budget": result.token_budget, "packing": packing}}


def decode(doc: object, key: dict, plan: WarmupPlan) -> tuple[WarmupResult, dict]:
    """A parsed file → (result, probe), or Unusable saying why. Pure."""
    if not isinstance(doc, dict) or not isinstance(doc.get("result"), dict):
        raise Unusable("not a warm-up file")
    if doc.get("schema") != SCHEMA:
        raise Unusable(f"schema {doc.get('schema')!r}, expected {SCHEMA}")
    if doc.get("key") != key:
        raise Unusable("written for another key (model, device, versions or settings): "
                       + ", ".join(differing(doc.get("key"), key)))
    r = doc["result"]
    try:
        caps = dict(sorted((int(b), _count(c)) for b, c in r["caps"].items()))  # JSON sorts "128" before "16"
        rates = dict(sorted((int(b), _rate(v)) for b, v in r["rates"].items()))
        budget = _count(r["token_budget"]) if r.get("packing") else 0
        packing = r["packing"] and PackSpec(int(r["packing"]["max_len"]), int(r["packing"]["max_rows"]),
                                            tuple(map(int, r["packing"]["ladder"])) if r["packing"]["ladder"] else None)
        probe = {"values": [float(v) for v in doc["probe"]["values"]], "norm": float(doc["probe"]["norm"]),
                 "sum": float(doc["probe"]["sum"])}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise Unusable(f"malformed ({type(e).__name__}: {e})") from None
    if not all(map(math.isfinite, [*probe["values"], probe["norm"], probe["sum"]])):
        raise Unusable("its probe is not finite")
    result = WarmupResult(caps, rates, packing or None, budget)
    check_formable(result, plan)
    return result, probe


def _count(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{v!r} is not a positive count")
    return v


def _rate(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise ValueError(f"{v!r} is not a positive rate")
    return float(v)


def check_formable(result: WarmupResult, plan: WarmupPlan) -> None:
    """Caps and budget the batcher can form for this plan, else Unusable."""
    if result.packing is None:
        if sorted(result.caps) != sorted(plan.buckets) or sorted(result.rates) != sorted(plan.buckets):
            raise Unusable(f"caps for buckets {sorted(result.caps)}, serving {list(plan.buckets)}")
        for b, cap in result.caps.items():
            limit = bucket_row_limit(b, plan.max_batch_size, plan.max_tokens_per_batch, plan.static)
            if cap > limit or (plan.static and cap not in LADDER):
                raise Unusable(f"bucket {b}'s cap {cap} is not a batch the batcher forms (at most {limit} rows"
                               + (", a captured size)" if plan.static else ")"))
        return
    spec = PackSpec.for_plan(plan.buckets[-1], plan.max_batch_size, plan.max_tokens_per_batch, plan.static)
    if result.packing != spec:
        raise Unusable(f"packed rows shaped as {result.packing}, this plan's are {spec}")
    most = max(plan.max_tokens_per_batch, plan.buckets[-1])
    if not spec.max_len <= result.token_budget <= most or (spec.ladder and result.token_budget not in spec.ladder):
        raise Unusable(f"token budget {result.token_budget} is not one the batcher forms "
                       f"({spec.max_len}..{most}{', a captured size' if spec.ladder else ''})")
    if list(result.rates) != [result.token_budget] or result.caps:
        raise Unusable("packed rows' rates are not at the token budget")


def differing(stored: object, key: dict) -> list[str]:
    if not isinstance(stored, dict):
        return ["no key"]
    return sorted(k for k in key.keys() | stored.keys() if stored.get(k) != key.get(k))


# The checks a reused file must pass.

def check_batches(plan: WarmupPlan, result: WarmupResult) -> Iterator[Batch | PackedBatch]:
    """One batch per shape the batcher forms with these measurements (static shapes: every
    captured one), the smallest first: that one is the probe. Fixed contents (seeded)."""
    rng = np.random.default_rng(PROBE_SEED)
    if result.packing:
        spec = result.packing
        for tokens in [t for t in spec.ladder if t <= result.token_budget] if spec.ladder else [result.token_budget]:
            yield random_packed(tokens, spec, plan.vocab_size, rng)
        return
    for length, rows in served_shapes(plan.buckets, result.caps, plan.static):
        yield dummy_batch(length, rows, plan, rng)


def first_row(out: np.ndarray | SparseRows) -> np.ndarray:
    if isinstance(out, SparseRows):
        row = np.zeros(out.dim, dtype=np.float64)
        indices, values = out.row(0)
        row[indices] = values
        return row
    return np.asarray(out[0], dtype=np.float64)


def probe_of(out: np.ndarray | SparseRows) -> dict:
    """A few numbers of a batch's output that other weights would change: its first row's first
    values, norm and sum."""
    row = first_row(out)
    return {"values": row[:PROBE_VALUES].tolist(), "norm": float(np.linalg.norm(row)), "sum": float(row.sum())}


def probe_differs(now: dict, stored: dict) -> str | None:
    a = np.array([*now["values"], now["norm"], now["sum"]])
    b = np.array([*stored["values"], stored["norm"], stored["sum"]])
    typical = stored["norm"] / math.sqrt(max(1, len(stored["values"]))) if a.shape == b.shape else 0.0
    if a.shape != b.shape or not np.allclose(a, b, rtol=PROBE_RTOL, atol=PROBE_ATOL * typical):
        return (f"the probe batch gives {np.round(a, 4).tolist()}, the file says {np.round(b, 4).tolist()}: "
                f"the model's weights are not the ones measured")
    return None


def output_problem(out: object, batch: Batch | PackedBatch, dim: int) -> str | None:
    values = out.values if isinstance(out, SparseRows) else out
    shape = getattr(out, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] < batch.rows or shape[1] != dim:
        return f"a batch of {batch.rows} rows gave an output of shape {shape}, expected ({batch.rows}, {dim})"
    if not np.isfinite(values).all():
        return f"a batch of {batch.rows} rows × {batch.padded_tokens // max(1, batch.rows)} tokens gave non-finite outputs"
    return None


def verify(runner: Runner, plan: WarmupPlan, result: WarmupResult, probe: dict) -> str | None:
    """Run every checked shape; → what is wrong, or None."""
    if bool(result.packing) != (getattr(runner, "attention", "padded") == "packed"):
        return "measured for another attention layout than this runner's"
    for i, batch in enumerate(check_batches(plan, result)):
        out = runner.run(batch)
        if (problem := output_problem(out, batch, runner.dim)) is not None:
            return problem
        if i == 0 and (problem := probe_differs(probe_of(out), probe)) is not None:
            return problem
    return None


class WarmStart:
    """The model worker's warm-up (`warm`, on its thread): reused from the file when it passes
    the checks, else measured and saved. `state` says which ("" until then) and `path` where.
    `key`: computed on the worker's thread, where reading the model's files and asking CUDA for
    the device's name belong."""

    def __init__(self, cache_dir: str | os.PathLike, key: Callable[[], dict], enabled: bool = True,
                 measure: Callable[[Runner, WarmupPlan], WarmupResult] = warm_up):
        self.cache_dir, self._key, self.enabled, self._measure = cache_dir, key, enabled, measure
        self.state = ""
        self.path: Path | None = None

    def warm(self, runner: Runner, plan: WarmupPlan) -> WarmupResult:
        try:
            key = self._key() if self.enabled else None
        except Exception as e:  # noqa: BLE001 - an unreadable model directory, a device without a name: serve anyway
            log.warning("warm start: no key for this model and device (%s: %s); measuring, saving nothing",
                        type(e).__name__, e)
            key = None
        if key is None:
            result = self._measure(runner, plan)
            self.state = "measured"
            return result
        self.path = file_for(self.cache_dir, key)
        found = self._read(key, plan)
        if found is not None:
            result, probe = found
            try:
                problem = verify(runner, plan, result, probe)
            except Exception as e:  # noqa: BLE001 - the sweep decides whether this device can serve at all
                problem = f"a checked batch failed ({type(e).__name__}: {e})"
            if problem is None:
                self.state = "reused"
                log.info("warm start: reused the warm-up measured before (%s), checked %s: no sweep", self.path,
                         "every captured shape" if plan.static else "each bucket at its cap")
                return result
            log.warning("warm start: %s does not fit this model: %s; measuring again", self.path, problem)
        result = self._measure(runner, plan)
        self.state = "measured"
        probe = probe_of(runner.run(next(check_batches(plan, result))))
        if self._write(encode(key, result, probe)):
            log.info("warm start: measured the warm-up, saved to %s for the next start", self.path)
        return result

    def _read(self, key: dict, plan: WarmupPlan) -> tuple[WarmupResult, dict] | None:
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("warm start: cannot read %s (%s); measuring", self.path, e)
            return None
        try:
            if len(data) > MAX_FILE_BYTES:
                raise Unusable(f"over {MAX_FILE_BYTES} bytes")
            try:
                doc = json.loads(data)
            except (ValueError, UnicodeDecodeError) as e:
                raise Unusable(f"not JSON ({e})") from None
            return decode(doc, key, plan)
        except Unusable as e:
            log.warning("warm start: ignoring %s: %s; measuring", self.path, e)
            return None

    def _write(self, doc: dict) -> bool:
        """Atomically (a reader sees the old file or the new one, never half); False, with a
        warning, when the directory cannot be written (a read-only volume)."""
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A name of its own: pods sharing the volume are often all pid 1.
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from pods running as another user
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True, allow_nan=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            return True
        except (OSError, ValueError) as e:
            log.warning("warm start: cannot save the warm-up to %s (%s): the next start measures again", self.path, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return False
