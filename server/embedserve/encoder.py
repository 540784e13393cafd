"""The model on its device: loading, dtype, torch.compile / CUDA graphs, and one forward pass +
pooling per batch. Constructed and used only on the model-worker thread (compiled graphs live there)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from embedserve.config import Settings
from embedserve.cuda_graphs import CudaGraphs
from embedserve.declared import Head
from embedserve.pooling import Pooler
from embedserve.queues import Batch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    compile: bool  # torch.compile (inductor) each shape
    static_shapes: bool
    cuda_graphs: bool = False  # replay one captured CUDA graph per shape
    attention: str = "padded"  # padded rows, or "packed" rows with variable-length attention


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
    mode = ("graphs" if on_gpu else "false") if settings.compile == "auto" else settings.compile
    compile_ = mode == "true"
    graphs = on_gpu and mode in ("graphs", "true")
    static = (graphs or compile_) if settings.static_shapes == "auto" else settings.static_shapes == "true"
    # Without static shapes every new batch shape would capture (or compile) another graph.
    return Placement(device, dtype, compile_, static, graphs and static)


class Encoder:
    """An AutoModel encoder plus pooling (or a sequence classifier's logits, task classify);
    `run(batch)` → float32 [rows, dim] numpy."""

    def __init__(self, model_dir: str, settings: Settings, placement: Placement, exclude_ids: list[int],
                 task: str = "embed", head: Head | None = None):
        from transformers import AutoModel, AutoModelForSequenceClassification

        self.placement = placement
        self.settings = settings
        self.task = task
        if placement.device.type == "cuda":  # cuda:N: this (the worker's) thread loads and captures there
            torch.cuda.set_device(placement.device)
        loader = AutoModelForSequenceClassification if task == "classify" else AutoModel
        model = loader.from_pretrained(model_dir, dtype=placement.dtype, trust_remote_code=settings.trust_remote_code)
        self.model = model.to(placement.device).eval()
        head = head or Head(("mean",), True, (), 512, False, {}, None)
        exclude = torch.tensor(exclude_ids, dtype=torch.int64)
        self.pooler = Pooler(head.pooling, head.dense, head.normalize, exclude).to(placement.device).eval()
        # Output width: the embedding dimension (after any Dense layers), or one logit per label.
        hidden = int(self.model.config.hidden_size)
        self.dim = int(self.model.config.num_labels) if task == "classify" else self.pooler.output_dim(hidden)
        self._forward = self._eager
        if placement.compile:
            # One graph per static shape: let dynamo keep them all rather than fall back to
            # eager after its default 8 recompilations.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
            self._forward = torch.compile(self._eager, dynamic=False)
        if placement.cuda_graphs:
            self._forward = CudaGraphs(self._forward, placement.device)

    def _eager(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.task == "classify":
            return self.model(input_ids=ids, attention_mask=mask).logits.float()
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return self.pooler(hidden, ids, mask)

    def run(self, batch: Batch) -> np.ndarray:
        dev = self.placement.device
        with torch.inference_mode():
            ids, mask = batch.input_ids, batch.attention_mask
            if dev.type == "cuda":  # pinned host memory: the copies to the device run async
                ids, mask = ids.pin_memory(), mask.pin_memory()
                if not self.placement.cuda_graphs:  # graphs copy into their static inputs
                    ids, mask = ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True)
            # .cpu() waits for the result, so a graph's static output is read before its next replay.
            return self._forward(ids, mask)[: batch.rows].cpu().numpy()

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
