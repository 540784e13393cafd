"""The model on its device: loading, dtype, torch.compile, and one forward pass + pooling per
batch. Constructed and used only on the model-worker thread (compiled graphs live there)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from embedserve.config import Settings
from embedserve.pooling import pool
from embedserve.queues import Batch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    compile: bool
    static_shapes: bool


def choose_placement(settings: Settings, cuda_available: bool, bf16_supported: bool) -> Placement:
    """DEVICE/DTYPE/COMPILE/STATIC_SHAPES → what the worker runs (pure)."""
    name = settings.device
    if name == "auto":
        name = "cuda" if cuda_available else "cpu"
    device = torch.device(name)
    on_gpu = device.type == "cuda"
    if settings.dtype == "auto":
        dtype = (torch.bfloat16 if bf16_supported else torch.float16) if on_gpu else torch.float32
    else:
        dtype = getattr(torch, settings.dtype)
    compile_ = on_gpu if settings.compile == "auto" else settings.compile == "true"
    static = (compile_ and on_gpu) if settings.static_shapes == "auto" else settings.static_shapes == "true"
    return Placement(device, dtype, compile_, static)


class Encoder:
    """An AutoModel encoder plus pooling (or a sequence classifier's logits, task classify);
    `run(batch)` → float32 [rows, dim] numpy."""

    def __init__(self, model_dir: str, settings: Settings, placement: Placement, exclude_ids: list[int],
                 task: str = "embed"):
        from transformers import AutoModel, AutoModelForSequenceClassification

        self.placement = placement
        self.settings = settings
        self.task = task
        loader = AutoModelForSequenceClassification if task == "classify" else AutoModel
        model = loader.from_pretrained(model_dir, dtype=placement.dtype, trust_remote_code=settings.trust_remote_code)
        self.model = model.to(placement.device).eval()
        # Output width: the embedding dimension, or one logit per label.
        self.dim = int(self.model.config.num_labels if task == "classify" else self.model.config.hidden_size)
        self.exclude = torch.tensor(exclude_ids, dtype=torch.int64, device=placement.device)
        self._forward = self._eager
        if placement.compile:
            mode = "reduce-overhead" if placement.device.type == "cuda" else None
            self._forward = torch.compile(self._eager, mode=mode, dynamic=False)

    def _eager(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.task == "classify":
            return self.model(input_ids=ids, attention_mask=mask).logits.float()
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        s = self.settings
        return pool(hidden, ids, mask, s.pooling, s.normalize, self.exclude)

    def run(self, batch: Batch) -> np.ndarray:
        dev = self.placement.device
        with torch.inference_mode():
            if dev.type == "cuda":
                ids = batch.input_ids.pin_memory().to(dev, non_blocking=True)
                mask = batch.attention_mask.pin_memory().to(dev, non_blocking=True)
            else:
                ids, mask = batch.input_ids, batch.attention_mask
            out = self._forward(ids, mask)
            if dev.type == "cuda":
                out = out.clone()  # CUDA-graph outputs are overwritten by the next replay
            return out[: batch.rows].cpu().numpy()

    def memory(self) -> dict[str, int]:
        if self.placement.device.type != "cuda":
            return {}
        return {
            "allocated": torch.cuda.memory_allocated(self.placement.device),
            "reserved": torch.cuda.memory_reserved(self.placement.device),
        }


def task_of(config, requested: str) -> str:
    """TASK auto → classify for *ForSequenceClassification checkpoints, else embed."""
    if requested != "auto":
        return requested
    architectures = getattr(config, "architectures", None) or []
    return "classify" if any(a.endswith("ForSequenceClassification") for a in architectures) else "embed"
