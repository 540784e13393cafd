"""The warm start's key (model.warm_start): everything a warm-up's measurements depend on, so a
file is reused only where they would come out the same. The model's revision, the device as
precisely as it can be named (a CPU's model, torch's threads and the container's cores; a GPU's
name, memory, SMs, compute capability and driver), dtype, library versions with a digest of our
own code that shapes the measurements, and every setting that shapes the batches.

What cannot be keyed: a GPU shared by time-slicing or MPS looks the same as one held alone, and a
CPU's noisy neighbour is invisible; the warm-up file's age limit (warm_start.MAX_AGE_S) and
WARM_START=refresh are the answers to those."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
from pathlib import Path
from typing import Mapping

from embedserve.model.worker import SWEEP_MAX_BATCH_S, SWEEP_MAX_REPEATS, SWEEP_MIN_TIMING_S, WarmupPlan

# Bumped when the file's layout or the sweep's way of choosing changes: older files are refused.
# 2: the probe's dimension, the measuring host and time; the code digest and a GPU's properties.
SCHEMA = 2
# Model files whose contents name a revision: configuration, tokenizer, the repository's code.
# Weights are named by their size only (hashing gigabytes at every start would cost what the
# sweep does); weights replaced at the same size are what the probe catches.
DESCRIPTIVE = (".json", ".txt", ".model", ".tiktoken", ".py")
DESCRIPTIVE_MAX_BYTES = 64 << 20
HUB_SNAPSHOT = re.compile(r"[0-9a-f]{40}")
# Our modules whose logic decides what the sweep measures and chooses (embedserve.model.*): the
# package's version stays the same across commits that change them. Read as bytes (~100 kB, <1 ms).
MEASURING_CODE = ("worker", "shapes", "batches", "encoder", "cuda_graphs", "varlen", "simulated")


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


def device_name(device_type: str, cuda: str = "", threads: int = 0, cores: int = 0,
                sim_rate: float | None = None) -> str:
    """What the rates were measured on (pure). A CPU's rates depend on its model, on torch's
    threads and on the CPUs the container may use (a Kubernetes CPU limit is a CFS quota, which
    torch's thread count does not see: frontends.count.container_cores does). `cuda`: cuda_device's."""
    if sim_rate is not None:
        return f"simulated {sim_rate:g} tokens/s"
    if device_type == "cuda":
        return cuda
    return f"cpu {cpu_model()} threads={threads} cores={cores}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cuda_device(device) -> str:
    """A GPU as its rates depend on it: the name, and what one name may hide (a MIG slice has
    fewer SMs and less memory; an H100 PCIe and SXM differ in both; a driver changes kernels)."""
    import torch

    p = torch.cuda.get_device_properties(device)
    driver = "unknown"
    get_driver = getattr(torch._C, "_cuda_getDriverVersion", None)  # private: absent from some builds
    if get_driver is not None:
        try:
            driver = str(get_driver())
        except Exception:  # noqa: BLE001 - a name without the driver is still a key
            pass
    return (f"{p.name} sm_{p.major}{p.minor} {p.multi_processor_count} SMs {p.total_memory // 2**20} MiB "
            f"driver {driver}")


def code_digest() -> str:
    digest = hashlib.sha256()
    for name in MEASURING_CODE:
        digest.update(name.encode() + b"\0" + Path(__file__).with_name(f"{name}.py").read_bytes())
    return digest.hexdigest()[:16]


def library_versions() -> dict[str, str]:
    import torch
    import transformers

    import embedserve

    return {"torch": torch.__version__, "cuda": torch.version.cuda or "", "transformers": transformers.__version__,
            "embedserve": embedserve.__version__, "embedserve_code": code_digest()}


def make_key(revision_: str, device: str, dtype: str, versions: Mapping[str, str], plan: WarmupPlan,
             shaping: Mapping[str, object]) -> dict:
    """The key, as JSON holds it (compared whole on load). `shaping`: the other settings the
    runner's batches depend on (compile, graphs, attention, task, pooling, ...); the sweep's own
    constants are part of it too."""
    sweep = {"max_batch_s": SWEEP_MAX_BATCH_S, "min_timing_s": SWEEP_MIN_TIMING_S, "max_repeats": SWEEP_MAX_REPEATS}
    key = {"schema": SCHEMA, "model_revision": revision_, "device": device, "dtype": dtype,
           "versions": dict(versions), "plan": dataclasses.asdict(plan), "settings": dict(shaping), "sweep": sweep}
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def server_key(revision_: str, device: str, versions: Mapping[str, str], plan: WarmupPlan, placement,
               task: str, head: Mapping[str, object] | None, exclude_ids, trust_remote_code: bool) -> dict:
    """The server's key (app.Server builds it here; pure): `placement` is the encoder's
    (device, dtype, compile, static shapes, CUDA graphs, attention), `head` what the model
    declares (pooling, dimensions, activation: head.describe())."""
    shaping = {"device": str(placement.device), "compile": placement.compile,
               "static_shapes": placement.static_shapes, "cuda_graphs": placement.cuda_graphs,
               "attention": placement.attention, "task": task, "head": dict(head) if head else None,
               "exclude_ids": sorted(exclude_ids), "trust_remote_code": trust_remote_code}
    return make_key(revision_, device, str(placement.dtype), versions, plan, shaping)
