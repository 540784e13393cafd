"""LLM rerankers (TASK=rerank on a causal LM): which checkpoints are ones, and their score on the
device.

sentence-transformers 6.2 saves one as a CrossEncoder of a text-generation Transformer
(sentence_bert_config.json: transformer_task "text-generation") followed by a `LogitScore`
module (1_LogitScore/config.json: true_token_id, false_token_id): the score of a pair is the
causal LM's logit of the true token at the prompt's last position, minus the false token's when
there is one (log-odds), and predict() puts it through the CrossEncoder's activation (one label:
Sigmoid unless config_sentence_transformers.json names another; embedserve.model.activation).
A plain *ForCausalLM checkpoint (no modules.json: the original Qwen3-Reranker layout) is what
`CrossEncoder(path)` loads the same way with the tokenizer's "yes" and "no" as the two tokens
(CrossEncoder._load_default_modules, on config.architectures[0] ending in ForCausalLM): it
declares nothing, so it stays an embedder under TASK=auto (decoder embedders exist) and is
served so only with TASK=rerank.

How a pair becomes the prompt is embedserve.batching.prompted_pairs (chat template) or the
tokenizer's pair encoding (no template).

On the device only the last real token of each row reaches the LM head, and only the head's two
rows for the answer tokens: [rows, hidden] @ [hidden, 2], not [rows, length, vocabulary].
sentence-transformers pads on the left and reads position -1; our rows are right-padded (or
packed), so each row's last token is at its length - 1 (cu_seqlens[i + 1] - 1 packed), found on
the device with no host synchronisation (the pass runs inside a captured CUDA graph).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from embedserve.config import ConfigError
from embedserve.model import varlen
from embedserve.model.declared import DeclarationError

MODULE = "LogitScore"  # modules.json's type ends in it


@dataclasses.dataclass(frozen=True)
class LogitScore:
    """The answer tokens whose logits score a pair (false_id None: the true token's logit alone)."""

    true_id: int
    false_id: int | None = None


def _json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def is_causal_lm(config) -> bool:
    """CrossEncoder's test: the checkpoint's first architecture is a *ForCausalLM."""
    architectures = getattr(config, "architectures", None) or []
    return bool(architectures) and str(architectures[0]).endswith("ForCausalLM")


def read(model_dir: str | Path, config, hf_tokenizer, requested: str) -> LogitScore | None:
    """The model's answer tokens when it is served as an LLM reranker (None: it is not one).
    Declared: modules.json's LogitScore (any TASK but auto and rerank refused: such a model
    scores pairs only). Undeclared: TASK=rerank on a plain *ForCausalLM checkpoint, the
    tokenizer's "yes" and "no" (refused, as CrossEncoder refuses it, when it lacks them)."""
    root = Path(model_dir)
    modules = _json(root / "modules.json")
    if modules:
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        if MODULE not in kinds:
            return None
        first = _json(root / modules[0].get("path", "") / "sentence_bert_config.json") or {}
        if kinds != ["Transformer", MODULE] or first.get("transformer_task") != "text-generation":
            raise DeclarationError(f"a CrossEncoder of modules {', '.join(kinds)}: this server serves an LLM reranker "
                                   "as a text-generation Transformer followed by LogitScore only")
        said = _json(root / modules[1].get("path", "") / "config.json") or {}
        if said.get("module_input_name", "causal_logits") != "causal_logits":
            raise DeclarationError(f"LogitScore reads {said['module_input_name']!r}; this server scores causal_logits")
        if requested not in ("auto", "rerank"):
            raise DeclarationError(f"TASK={requested}: this model is an LLM reranker (LogitScore), served as TASK=rerank")
        if not is_causal_lm(config):
            raise DeclarationError(f"LogitScore over a model of architecture {getattr(config, 'architectures', None)}: "
                                   "an LLM reranker's checkpoint is a *ForCausalLM")
        true_id, false_id = said.get("true_token_id"), said.get("false_token_id")
        ids = [i for i in (true_id, false_id) if i is not None]
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        if true_id is None or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab for i in ids):
            raise DeclarationError(f"LogitScore declares token ids {true_id!r}/{false_id!r}, "
                                   f"not ids of the model's vocabulary of {vocab}")
        return LogitScore(true_id, false_id)
    if requested != "rerank" or not is_causal_lm(config):
        return None
    yes, no = (hf_tokenizer.convert_tokens_to_ids(t) for t in ("yes", "no"))
    if yes is None or no is None:
        raise DeclarationError("TASK=rerank on a *ForCausalLM checkpoint scores a pair by its 'yes' and 'no' tokens "
                               "(as sentence-transformers' CrossEncoder does), and this tokenizer lacks them")
    return LogitScore(int(yes), int(no))


class Answer(torch.nn.Module):
    """The LM head's rows for the answer tokens, copied out of it at load ([k, hidden], k = 1 or
    2, and the bias's entries), and what the model's own forward does to its logits after the
    head: [N, hidden] states of the rows' last tokens → [N, 1] float32 scores. Copies, so that an
    untied head ([vocabulary, hidden]: 1.2 GB of Qwen3-Reranker-8B's in bf16) can be let go
    (`shed`) once the load-time check has used it."""

    def __init__(self, model, score: LogitScore):
        super().__init__()
        head = model.get_output_embeddings()
        ids = [score.true_id] if score.false_id is None else [score.true_id, score.false_id]
        self.register_buffer("weight", torch.stack([head.weight[i] for i in ids]).detach().clone())
        bias = getattr(head, "bias", None)
        self.register_buffer("bias", None if bias is None else torch.stack([bias[i] for i in ids]).detach().clone())
        config = model.config
        # Cohere multiplies its logits by logit_scale, Granite divides them by logits_scaling,
        # Gemma 2/3 soft-cap them (cap · tanh(logits / cap)).
        self.scale = float(getattr(model, "logit_scale", None) or 1.0) / float(getattr(config, "logits_scaling", None) or 1.0)
        self.cap = float(getattr(config, "final_logit_softcapping", None) or 0.0)
        self.pair = score.false_id is not None

    def forward(self, last: torch.Tensor) -> torch.Tensor:
        logits = last.to(self.weight.dtype) @ self.weight.T
        if self.bias is not None:
            logits = logits + self.bias
        logits = logits.float() * self.scale
        if self.cap:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits[:, :1] - logits[:, 1:] if self.pair else logits


def shed(model) -> bool:
    """Let an untied LM head go (the Answer holds its rows that are read): the model's full
    forward is never run again. A head tied to the input embeddings stays (it is them).
    → whether it went."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or getattr(head, "weight", None) is None or head.weight.data_ptr() == embeddings.weight.data_ptr():
        return False
    model.set_output_embeddings(torch.nn.Identity())
    return True


def padded(model, answer: Answer, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Right-padded rows ([B, L] ids and mask) → [B, 1] float32 scores. A row of no tokens
    (a captured shape's dummy) reads position -1: garbage, never an error (it is not returned)."""
    hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    last = mask.sum(dim=1) - 1
    return answer(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])


def packed(model, answer: Answer, ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
           max_len: int) -> torch.Tensor:
    """Packed rows ([T] tensors, embedserve.model.batches; decoders rotate from position 0) →
    [S, 1] float32 scores, row i's last token being cu_seqlens[i + 1] - 1."""
    hidden = model.base_model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                              cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_len,
                              max_length_k=max_len).last_hidden_state[0]
    return answer(hidden[(cu_seqlens[1:].long() - 1).clamp(min=0)])


def check(model, answer: Answer, score: LogitScore, device: torch.device, dtype: torch.dtype) -> None:
    """At load: the two-row score against the model's own forward (every logit of the vocabulary,
    read at each row's last real token) on a few right-padded rows, so a model class that does
    more to its logits than Answer knows is refused, not served wrong. ConfigError when
    they differ."""
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 3, 12])
    ids = torch.randint(0, vocab, (3, 12), generator=gen)
    mask = (torch.arange(12)[None, :] < lengths[:, None]).long()
    ids, mask = ids.to(device), mask.to(device)
    packed_rows = getattr(model.config, "_attn_implementation", None) == varlen.NAME
    try:
        if packed_rows:  # the padded rows of this check through transformers' own attention
            model.set_attn_implementation("sdpa" if getattr(model, "_supports_sdpa", False) else "eager")
        with torch.inference_mode():
            got = padded(model, answer, ids, mask)[:, 0].float()
            full = model(input_ids=ids, attention_mask=mask).logits.float()
    finally:
        if packed_rows:
            model.set_attn_implementation(varlen.NAME)
    with torch.inference_mode():
        last = full[torch.arange(3, device=device), mask.sum(dim=1) - 1]
        want = last[:, score.true_id] - (0 if score.false_id is None else last[:, score.false_id])
    tolerance = (5e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4) * max(1.0, float(want.abs().max()))
    error = float((got - want).abs().max())
    if not error <= tolerance:  # NaN fails too
        raise ConfigError(f"LLM reranker: the answer tokens' logits from the LM head's two rows differ from the "
                          f"model's own forward by {error:.3g} (> {tolerance:.3g}): this model class transforms its "
                          "logits in a way this server does not know")
