"""Tiny LLM-based embedders (decoders with last-token pooling) for the tests, saved as
sentence-transformers saves Qwen3-Embedding: Transformer + Pooling(lasttoken) + Normalize, an
instruction prompt in config_sentence_transformers.json, and a tokenizer that appends its eos
token through its post-processor and declares left padding."""

from __future__ import annotations

from pathlib import Path

WORDS = ("the a of to and in is for on with that by query passage document search retrieval sparse dense "
         "vector embedding model server batch token text long short red blue green shoes running fast slow "
         "what how why where instruct given web answer relevant passages retrieve").split()
EOS = "<|endoftext|>"
PROMPTS = {"query": "Instruct: Given a web search query, retrieve relevant passages\nQuery: ", "document": ""}


def build_tokenizer(out: Path, padding_side: str = "left"):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(WORDS + ["instruct:", "query:"]))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A {EOS} $B:1 {EOS}:1",
                                                       special_tokens=[(EOS, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token="<unk>",
                                   padding_side=padding_side, model_max_length=64)
    fast.save_pretrained(out)
    return fast


def build_decoder(out: Path, arch: str = "qwen3", padding_side: str = "left") -> str:
    """A 2-layer decoder of `arch` (qwen3, qwen2, mistral, llama) with a small hidden size, fixed seed,
    saved as a SentenceTransformer with last-token pooling, Normalize and PROMPTS."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import AutoModel, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    raw = out / "raw"
    tokenizer = build_tokenizer(raw, padding_side)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0, eos_token_id=0, bos_token_id=0)
    config = {"qwen3": lambda: Qwen3Config(head_dim=16, **common), "qwen2": lambda: Qwen2Config(**common),
              "mistral": lambda: MistralConfig(**common), "llama": lambda: LlamaConfig(**common)}[arch]()
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(raw)
    transformer = Transformer(str(raw), max_seq_length=64)
    model = SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "lasttoken"),
                                         Normalize()], prompts=PROMPTS, device="cpu")
    model.save(str(out / "st"))
    return str(out / "st")
