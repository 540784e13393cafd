"""Tiny multi-vector (ColBERT) models for the multi-vector tests, built and saved as
sentence-transformers 6.2 saves a MultiVectorEncoder: a 2-layer BERT (fixed seed) with the
packaged MiniLM tokenizer, a token-level Dense projection, the MultiVectorMask (skiplist) and a
token-level Normalize; and the same weights laid out as PyLate (v3) saves a ColBERT model."""

from __future__ import annotations

import json
import string
from pathlib import Path


def build_colbert(out: Path, model_dir: str, *, attend: bool = False, strategy: str = "fixed", length: int = 12,
                  dim: int = 16, prompts: dict[str, str] | None = None, document_length: int | None = None,
                  skiplist: list[str] | None = None, max_seq_length: int | None = None) -> str:
    """Saved through MultiVectorEncoder(modules=[Transformer, Dense, MultiVectorMask, Normalize])."""
    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512)
    raw = out / "raw"
    BertModel(config).eval().save_pretrained(raw)
    tok.save_pretrained(raw)
    transformer = Transformer(str(raw), document_length=document_length, max_seq_length=max_seq_length,
                              query_expansion={"strategy": strategy, "attend": attend, "length": length})
    dense = Dense(32, dim, bias=False, activation_function=torch.nn.Identity(), module_input_name="token_embeddings")
    mask = MultiVectorMask(skiplist_words=list(string.punctuation) if skiplist is None else skiplist)
    model = MultiVectorEncoder(modules=[transformer, dense, mask, Normalize(module_input_name="token_embeddings")],
                               prompts={"query": "query: ", "document": "passage: "} if prompts is None else prompts,
                               device="cpu")
    model.save(str(out / "colbert"))
    return str(out / "colbert")


def build_pylate(out: Path, model_dir: str, query_length: int = 12, attend: bool = False) -> str:
    """The same kind of model as PyLate (v3) saves one: [Transformer, Dense] in modules.json (the
    Dense as pylate.models.Dense.Dense), the ColBERT settings at the top of
    config_sentence_transformers.json (model_type "ColBERT", query_prefix "[Q] ", document_prefix
    "[D] ", query_length, document_length, attend_to_expansion_tokens, skiplist_words), and the
    prefixes added to the tokenizer's vocabulary (the embedding table grown to hold them)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_tokens(["[Q] ", "[D] "])
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512)
    root = out / "pylate"
    BertModel(config).eval().save_pretrained(root)
    tok.save_pretrained(root)
    (root / "1_Dense").mkdir(parents=True)
    linear = torch.nn.Linear(32, 16, bias=False)
    from safetensors.torch import save_file

    save_file({"linear.weight": linear.weight.detach().contiguous()}, str(root / "1_Dense" / "model.safetensors"))
    (root / "1_Dense" / "config.json").write_text(json.dumps(
        {"in_features": 32, "out_features": 16, "bias": False, "activation_function": "torch.nn.modules.linear.Identity"}))
    (root / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]))
    (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    (root / "config_sentence_transformers.json").write_text(json.dumps({
        "__version__": {"sentence_transformers": "3.4.1", "pylate": "1.1.7"}, "model_type": "ColBERT",
        "prompts": {}, "default_prompt_name": None, "similarity_fn_name": "MaxSim",
        "query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": query_length, "document_length": 48,
        "attend_to_expansion_tokens": attend, "skiplist_words": list(string.punctuation)}))
    return str(root)
