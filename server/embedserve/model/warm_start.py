"""Warm start: the warm-up's measurements (each bucket's cap and rate, or packed rows' token
budget) kept as a file in the model cache directory and reused by the next start whose key
matches (model.warm_key: model revision, device, dtype, versions, settings), so it skips the
sweep (most of a start on a CPU; on a GPU the sweep and the captures of sizes it then discards).

A reused file is checked, never trusted: the start still runs one batch per shape the batcher
can form (with static shapes that is the capture, needed anyway), each must give finite outputs
of the right shape, and one fixed probe batch must give what it gave when the file was written
(weights replaced under the same name and sizes). Any file that cannot be read, does not parse,
has another schema or key, holds caps the batcher cannot form or rates that are not positive, or
fails the checks: a warning naming it and why, then the sweep. A file older than MAX_AGE_S is
measured again (INFO), and WARM_START=refresh measures and overwrites. Failing to write one: a
read-only cache (a pre-filled claim mounted readOnly) is said once at INFO, anything else is a
warning; the server serves either way.

File: <MODEL_CACHE_DIR>/embedfleet-warmup/<sha256 of the key>.json, written atomically.

A writer of a shared cache controls these files: JSON (json.loads, at most MAX_FILE_BYTES) under
its key's digest, so no code and no other path; caps held to what this pod's settings let the
batcher form, each shape run before serving; a service-rate prior of at most MAX_RATE and of
what the device shows it runs (the probe batch timed: rates_problem), which served batches
replace within about half a minute of busy time. It can make batches smaller or
the first seconds of admission wrong, not more (docs/configuration.md, the shared cache's trust
boundary)."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from embedserve.model.batches import Batch, PackedBatch, PackSpec, random_packed
from embedserve.model.shapes import LADDER, bucket_row_limit, served_shapes
from embedserve.model.m3_rows import M3Rows
from embedserve.model.sparse_rows import SparseRows
from embedserve.model.token_rows import TokenRows
from embedserve.model.warm_key import SCHEMA
from embedserve.model.worker import Runner, WarmupPlan, WarmupResult, dummy_batch, warm_up

log = logging.getLogger(__name__)

DIRECTORY = "embedfleet-warmup"
MAX_FILE_BYTES = 1 << 20  # a warm-up file is a few kB: anything larger is not one
# A file is measured again after a week. The key names the device, not how busy its host was: a
# sweep taken beside a noisy neighbour (a CPU pod's, or a GPU time-sliced with another) would
# otherwise set every later pod's caps and service-rate prior for good. A week keeps the sweep
# off nearly every start (a rollout, a scale-up) and bounds how long an unlucky one lasts.
MAX_AGE_S = 7 * 86400
STALE_TMP_S = 3600  # a .tmp file this old is a writer that died before its rename
# No device computes a billion real tokens a second (an H200 runs a MiniLM at ~2 million): a rate
# above is no measurement, and as the service-rate prior it would take minutes of busy time to fade.
MAX_RATE = 1e9
# And a file's rates are checked against the device itself (rates_problem): the probe batch run
# again RATE_PROBES times (its fastest run) bounds what any batch of the file can run at, with
# RATE_MARGIN for a device's noise. A rate past it is no measurement of this device.
RATE_PROBES, RATE_MARGIN = 3, 10.0
PROBE_SEED = 20261202
PROBE_VALUES = 8
# The probe must survive the same model on the same device giving slightly different numbers
# (autotuned kernels, another CUDA graph capture): each value may differ by 2% of itself plus 5%
# of the row's typical entry (norm / sqrt(dim)), and never less than PROBE_FLOOR: bf16 keeps 8
# bits of mantissa, so an output of order 1 moves by ~0.004 per rounding and a few of them
# accumulate over the layers. A one-logit output (rerank, classify) near 0 would otherwise get no
# tolerance at all. Other weights move every value by about a whole typical entry (a normalized
# embedding's ~0.05, a logit's units), well past both.
PROBE_RTOL, PROBE_ATOL, PROBE_FLOOR = 0.02, 0.05, 0.01
MODES = ("true", "false", "refresh")


class Unusable(ValueError):
    """Why a warm-up file cannot be used."""


class Expired(Unusable):
    """A file past MAX_AGE_S: expected, not a fault."""


def file_for(cache_dir: str | os.PathLike, key: dict) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return Path(cache_dir) / DIRECTORY / f"{name}.json"


def compile_cache_env(environ: Mapping[str, str], cache_dir: str | os.PathLike, device_type: str,
                      compiles: bool, shared: bool = False) -> dict[str, str]:
    """The variables to set so torch.compile's caches (inductor's FX graphs and autotuning,
    Triton's kernels) go beside the warm-up files, where a volume that outlives the pod keeps
    them: only with `shared` (COMPILE_CACHE=shared), on CUDA with COMPILE=true, never over the
    user's own, and only where the directory can be written.

    Not by default: inductor unpickles and imports what it finds in its cache, so whoever can
    write that directory runs code in every pod that compiles from it. On a volume several
    services share (a ReadWriteMany claim), one whose model runs its own code (TRUST_REMOTE_CODE)
    could then run code in the others' pods. Per pod (unset), they stay in their defaults in the
    container's own /tmp, and each pod compiles again.

    Inductor raises on a cache directory it cannot create, which would fail every start of a pod
    whose cache is a pre-filled read-only claim: then nothing is set (one log line), and the
    caches stay in their defaults."""
    if device_type != "cuda" or not compiles or not shared:
        return {}
    base = Path(cache_dir) / DIRECTORY / "compile"
    wanted = {"TORCHINDUCTOR_CACHE_DIR": base / "inductor", "TRITON_CACHE_DIR": base / "triton"}
    wanted = {name: path for name, path in wanted.items() if not environ.get(name)}
    if not wanted:
        return {}
    try:
        for path in wanted.values():
            path.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".writable.", dir=path)
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        log.log(_unwritable_level(e), "warm start: torch.compile's caches cannot go under %s (%s): they stay in "
                "their defaults under /tmp, and each pod compiles again", base, e)
        return {}
    return {name: str(path) for name, path in wanted.items()}


def _unwritable_level(e: OSError) -> int:
    """A read-only cache is a deployment's choice (a pre-filled claim), said at INFO; anything
    else (a file in the way, a full disk) is a WARNING."""
    return logging.INFO if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else logging.WARNING


# The file's contents.

def encode(key: dict, result: WarmupResult, probe: dict, measured_at: float, host: str) -> dict:
    packing = dataclasses.asdict(result.packing) if result.packing else None
    return {"schema": SCHEMA, "key": key, "probe": probe, "measured_at": measured_at, "host": host,
            "result": {"caps": {str(b): c for b, c in result.caps.items()},
                       "rates": {str(b): r for b, r in result.rates.items()},
                       "token_budget": result.token_budget, "packing": packing}}


def decode(doc: object, key: dict, plan: WarmupPlan, now: float) -> tuple[WarmupResult, dict]:
    """A parsed file → (result, probe), or Unusable saying why (Expired: older than MAX_AGE_S at
    `now`, or as far in the future: another node's clock). Pure."""
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
                 "sum": float(doc["probe"]["sum"]), "dim": _count(doc["probe"]["dim"])}
        measured_at, host = float(doc["measured_at"]), str(doc.get("host", "?"))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise Unusable(f"malformed ({type(e).__name__}: {e})") from None
    if not all(map(math.isfinite, [*probe["values"], probe["norm"], probe["sum"]])):
        raise Unusable("its probe is not finite")
    if not math.isfinite(measured_at) or abs(now - measured_at) > MAX_AGE_S:
        raise Expired(f"measured on {host} {(now - measured_at) / 86400:.1f} days ago, past the "
                      f"{MAX_AGE_S / 86400:g} days a warm-up is kept")
    result = WarmupResult(caps, rates, packing or None, budget)
    check_formable(result, plan)
    return result, probe


def _count(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{v!r} is not a positive count")
    return v


def _rate(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 < v <= MAX_RATE):
        raise ValueError(f"{v!r} is not a positive rate of at most {MAX_RATE:g} tokens/s")
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

def check_batches(plan: WarmupPlan, result: WarmupResult, runner=None) -> Iterator[Batch | PackedBatch]:
    """One batch per shape the batcher forms with these measurements (static shapes: every
    captured one), the smallest first: that one is the probe. Fixed contents (seeded). The
    probe's first row asks for every output the runner has (its `probe_flags` on its first id:
    BGE-M3's sparse and ColBERT heads, model.m3_rows.FLAGS), so the probe reads every head."""
    rng = np.random.default_rng(PROBE_SEED)
    flags = getattr(runner, "probe_flags", 0)
    if result.packing:
        spec = result.packing
        batches = (random_packed(tokens, spec, plan.vocab_size, rng) for tokens in
                   ([t for t in spec.ladder if t <= result.token_budget] if spec.ladder else [result.token_budget]))
    else:
        batches = (dummy_batch(length, rows, plan, rng) for length, rows in
                   served_shapes(plan.buckets, result.caps, plan.static))
    for i, batch in enumerate(batches):
        if i == 0 and flags:
            batch.input_ids.view(-1)[0] |= flags  # the first row's first id, padded or packed
        yield batch


def first_row(out: np.ndarray | SparseRows | TokenRows | M3Rows) -> np.ndarray:
    if isinstance(out, TokenRows):  # its first text's token vectors, end to end
        return np.asarray(out.row(0), dtype=np.float64).ravel()
    if isinstance(out, M3Rows):  # task bgem3: its dense vector, first ColBERT vector and lexical weights (each head's)
        return np.concatenate([out.dense[0], out.colbert.row(0)[:1].ravel(), out.sparse.row(0)[1]]).astype(np.float64)
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
    return {"values": row[:PROBE_VALUES].tolist(), "norm": float(np.linalg.norm(row)), "sum": float(row.sum()),
            "dim": int(row.size)}


def probe_differs(now: dict, stored: dict) -> str | None:
    """Why the probe batch's output is not the stored one (PROBE_RTOL, PROBE_ATOL, PROBE_FLOOR), or None."""
    a = np.array([*now["values"], now["norm"], now["sum"]])
    b = np.array([*stored["values"], stored["norm"], stored["sum"]])
    typical = stored["norm"] / math.sqrt(max(1, stored["dim"]))
    # The sum adds `dim` entries' variance: its tolerance grows as sqrt(dim).
    atol = np.full(b.shape, max(PROBE_FLOOR, PROBE_ATOL * typical))
    atol[-1] *= math.sqrt(max(1, stored["dim"]))
    if now["dim"] != stored["dim"] or a.shape != b.shape or not (np.abs(a - b) <= atol + PROBE_RTOL * np.abs(b)).all():
        return (f"the probe batch gives {np.round(a, 4).tolist()}, the file says {np.round(b, 4).tolist()}: "
                f"the model's weights are not the ones measured")
    return None


def output_problem(out: object, batch: Batch | PackedBatch, dim: int) -> str | None:
    values = (out.values if isinstance(out, SparseRows) else out.vectors if isinstance(out, TokenRows) else
              out.dense if isinstance(out, M3Rows) else out)
    shape = getattr(out, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] < batch.rows or shape[1] != dim:
        return f"a batch of {batch.rows} rows gave an output of shape {shape}, expected ({batch.rows}, {dim})"
    if not np.isfinite(values).all():
        return f"a batch of {batch.rows} rows × {batch.padded_tokens // max(1, batch.rows)} tokens gave non-finite outputs"
    return None


def verify(runner: Runner, plan: WarmupPlan, result: WarmupResult, probe: dict,
           clock: Callable[[], float] = time.perf_counter) -> str | None:
    """Run every checked shape, then the probe batch again, timed; → what is wrong, or None."""
    if bool(result.packing) != (getattr(runner, "attention", "padded") == "packed"):
        return "measured for another attention layout than this runner's"
    first, most = None, 0
    for i, batch in enumerate(check_batches(plan, result, runner)):
        out = runner.run(batch)
        if (problem := output_problem(out, batch, runner.dim)) is not None:
            return problem
        if i == 0 and (problem := probe_differs(probe_of(out), probe)) is not None:
            return problem
        first, most = first or batch, max(most, batch.real_tokens)
    took = math.inf
    for _ in range(RATE_PROBES):  # warm now (compiled, captured): the best of a few, as a spike is no rate
        t0 = clock()
        runner.run(first)
        took = min(took, clock() - t0)
    return rates_problem(result.rates, first.real_tokens / max(took, 1e-9), most / first.real_tokens)


def rates_problem(rates: Mapping[int, float], probe_rate: float, scale: float) -> str | None:
    """Why the file's service rates cannot be this device's, or None. A batch `scale` times the
    probe batch's tokens takes at least the probe's time, so no rate of the file can be past
    `scale` times the rate the probe batch just ran at (`probe_rate`); RATE_MARGIN for noise. Pure."""
    bound = RATE_MARGIN * probe_rate * scale
    if max(rates.values(), default=0.0) > bound:
        return (f"its service rates (up to {max(rates.values()):.4g} tokens/s) are past what this device runs: "
                f"the probe batch ran at {probe_rate:.4g} tokens/s, so none above {bound:.4g}")
    return None


class WarmStart:
    """The model worker's warm-up (`warm`, on its thread): reused from the file when it passes
    the checks, else measured and saved. `mode`: WARM_START (true, false, or refresh: measure and
    overwrite). `state` says which ("" until then) and `path` where. `key`: computed on the
    worker's thread, where reading the model's files and asking CUDA about the device belong."""

    def __init__(self, cache_dir: str | os.PathLike, key: Callable[[], dict], mode: str = "true",
                 measure: Callable[[Runner, WarmupPlan], WarmupResult] = warm_up,
                 clock: Callable[[], float] = time.time):
        if mode not in MODES:
            raise ValueError(f"warm start mode {mode!r}: expected one of {', '.join(MODES)}")
        self.cache_dir, self._key, self.mode, self._measure, self._clock = cache_dir, key, mode, measure, clock
        self.state = ""
        self.path: Path | None = None

    def warm(self, runner: Runner, plan: WarmupPlan) -> WarmupResult:
        try:
            key = self._key() if self.mode != "false" else None
        except Exception as e:  # noqa: BLE001 - an unreadable model directory, a device without a name: serve anyway
            log.warning("warm start: no key for this model and device (%s: %s); measuring, saving nothing",
                        type(e).__name__, e)
            key = None
        if key is None:
            result = self._measure(runner, plan)
            self.state = "measured"
            return result
        self.path = file_for(self.cache_dir, key)
        found = self._read(key, plan) if self.mode != "refresh" else None
        if self.mode == "refresh":
            log.info("warm start: WARM_START=refresh: measuring, then replacing %s", self.path)
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
        probe = probe_of(runner.run(next(check_batches(plan, result, runner))))
        if self._write(encode(key, result, probe, self._clock(), socket.gethostname())):
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
            return decode(doc, key, plan, self._clock())
        except Expired as e:
            log.info("warm start: %s was %s; measuring again", self.path, e)
        except Unusable as e:
            log.warning("warm start: ignoring %s: %s; measuring", self.path, e)
        return None

    def _write(self, doc: dict) -> bool:
        """Atomically (a reader sees the old file or the new one, never half); False, with one
        line, when the directory cannot be written (INFO for a read-only cache)."""
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
        except (OSError, ValueError) as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            if isinstance(e, OSError) and _unwritable_level(e) == logging.INFO:
                log.info("warm start: the model cache is read-only (%s): this pod measured its warm-up and cannot "
                         "keep it for the next", e)
            else:
                log.warning("warm start: cannot save the warm-up to %s (%s): the next start measures again",
                            self.path, e)
            return False
        _sync_directory(self.path.parent)
        _remove_stale_tmp(self.path.parent, self._clock())
        return True


def _sync_directory(directory: Path) -> None:
    """The rename durable too (best effort: some file systems cannot open a directory to sync)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_stale_tmp(directory: Path, now: float) -> None:
    """Temporary files of writers that died before their rename (a pod killed mid-save)."""
    for tmp in directory.glob(".*.tmp"):
        try:
            if now - tmp.stat().st_mtime > STALE_TMP_S:
                tmp.unlink()
        except OSError:
            pass  # another pod's, removed or renamed meanwhile
