"""A simulated accelerator (MODEL_PATH=sim:<tokens_per_second>[@<bytes>]): for tests and the fleet
simulator only, never a default. A batch "runs" by sleeping a fixed launch cost plus
padded_tokens / rate, so N server processes on a small CPU behave like N devices with a known
capacity; `@<bytes>` (e.g. @1.5GiB) declares the model's memory on the device, which
DEVICE_MEMORY_BYTES then bounds as a GPU's does (model.device). Its vectors are deterministic (a seeded projection of the row's token ids), unit-length.
A batch containing FAIL_TOKEN raises and one containing HANG_TOKEN never returns, so tests can
exercise device faults on a real process.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from embedserve.model.batches import Batch
from embedserve.model.m3_rows import ID_BITS
from embedserve.model.states_rows import StatesRows, asked
from embedserve.model.token_rows import TokenRows

PREFIX = "sim:"
LAUNCH_S = 0.001  # per-batch cost, so bigger batches pay as on a real device
FAIL_TOKEN = 1  # a batch holding this token id ([unused0] in BERT vocabularies) fails, as a broken device would
HANG_TOKEN = 2  # a batch holding this one ([unused1]) never returns, as a hung kernel would


UNITS = {"": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse(model_path: str) -> float | None:
    """`sim:20000` (or `sim:20000@2GiB`) → 20000.0 tokens/s; None for any other MODEL_PATH."""
    return _parse(model_path)[0] if model_path.startswith(PREFIX) else None


def footprint(model_path: str) -> int:
    """The memory a simulated model declares (`sim:20000@2GiB` → 2 GiB); 0 when it declares none."""
    return _parse(model_path)[1] if model_path.startswith(PREFIX) else 0


def _parse(model_path: str) -> tuple[float, int]:
    rate, _, memory = model_path[len(PREFIX):].partition("@")
    number = memory.rstrip("KMGiBkmgib ")
    try:
        rate, size = float(rate), int(float(number or 0) * UNITS[memory[len(number):].strip().upper()])
    except (ValueError, KeyError, OverflowError):
        raise ValueError(f"MODEL_PATH={model_path!r}: expected sim:<tokens_per_second>[@<bytes>[KiB|MiB|GiB]]") from None
    if not 0 < rate < float("inf") or size < 0:  # NaN too
        raise ValueError(f"MODEL_PATH={model_path!r}: the rate must be > 0 and the memory >= 0")
    return rate, size


class SimulatedAccelerator:
    def __init__(self, tokens_per_s: float, dim: int = 384, vocab_size: int = 30522):
        self.rate, self.dim = tokens_per_s, dim
        self.states_dim = dim  # its token states (TEI's /embed_all): each token's projection
        self._projection = np.random.default_rng(0).standard_normal((vocab_size, dim)).astype(np.float32)

    def run(self, batch: Batch) -> np.ndarray:
        time.sleep(LAUNCH_S + batch.padded_tokens / self.rate)
        ids = batch.input_ids[: batch.rows].numpy()
        first = ids[:, 0].copy()
        ids = ids & ID_BITS  # what a row asks rides on its first id (model.states_rows)
        attended = ids[batch.attention_mask[: batch.rows].numpy() == 1]
        if (attended == FAIL_TOKEN).any():
            raise RuntimeError(f"simulated device fault (token {FAIL_TOKEN} in the batch)")
        if (attended == HANG_TOKEN).any():
            threading.Event().wait()  # forever: the process exits around it
            raise AssertionError("unreachable")
        mask = batch.attention_mask[: batch.rows].numpy().astype(np.float32)
        states = self._projection[ids]
        out = np.einsum("bl,bld->bd", mask, states)
        out = out / np.linalg.norm(out, axis=1, keepdims=True)
        keep = (mask > 0) & asked(first)[:, None]
        if not keep.any():
            return out
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(keep.sum(axis=1), out=offsets[1:])
        return StatesRows(out, TokenRows(np.ascontiguousarray(states[keep]), offsets))

    def memory(self) -> dict[str, int]:
        return {}
