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

Device side (`M3Heads.forward`, padded rows; `packed`, packed rows): pure tensor ops, no host
synchronisation, so it runs inside a captured CUDA graph; one float32 output (CudaGraphs keeps one
static output per shape): the dense rows, each token's sparse weight, each token's ColBERT vector.
Every row computes all three (the heads cost ~1/12 of one encoder layer); what crosses to the host
is what each row asked for, told by flags on its first id (embedserve.model.m3_rows.FLAGS): a
dense-only batch copies its [rows, H] and nothing else, as an embed model's would.
Host side (`unpack`, `unpack_packed`): the sparse weights travel as one per token (not a
[B, vocabulary] scatter: 250,002 floats a row for BGE-M3's vocabulary would be ~1 MB a text
across the bus, against 2 KB), and are reduced per token id here, on the model worker's thread,
from the ids the host already has. Only asked rows' real tokens' ColBERT vectors are copied off
the device (picked by index before the copy)."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from embedserve.model.m3_rows import COLBERT, ID_BITS, SPARSE, M3Rows, asked_rows
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

    def packed(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed rows' [T, H] states → one flat float32 tensor: the S rows' dense vectors (each
        row's first token, CLS), then every token's sparse weight [T], then every token's ColBERT
        vector [T, C] (`unpack_packed` keeps a row's tokens after its first). Static in T and S."""
        starts = cu_seqlens[:-1].long().clamp(max=hidden.shape[0] - 1)  # zero-length rows: any token, never read
        dense = F.normalize(hidden[starts].float(), dim=-1)
        weights = torch.relu(self.sparse_linear(hidden)).squeeze(-1).float()
        colbert = F.normalize(self.colbert_linear(hidden).float(), dim=-1)
        return torch.cat([dense.reshape(-1), weights, colbert.reshape(-1)])

    def unpack(self, out: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, rows: int, vocab: int,
               unused: np.ndarray) -> M3Rows:
        """`forward`'s output (on the device, still valid: read before the next batch), the
        batch's host ids (flags on their first column) and mask ([B, L]), its real row count → the
        rows on the host: each row's asked outputs (dense always), nothing else copied."""
        hidden, length = self.hidden, int(ids.shape[1])
        host = ids[:rows].numpy()
        sparse_rows, colbert_rows = asked_rows(host[:, 0], SPARSE), asked_rows(host[:, 0], COLBERT)
        head = out[:rows, : hidden + length if sparse_rows.any() else hidden].cpu().numpy()  # waits for the forward
        keep = mask[:rows, 1:].bool() & torch.from_numpy(colbert_rows)[:, None]  # after CLS, no padding
        r, t = torch.nonzero(keep, as_tuple=True)  # host tensors: no device sync
        tokens = out[:, hidden + length:].view(out.shape[0], length - 1, self.colbert_dim)
        picked = tokens[r.to(out.device), t.to(out.device)].cpu().numpy() if len(r) else None
        real = mask[:rows].numpy().astype(bool) & sparse_rows[:, None]
        sparse = lexical_weights(host & ID_BITS, head[:, hidden:] if sparse_rows.any() else np.zeros(real.shape, np.float32),
                                 real, unused, vocab)
        return M3Rows(np.ascontiguousarray(head[:, :hidden]), sparse,
                      self._token_rows(picked, keep.sum(dim=1).numpy(), rows))

    def unpack_packed(self, out: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                      rows: int, vocab: int, unused: np.ndarray) -> M3Rows:
        """`packed`'s output and the packed batch's host tensors → the rows on the host, as
        `unpack`: a row's ColBERT vectors are its tokens after its first, its </s> included."""
        hidden, size, slots = self.hidden, int(ids.shape[0]), int(cu_seqlens.shape[0]) - 1
        cu = cu_seqlens[: rows + 1].numpy().astype(np.int64)
        real = int(cu[-1])
        host, lengths = ids[:real].numpy(), np.diff(cu)
        segment = np.repeat(np.arange(rows), lengths)  # each real token's row
        sparse_rows, colbert_rows = asked_rows(host[cu[:-1]], SPARSE), asked_rows(host[cu[:-1]], COLBERT)
        dense = out[: rows * hidden].view(rows, hidden).cpu().numpy()  # waits for the forward
        at = slots * hidden
        chosen = sparse_rows[segment]
        weights = out[at: at + real].cpu().numpy() if chosen.any() else np.zeros(real, np.float32)
        sparse = _lexical(segment[chosen], host[chosen] & ID_BITS, weights[chosen], unused, vocab, rows)
        keep = colbert_rows[segment] & (positions[:real].numpy() > 0)
        index = torch.from_numpy(np.flatnonzero(keep))
        tokens = out[at + size:].view(size, self.colbert_dim)
        picked = tokens[index.to(out.device)].cpu().numpy() if len(index) else None
        return M3Rows(np.ascontiguousarray(dense), sparse,
                      self._token_rows(picked, np.bincount(segment[keep], minlength=rows), rows))

    def _token_rows(self, picked: np.ndarray | None, counts: np.ndarray, rows: int) -> TokenRows:
        offsets = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        vectors = np.zeros((0, self.colbert_dim), np.float32) if picked is None else picked
        return TokenRows(np.ascontiguousarray(vectors, dtype=np.float32), offsets)


def lexical_weights(ids: np.ndarray, weights: np.ndarray, mask: np.ndarray, unused: np.ndarray,
                    vocab: int) -> SparseRows:
    """[rows, L] token ids, their weights (≥ 0) and mask → per row each token id's largest weight,
    over weights > 0 and ids not `unused`, as CSR (ids ascending). Pure numpy."""
    r, t = np.nonzero(mask.astype(bool))
    return _lexical(r, ids[r, t], weights[r, t], unused, vocab, ids.shape[0])


def _lexical(r: np.ndarray, ids: np.ndarray, weights: np.ndarray, unused: np.ndarray, vocab: int,
             rows: int) -> SparseRows:
    """Tokens as (row, id, weight) → `lexical_weights`' CSR of `rows` rows."""
    keep = (weights > 0) & ~np.isin(ids, unused)
    key = r[keep].astype(np.int64) * vocab + ids[keep].astype(np.int64)
    w = weights[keep].astype(np.float32)
    order = np.lexsort((-w, key))  # by (row, id), largest weight first within each
    key, w = key[order], w[order]
    first = np.ones(len(key), dtype=bool)
    first[1:] = key[1:] != key[:-1]
    key, w = key[first], w[first]
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(key // vocab, minlength=rows), out=offsets[1:])
    return SparseRows((key % vocab).astype(np.int32), np.ascontiguousarray(w), offsets, vocab)
