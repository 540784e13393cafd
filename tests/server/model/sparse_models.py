"""Tiny SPLADE models for the sparse tests, built and saved as sentence-transformers saves a
SparseEncoder: a 2-layer BertForMaskedLM (fixed seed) with the packaged MiniLM tokenizer."""

from __future__ import annotations

from pathlib import Path


def build_splade(out: Path, model_dir: str, strategy: str = "max", activation: str = "relu",
                 max_active_dims: int | None = None, prompts: dict[str, str] | None = None) -> str:
    """Saved through SparseEncoder(modules=[MLMTransformer, SpladePooling]). The MLM head's bias is
    set so that ~1% of the vocabulary has positive logits on a typical token (sparse rows, as a
    trained SPLADE's are: a random head would weigh half the vocabulary)."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512)
    mlm = BertForMaskedLM(config).eval()
    with torch.no_grad():
        probe = tok(["a probe sentence about sparse retrieval", "another one"], return_tensors="pt", padding=True)
        logits = mlm(**probe).logits.flatten()
        mlm.cls.predictions.bias.sub_(torch.quantile(logits[::7][:100_000], 0.99))
    raw = out / "raw"
    mlm.save_pretrained(raw)
    tok.save_pretrained(raw)
    model = SparseEncoder(modules=[MLMTransformer(str(raw)), SpladePooling(strategy, activation)],
                          prompts=prompts, max_active_dims=max_active_dims, device="cpu")
    model.save(str(out / "splade"))
    return str(out / "splade")
