"""A multi-vector model's token vectors on the device: the encoder's token states, the Dense
projections, the L2 normalization of each token vector, and which tokens a row keeps, for the
whole padded batch, with no host synchronisation (it runs inside a captured CUDA graph).

A row says which side it is, and which of its tokens are query expansion, in its own ids (bits
above any vocabulary: QUERY on its first id, EXPANSION on each expansion token), put there by the
tokenizer (embedserve.batching.multivector_tokenization). Rows cross the queues, the batches and
IPC as ids and lengths, like every other row: marked so, nothing between the tokenizer and the
model needs to know the side, and one batch may hold queries and documents together.

What each side needs where it is known:
- the expansion's tokens are in the row (the tokenizer pads queries with the mask token), so the
  batch's lengths count them and admission, buckets and usage see the tokens the model computes;
- attend=False (ColBERT's classic expansion): the expansion tokens are computed but not attended
  to, so the attention mask leaves them out here, while the kept mask keeps them;
- the skiplist (punctuation) leaves documents' vectors here, by id, after the forward: the encoder
  reads the punctuation (it is context for the other tokens), MaxSim does not score it.
`forward` → [rows, length, dim + 1] float32: each token's vector, then 1.0 where the row keeps it;
the worker cuts out the kept ones (TokenRows.from_padded) so no padding crosses to the host."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from embedserve.model.colbert import EXPANSION, ID_BITS, QUERY
from embedserve.model.pooling import load_dense, member


class TokenHead(nn.Module):
    def __init__(self, dense: tuple[Path, ...], normalize: bool, skiplist_ids: list[int], attend_expansion: bool,
                 skiplist_queries: bool = False):
        super().__init__()
        self.dense = nn.Sequential(*(load_dense(p) for p in dense))
        self.normalize, self.attend_expansion, self.skiplist_queries = normalize, attend_expansion, skiplist_queries
        self.register_buffer("skip", torch.tensor(skiplist_ids, dtype=torch.int64))

    @classmethod
    def declared(cls, mv) -> "TokenHead":
        """From the model's declaration (embedserve.model.colbert.MultiVector, ids resolved)."""
        attend = mv.expansion is None or mv.expansion.attend
        return cls(mv.dense, mv.normalize, list(mv.skiplist_ids), attend, "query" in mv.skiplist_tasks)

    def output_dim(self, hidden_size: int) -> int:
        layers = [m[0] for m in self.dense]
        return layers[-1].out_features if layers else hidden_size

    def forward(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        query = (ids[:, :1] & QUERY) != 0  # [B, 1]
        expansion = (ids & EXPANSION) != 0
        ids = ids & ID_BITS
        real = mask.bool()
        attend = real if self.attend_expansion else real & ~expansion
        hidden = model(input_ids=ids, attention_mask=attend.to(mask.dtype)).last_hidden_state
        # The Dense layers in float32 (as the sentence-level head's, embedserve.model.pooling).
        x = self.dense(hidden.float())
        if self.normalize:
            x = F.normalize(x, p=2, dim=-1)
        keep = real
        if self.skip.numel():
            skipped = member(ids, self.skip)  # never torch.isin: a host sync past a few ids (pooling.member)
            # Documents always; queries too where the model lists them in skiplist_tasks.
            keep = keep & ~(skipped & (~query | self.skiplist_queries))
        return torch.cat((x, keep.unsqueeze(-1).to(x.dtype)), dim=-1)


def kept_rows(out: torch.Tensor):
    """forward's [rows, length, dim + 1] on the host → TokenRows of the kept tokens."""
    from embedserve.model.token_rows import TokenRows

    states = out.numpy()
    return TokenRows.from_padded(states[..., :-1], states[..., -1] > 0.5)
