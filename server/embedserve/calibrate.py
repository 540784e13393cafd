"""QUANTIZE_RANGE=calibrated, where it is made: the model's float32 vectors of the calibration
corpus (embedserve.model.calibration), read from MODEL_CACHE_DIR, or computed and saved there. At
a server's start-up (embedserve.app, in the model process) and in `python -m embedserve.prefetch`,
which fills a cache with it, so pods of the revision read it rather than each computing it.

Computed on the CPU in float32 by an Encoder of its own, whatever the server runs in (a GPU's
bf16 vectors would differ from a CPU's, and so would the ranges): the same arithmetic on every
pod. Blocking (loading a model, running the corpus): call it off the event loop."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from embedserve.config import Settings
from embedserve.model import calibration, simulated, warm_key
from embedserve.model.batches import Batch
from embedserve.transports.encodings import Quantization

log = logging.getLogger(__name__)

BATCH_ROWS = 32


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
        out.append(np.asarray(runner.run(batch), dtype=np.float32))
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


def calibrated(settings: Settings, prepared, dim: int | None = None, sim_rate: float | None = None) -> Quantization:
    """The Quantization of QUANTIZE_RANGE=calibrated for this model: its calibration read from
    MODEL_CACHE_DIR (for this revision and serving), else computed and saved there. `dim`: the
    model's dimensions, where known (a file of another width is not used)."""
    # The simulated device borrows the packaged model's files: its vectors are not that model's.
    key = calibration.key(warm_key.revision(prepared.model_dir), {**served(prepared), "simulated": bool(sim_rate)})
    path = calibration.file_for(settings.model_cache_dir, key)
    embeddings = calibration.read(path, key, dim)
    if embeddings is not None:
        log.info("calibration: int8/uint8 ranges from %s", path)
    else:
        t0 = time.monotonic()
        runner = cpu_runner(settings, prepared, sim_rate)
        embeddings = calibration.check(embed_corpus(runner, prepared.tokenizer, prepared.head.prompt(None)), dim)
        del runner
        log.info("calibration: computed the corpus's %d vectors on the CPU in float32 in %.1f s",
                 len(embeddings), time.monotonic() - t0)
        if calibration.write(path, key, embeddings):
            log.info("calibration: saved to %s for the other pods of this revision", path)
    q = Quantization(calibration=embeddings, normalized=bool(prepared.head.normalize),
                     digest=calibration.digest(embeddings))
    log.info("calibration: QUANTIZE_RANGE=calibrated, digest %s", q.digest)
    return q
