"""QUANTIZE_RANGE=calibrated, where it is made: the model's float32 vectors of the calibration
corpus (embedserve.model.calibration), read from MODEL_CACHE_DIR, or computed and saved there. At
a server's start-up (embedserve.app, in the model process) and in `python -m embedserve.prefetch`,
which fills a cache with it, so pods of the revision read it rather than each computing it.

Computed on the CPU in float32 by an Encoder of its own, whatever the server runs in (a GPU's
bf16 vectors would differ from a CPU's, and so would the ranges): the same arithmetic on every
pod. A server computes it only for a model whose float32 copy is at most IN_POD_MAX_BYTES; above,
its start fails saying to run prefetch (serving other ranges than the fleet's would mix two
quantizations in one index). The file is keyed by the weights' contents too (contents_digest),
and the first pod to save one is the one every pod serves (calibration.write). Blocking (loading
a model, running the corpus, hashing weights): call it off the event loop."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from embedserve.config import Settings
from embedserve.model import calibration, simulated, warm_key
from embedserve.model.batches import Batch
from embedserve.model.m3_rows import dense_of
from embedserve.transports.encodings import Quantization

log = logging.getLogger(__name__)

BATCH_ROWS = 32
# The largest float32 copy of a model's weights a server computes its calibration with at start-up
# (a ~1B-parameter model): on top of the served copy, in the pod's memory. A 7-8B model's is ~30
# GiB, which would get the pod OOM-killed at every start: prefetch computes those (it has no bound).
IN_POD_MAX_BYTES = 4 << 30
# The weights' contents are hashed at most once per file and change: each file's digest is kept
# here by its path, size and mtime_ns (a few hundred bytes each).
CONTENTS = "contents"
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


class TooLarge(RuntimeError):
    """No calibration in the cache, and computing one would take more memory than a pod may use."""


def float32_bytes(model_dir: str | os.PathLike) -> int:
    """What a float32 copy of the model's weights takes: from the safetensors headers (each
    tensor's shape), else from the other weights files' sizes as if they held 16-bit values."""
    total = 0
    for f in Path(model_dir).rglob("*"):
        if not f.is_file() or f.name.startswith("."):
            continue
        if f.suffix == ".safetensors":
            try:
                with open(f, "rb") as fh:
                    length = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(min(length, 100 << 20)))
                total += 4 * sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
                continue
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass  # not readable as safetensors: sized as the other files are
        if f.suffix in WEIGHTS:
            total += 2 * f.stat().st_size
    return total


def contents_digest(model_dir: str | os.PathLike, cache_dir: str | os.PathLike) -> str:
    """sha256 over the contents of the model directory's files that warm_key.revision names by
    size alone (the weights; configuration and tokenizer files it hashes itself), so a checkpoint
    retrained in place at the same sizes gets a calibration of its own. Each file's digest is
    kept in MODEL_CACHE_DIR by its resolved path, size and mtime_ns: the next start (or pod
    sharing the cache) reads the weights again only when one of those changed."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        stat = f.stat()
        if f.suffix in warm_key.DESCRIPTIVE and stat.st_size <= warm_key.DESCRIPTIVE_MAX_BYTES:
            continue
        digest.update(f"{f.relative_to(root).as_posix()}\0{_file_digest(f, stat, cache_dir)}\0".encode())
    return digest.hexdigest()[:32]


def _file_digest(f: Path, stat: os.stat_result, cache_dir: str | os.PathLike) -> str:
    real = str(f.resolve())
    name = hashlib.sha256(real.encode()).hexdigest()[:32] + ".json"
    record = Path(cache_dir) / calibration.DIRECTORY / CONTENTS / name
    known = {"path": real, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        with open(record, "rb") as fh:
            stored = json.loads(fh.read(4096))
        if isinstance(stored, dict) and all(stored.get(k) == v for k, v in known.items()) \
                and isinstance(stored.get("sha256"), str):
            return stored["sha256"]
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**known, "sha256": h.hexdigest()}))
        tmp.replace(record)
    except OSError:  # a read-only cache: hashed again at the next start
        pass
    return h.hexdigest()


def served(prepared) -> dict:
    """How the model's vectors are formed, beyond its files (the key's `served`): pooling,
    normalization, Dense layers and max length as served (with the environment's overrides), the
    default prompt's own text (a request without prompt_name gets it), and tokens left out of
    pooling. `prepared`: embedserve.prepare.Prepared."""
    head = prepared.head
    return {**head.describe(), "default_prompt": head.prompt(None), "exclude_ids": list(prepared.exclude_ids),
            "task": prepared.task}


def embed_corpus(runner, tokenizer, prompt: str) -> np.ndarray:
    """The corpus through `runner.run(Batch)` (padded rows, BATCH_ROWS at a time), tokenized as a
    request without prompt_name is: the default prompt, cut at the model's max length → float32
    [len(CORPUS), dim]."""
    out = []
    for start in range(0, len(calibration.CORPUS), BATCH_ROWS):
        texts = list(calibration.CORPUS[start:start + BATCH_ROWS])
        ids, lengths = tokenizer.encode(texts, True, prompt)
        mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
        batch = Batch(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask), len(texts), int(lengths.sum()), [])
        out.append(np.asarray(dense_of(runner.run(batch)), dtype=np.float32))  # bgem3: its dense vectors
    return np.ascontiguousarray(np.concatenate(out), dtype=np.float32)


def cpu_runner(settings: Settings, prepared, sim_rate: float | None = None):
    """What computes it: the model on the CPU in float32, eager, padded rows (or, MODEL_PATH=sim:,
    the simulated device, whose vectors are the same anywhere)."""
    if sim_rate:
        return simulated.SimulatedAccelerator(sim_rate, vocab_size=prepared.tokenizer.vocab_size)
    from embedserve.model.encoder import Encoder, Placement

    placement = Placement(torch.device("cpu"), torch.float32, compile=False, static_shapes=False)
    cpu = dataclasses.replace(settings, attention="padded", device="cpu", dtype="float32", compile="false")
    return Encoder(prepared.model_dir, cpu, placement, prepared.exclude_ids, prepared.task, prepared.head)


def calibrated(settings: Settings, prepared, dim: int | None = None, sim_rate: float | None = None,
               max_compute_bytes: float | None = IN_POD_MAX_BYTES) -> Quantization:
    """The Quantization of QUANTIZE_RANGE=calibrated for this model: its calibration read from
    MODEL_CACHE_DIR (for this revision, these weights and this serving), else computed and saved
    there (or, where another pod saved one first, that one). `dim`: the model's dimensions,
    where known (a file of another width is not used). `max_compute_bytes`: the largest float32
    copy of the weights computing it may take (None: any; prefetch's); above it, TooLarge."""
    # The simulated device borrows the packaged model's files: its vectors are not that model's.
    revision = warm_key.revision(prepared.model_dir)
    hub = revision.startswith("hub:")  # a commit names its weights' contents
    weights = "" if sim_rate or hub else contents_digest(prepared.model_dir, settings.model_cache_dir)
    key = calibration.key(revision, {**served(prepared), "simulated": bool(sim_rate)}, weights)
    path = calibration.file_for(settings.model_cache_dir, key)
    embeddings = calibration.read(path, key, dim)
    if embeddings is not None:
        log.info("calibration: int8/uint8 ranges from %s", path)
    else:
        size = 0 if sim_rate else float32_bytes(prepared.model_dir)
        if max_compute_bytes is not None and size > max_compute_bytes:
            raise TooLarge(
                f"QUANTIZE_RANGE=calibrated: MODEL_CACHE_DIR has no calibration for this model ({path.name}), and "
                f"computing it here would take a float32 copy of its weights, {size / 2**30:.1f} GiB, on the CPU "
                f"(a pod computes one of at most {max_compute_bytes / 2**30:.0f} GiB): compute it into the cache with "
                f"`python -m embedserve.prefetch` and the same settings (the operator's modelCache fill Job does), or "
                f"set QUANTIZE_RANGE to a number")
        t0 = time.monotonic()
        runner = cpu_runner(settings, prepared, sim_rate)
        embeddings = calibration.check(embed_corpus(runner, prepared.tokenizer, prepared.head.prompt(None)), dim)
        del runner
        log.info("calibration: computed the corpus's %d vectors on the CPU in float32 in %.1f s",
                 len(embeddings), time.monotonic() - t0)
        saved = calibration.write(path, key, embeddings)
        if saved is not None and saved is embeddings:
            log.info("calibration: saved to %s for the other pods of this revision", path)
        embeddings = embeddings if saved is None else saved
    q = Quantization(calibration=embeddings, normalized=bool(prepared.head.normalize),
                     digest=calibration.digest(embeddings))
    log.info("calibration: QUANTIZE_RANGE=calibrated, digest %s", q.digest)
    return q
