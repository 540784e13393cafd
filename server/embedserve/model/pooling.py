"""Token states → one vector per row, on the model's device, for the whole batch: the pooling modes
sentence-transformers offers (concatenated when several are declared), then its Dense layers and
Normalize, as the model declares them (embedserve.model.declared). Rows are right-padded; sums
accumulate in float32 (one bmm in the model's dtype, its result rounded to that dtype, as
sentence-transformers' own sum is). Packed rows (embedserve.model.batches) pool per segment of one
token stream, in float32 throughout, then the same head."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from embedserve.model.declared import POOLING_MODES, DeclarationError


def member(ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """ids ∈ values, elementwise. Not torch.isin: past ~10·n^0.145 values it sorts and calls
    _unique, a device-to-host sync that breaks CUDA-graph capture (a ColBERT skiplist of 32
    punctuation ids crosses that for any batch under ~3,000 tokens). One broadcast compare: no sync."""
    return (ids.unsqueeze(-1) == values).any(dim=-1)


def pool(hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, mode: str,
         exclude_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, L, H] → [B, H] float32 for one mode. The mean modes weigh each attended token once,
    minus `exclude_ids` (control tokens; EXCLUDE_TOKENS, a deliberate deviation from
    sentence-transformers), with one comparison over the whole batch (`member`)."""
    mask = attention_mask.bool()
    if mode == "cls":
        return hidden[:, 0].float()
    if mode == "lasttoken":
        last = attention_mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
    if mode == "max":
        return hidden.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(dim=1).float()
    if mode not in ("mean", "mean_sqrt_len_tokens", "weightedmean"):
        raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")
    weights = mask
    if exclude_ids is not None and exclude_ids.numel():
        weights = weights & ~member(input_ids, exclude_ids)
    weights = weights.float()
    if mode == "weightedmean":  # position 1, 2, ... of each (right-padded) row
        weights = weights * torch.arange(1, weights.shape[1] + 1, device=weights.device, dtype=weights.dtype)
    # bmm sums the weighted states in one kernel (fp32 accumulation on GPU).
    summed = torch.bmm(weights.unsqueeze(1).to(hidden.dtype), hidden).squeeze(1).float()
    total = weights.sum(dim=1, keepdim=True).clamp(min=1e-9)
    return summed / (total.sqrt() if mode == "mean_sqrt_len_tokens" else total)


def pool_segments(hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor,
                  cu_seqlens: torch.Tensor, mode: str, exclude_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Packed rows: [T, H] states of rows laid end to end → [S, H] float32, row i being tokens
    cu_seqlens[i]:cu_seqlens[i + 1] (`segments`: each token's row; `positions`: 0, 1, ... within
    it). What pool() computes on the padded layout, by scatter instead of a padded reduction, and
    with no host synchronisation (it runs inside a CUDA graph). Zero-length rows give garbage,
    never an error: the caller keeps only its real rows."""
    slots, total, width = cu_seqlens.numel() - 1, hidden.shape[0], hidden.shape[1]
    if mode == "cls":
        return hidden[cu_seqlens[:-1].long().clamp(max=total - 1)].float()
    if mode == "lasttoken":
        return hidden[(cu_seqlens[1:].long() - 1).clamp(min=0)].float()
    if mode == "max":
        out = hidden.new_full((slots, width), float("-inf"), dtype=torch.float32)
        return out.scatter_reduce_(0, segments.unsqueeze(1).expand(-1, width), hidden.float(), "amax")
    if mode not in ("mean", "mean_sqrt_len_tokens", "weightedmean"):
        raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")
    weights = torch.ones(total, dtype=torch.float32, device=hidden.device)
    if exclude_ids is not None and exclude_ids.numel():
        weights = weights * ~member(input_ids, exclude_ids)
    if mode == "weightedmean":  # position 1, 2, ... within each row
        weights = weights * (positions + 1)
    summed = hidden.new_zeros((slots, width), dtype=torch.float32).index_add_(0, segments, hidden.float() * weights[:, None])
    count = weights.new_zeros(slots).index_add_(0, segments, weights).clamp(min=1e-9).unsqueeze(1)
    return summed / (count.sqrt() if mode == "mean_sqrt_len_tokens" else count)


def _activation(name: str) -> nn.Module:
    """A Dense module's activation, by its torch class path: only torch.nn's own classes (a path
    elsewhere would import code from the model repository)."""
    cls = getattr(nn, name.rsplit(".", 1)[-1], None) if name.startswith("torch.") else None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise DeclarationError(f"Dense activation_function {name!r} is not a torch.nn module")
    return cls()


def load_dense(path: Path) -> nn.Sequential:
    """A sentence-transformers Dense module directory → Linear + activation (float32)."""
    import json

    config = json.loads((path / "config.json").read_text())
    if config.get("use_residual"):
        raise DeclarationError(f"{path.name}: Dense with use_residual is not supported")
    linear = nn.Linear(config["in_features"], config["out_features"], bias=config.get("bias", True))
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(path / "model.safetensors"))
    else:
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    linear.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
    return nn.Sequential(linear, _activation(config.get("activation_function", "torch.nn.modules.activation.Tanh")))


class Pooler(nn.Module):
    """Pooling modes (concatenated), Dense layers, Normalize: everything after the transformer."""

    def __init__(self, modes: tuple[str, ...], dense: tuple[Path, ...], normalize: bool,
                 exclude_ids: torch.Tensor | None = None, norms: bool = False):
        super().__init__()
        self.modes, self.normalize = modes, normalize
        # LONG_TEXTS=window: each row's norm before Normalize, as one more column (`head`), so
        # windows can be pooled before Normalize (embedserve.batching.windows); off, the forward
        # is what it always was.
        self.norms = norms and normalize
        self.dense = nn.Sequential(*(load_dense(p) for p in dense))
        self.register_buffer("exclude", exclude_ids if exclude_ids is not None else torch.zeros(0, dtype=torch.int64))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head([pool(hidden, input_ids, attention_mask, m, self.exclude) for m in self.modes])

    def packed(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor,
               cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed rows ([T, H] states) → [S, dim]; see pool_segments."""
        return self.head([pool_segments(hidden, input_ids, positions, segments, cu_seqlens, m, self.exclude)
                          for m in self.modes])

    def head(self, pooled: list[torch.Tensor]) -> torch.Tensor:
        """One pooled [rows, H] tensor per mode → concatenated, Dense layers, Normalize."""
        out = self.dense(pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=-1))
        if self.norms:  # the same normalized vector, its norm beside it: in the graph, no host sync
            return torch.cat([F.normalize(out, p=2, dim=-1), torch.linalg.vector_norm(out, dim=-1, keepdim=True)], dim=-1)
        return F.normalize(out, p=2, dim=-1) if self.normalize else out

    def output_dim(self, hidden_size: int) -> int:
        layers = [m[0] for m in self.dense]
        return layers[-1].out_features if layers else hidden_size * len(self.modes)
