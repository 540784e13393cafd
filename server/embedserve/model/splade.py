"""SPLADE pooling, as sentence-transformers' SpladePooling computes it on a masked LM's logits:
log1p(relu(logits × attention mask)) (log1p once more for `log1p_relu`), then the max or the sum
over each row's tokens, then, when the model declares `max_active_dims`, only each row's largest
that many values. On the device, in the model's dtype as sentence-transformers does, in place on
the logits (they are this batch's own, and at [rows, length, vocabulary] the largest tensor of the
pass: a copy would double the peak), and with no host synchronisation, so it runs inside a CUDA
graph. Padded rows only (packed rows serve embeddings: embedserve.model.varlen)."""

from __future__ import annotations

import torch

from embedserve.model.declared import Splade


def splade_pool(logits: torch.Tensor, attention_mask: torch.Tensor, splade: Splade) -> torch.Tensor:
    """[B, L, V] MLM logits (overwritten), [B, L] mask → [B, V] float32, dense: zeros where a row
    has no weight. A padding token's logits become 0, which neither the max (every value is ≥ 0
    after relu) nor the sum sees."""
    x = logits.mul_(attention_mask.unsqueeze(-1).to(logits.dtype)).relu_().log1p_()
    if splade.activation == "log1p_relu":
        x = x.log1p_()
    pooled = (x.amax(dim=1) if splade.strategy == "max" else x.sum(dim=1)).float()
    if splade.max_active_dims is not None and splade.max_active_dims < pooled.shape[-1]:
        # sentence-transformers' select_max_active_dims: the top k by absolute value (all are ≥ 0).
        values, indices = torch.topk(pooled, splade.max_active_dims, dim=-1)
        pooled = torch.zeros_like(pooled).scatter_(-1, indices, values)
    return pooled
