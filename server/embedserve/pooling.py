"""Pooling of token states into one vector per row, on the model's device, for the whole batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

STRATEGIES = ("mean", "cls", "last")


def pool(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    strategy: str,
    normalize: bool,
    exclude_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, L, H] token states → [B, H] float32. Mean pooling weights each attended token once,
    minus `exclude_ids` (control tokens), with one isin over the whole batch; rows are
    right-padded, so `last` is the last attended position."""
    if strategy == "mean":
        weights = attention_mask.bool()
        if exclude_ids is not None and exclude_ids.numel():
            weights = weights & ~torch.isin(input_ids, exclude_ids)
        weights = weights.to(hidden.dtype)
        # bmm sums the weighted states in one kernel (fp32 accumulation on GPU).
        summed = torch.bmm(weights.unsqueeze(1), hidden).squeeze(1).float()
        out = summed / weights.sum(dim=1, keepdim=True).float().clamp(min=1.0)
    elif strategy == "cls":
        out = hidden[:, 0].float()
    elif strategy == "last":
        last = attention_mask.sum(dim=1) - 1
        out = hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
    else:
        raise ValueError(f"unknown pooling strategy {strategy!r}; expected one of {STRATEGIES}")
    return F.normalize(out, p=2, dim=-1) if normalize else out
