"""BGE-M3 (task bgem3): the checkpoint's two heads beside its XLM-R encoder, and its three outputs
from one forward pass, as FlagEmbedding 1.4.2 computes them (BGEM3FlagModel, i.e.
FlagEmbedding/finetune/embedder/encoder_only/m3/modeling.py and
inference/embedder/encoder_only/m3.py; the lines followed are quoted where they apply):

- dense: the CLS token's state, L2-normalized (`last_hidden_state[:, 0]`, then
  `F.normalize(dense_vecs, dim=-1)`);
- sparse (lexical weights): `torch.relu(self.sparse_linear(hidden_state))` per token, then per
  text each token id's largest weight, over weights > 0, leaving out the tokenizer's cls, eos, pad
  and unk ids (`if idx not in unused_tokens and w > 0: if w > result[idx]: result[idx] = w`);
- ColBERT: `self.colbert_linear(last_hidden_state[:, 1:])`, times the attention mask, then
  `F.normalize(colbert_vecs, dim=-1)`; a text keeps `colbert_vecs[:tokens_num - 1]`: every token
  after CLS, its final </s> included, no padding.

The heads are `sparse_linear.pt` (Linear(hidden, 1)) and `colbert_linear.pt` (Linear(hidden,
colbert_dim)), state dicts saved with torch.save as the published BAAI/bge-m3 lays them out.

Device side (`M3Heads.forward`): pure tensor ops on the padded batch, no host synchronisation, so
it runs inside a captured CUDA graph; one [B, H + L + (L-1)·C] float32 output (CudaGraphs keeps one
static output per shape): the dense rows, each token's sparse weight, each token's ColBERT vector.
Host side (`unpack`): the sparse weights travel as [B, L] (not a [B, vocabulary] scatter: 250,002
floats a row for BGE-M3's vocabulary would be ~1 MB a text across the bus, against 2 KB), and are
reduced per token id here, on the model worker's thread, from the ids the host already has. Only
real tokens' ColBERT vectors are copied off the device (picked by index before the copy)."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from embedserve.model.m3_rows import M3Rows
from embedserve.model.sparse_rows import SparseRows
from embedserve.model.token_rows import TokenRows

SPARSE_FILE, COLBERT_FILE = "sparse_linear.pt", "colbert_linear.pt"
# FlagEmbedding's unused_tokens: ['cls_token', 'eos_token', 'pad_token', 'unk_token'].
UNUSED_TOKENS = ("cls", "eos", "pad", "unk")


def has_heads(model_dir: str) -> bool:
    """Both BGE-M3 head files beside the checkpoint: what TASK=auto reads as bgem3."""
    return all(os.path.isfile(os.path.join(model_dir, f)) for f in (SPARSE_FILE, COLBERT_FILE))


def unused_ids(tokenizer) -> list[int]:
    """The token ids whose lexical weight is never reported (FlagEmbedding's unused_tokens)."""
    ids = (getattr(tokenizer, f"{name}_token_id", None) for name in UNUSED_TOKENS)
    return sorted({int(i) for i in ids if i is not None})


def _linear(state: dict) -> torch.nn.Linear:
    weight = state["weight"]
    linear = torch.nn.Linear(int(weight.shape[1]), int(weight.shape[0]), bias="bias" in state)
    linear.load_state_dict(state)
    return linear


class M3Heads(torch.nn.Module):
    """The sparse and ColBERT heads, and the three outputs' device-side arithmetic."""

    def __init__(self, sparse: torch.nn.Linear, colbert: torch.nn.Linear, hidden: int):
        super().__init__()
        if sparse.in_features != hidden or colbert.in_features != hidden or sparse.out_features != 1:
            raise ValueError(f"BGE-M3 heads of shapes sparse {tuple(sparse.weight.shape)}, colbert "
                             f"{tuple(colbert.weight.shape)} do not fit an encoder of hidden size {hidden} "
                             "(expected sparse [1, hidden], colbert [dim, hidden])")
        self.sparse_linear, self.colbert_linear, self.hidden = sparse, colbert, hidden

    @property
    def colbert_dim(self) -> int:
        return int(self.colbert_linear.out_features)

    @classmethod
    def load(cls, model_dir: str, hidden: int) -> "M3Heads":
        def state(name: str) -> dict:
            return torch.load(os.path.join(model_dir, name), map_location="cpu", weights_only=True)

        return cls(_linear(state(SPARSE_FILE)), _linear(state(COLBERT_FILE)), hidden)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, L, H] last hidden states, [B, L] attention mask → [B, H + L + (L-1)·C] float32:
        dense, sparse weight per token, ColBERT vector per token after CLS (zero on padding)."""
        rows = hidden.shape[0]
        dense = F.normalize(hidden[:, 0].float(), dim=-1)
        weights = torch.relu(self.sparse_linear(hidden)).squeeze(-1).float()
        colbert = self.colbert_linear(hidden[:, 1:]) * mask[:, 1:, None].to(hidden.dtype)
        colbert = F.normalize(colbert.float(), dim=-1)
        return torch.cat([dense, weights, colbert.reshape(rows, -1)], dim=1)

    def unpack(self, out: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, rows: int, vocab: int,
               unused: np.ndarray) -> M3Rows:
        """`forward`'s output (on the device, still valid: read before the next batch), the
        batch's host ids and mask ([B, L]), its real row count → the rows on the host."""
        hidden, length = self.hidden, int(ids.shape[1])
        head = out[:rows, : hidden + length].cpu().numpy()  # waits for the forward
        keep = mask[:rows, 1:].bool()  # ColBERT: the tokens after CLS, padding left out
        r, t = torch.nonzero(keep, as_tuple=True)  # host tensors: no device sync
        tokens = out[:, hidden + length:].view(out.shape[0], length - 1, self.colbert_dim)
        picked = tokens[r.to(out.device), t.to(out.device)].cpu().numpy() if len(r) else \
            np.zeros((0, self.colbert_dim), np.float32)
        offsets = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(keep.sum(dim=1).numpy(), out=offsets[1:])
        sparse = lexical_weights(ids[:rows].numpy(), head[:, hidden:], mask[:rows].numpy(), unused, vocab)
        return M3Rows(np.ascontiguousarray(head[:, :hidden]), sparse,
                      TokenRows(np.ascontiguousarray(picked, dtype=np.float32), offsets))


def lexical_weights(ids: np.ndarray, weights: np.ndarray, mask: np.ndarray, unused: np.ndarray,
                    vocab: int) -> SparseRows:
    """[rows, L] token ids, their weights (≥ 0) and mask → per row each token id's largest weight,
    over weights > 0 and ids not `unused`, as CSR (ids ascending). Pure numpy."""
    keep = mask.astype(bool) & (weights > 0) & ~np.isin(ids, unused)
    r, t = np.nonzero(keep)
    key = r.astype(np.int64) * vocab + ids[r, t].astype(np.int64)
    w = weights[r, t].astype(np.float32)
    order = np.lexsort((-w, key))  # by (row, id), largest weight first within each
    key, w = key[order], w[order]
    first = np.ones(len(key), dtype=bool)
    first[1:] = key[1:] != key[:-1]
    key, w = key[first], w[first]
    offsets = np.zeros(ids.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(key // vocab, minlength=ids.shape[0]), out=offsets[1:])
    return SparseRows((key % vocab).astype(np.int32), np.ascontiguousarray(w), offsets, vocab)
