"""A tiny BGE-M3 for the bgem3 tests, laid out as BAAI/bge-m3 is: an XLMRobertaModel checkpoint
(random weights, fixed seed, saved with save_pretrained), an XLM-R-style tokenizer (a unigram
model with the <s> </s> <pad> <unk> specials, trained here on a few sentences: nothing is
downloaded) and the two heads beside it, `sparse_linear.pt` (Linear(hidden, 1)) and
`colbert_linear.pt` (Linear(hidden, hidden)), state dicts saved with torch.save as FlagEmbedding
saves them."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "BGE-M3 gives three outputs from one pass: dense, sparse and multi-vector.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Sparse retrieval weighs each token of the text; dense retrieval pools them.",
    "ColBERT keeps one vector per token and scores by late interaction.",
    "Embedding servers batch requests by length and run them on the device.",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 . , : ; - ! ?",
]
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # XLM-R's ids 0, 1, 2, 3


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import XLMRobertaTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=SPECIALS, unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    return XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<unk>",
                                   model_max_length=512)


def build_m3(out: Path, colbert_dim: int | None = None) -> str:
    """The checkpoint under `out`/bge-m3-tiny → its path. `colbert_dim`: the ColBERT head's width
    (BGE-M3's is its hidden size)."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(0)
    path = out / "bge-m3-tiny"
    tok = build_tokenizer()
    assert [tok.convert_tokens_to_ids(t) for t in SPECIALS] == [0, 1, 2, 3]
    config = XLMRobertaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=64, max_position_embeddings=514, pad_token_id=1, bos_token_id=0,
                              eos_token_id=2, type_vocab_size=1)
    model = XLMRobertaModel(config).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    sparse = torch.nn.Linear(32, 1)
    colbert = torch.nn.Linear(32, colbert_dim or 32)
    with torch.no_grad():  # about half the tokens weigh > 0 (a random head's bias could zero them all)
        probe = tok(CORPUS, return_tensors="pt", padding=True)
        scores = sparse(model(**probe).last_hidden_state)[probe["attention_mask"].bool()]
        sparse.bias.sub_(scores.median())
    torch.save(sparse.state_dict(), path / "sparse_linear.pt")
    torch.save(colbert.state_dict(), path / "colbert_linear.pt")
    return str(path)


def reference(path: str, texts: list[str], max_length: int = 512) -> dict:
    """BGEM3FlagModel(path, use_fp16=False).encode(texts, return_dense=True, return_sparse=True,
    return_colbert_vecs=True), written from FlagEmbedding 1.4.2's source: FlagEmbedding itself
    cannot import beside transformers 5 (its package imports
    transformers.modeling_attn_mask_utils, gone in 5.x). Each text alone (no padding), float32 on
    the CPU. The lines followed:

    modeling.py (EncoderOnlyEmbedderM3Model):
        _dense_embedding, "cls":  return last_hidden_state[:, 0]
        _sparse_embedding:        token_weights = torch.relu(self.sparse_linear(hidden_state))
        _colbert_embedding:       colbert_vecs = self.colbert_linear(last_hidden_state[:, 1:])
                                  colbert_vecs = colbert_vecs * mask[:, 1:][:, :, None].float()
        forward (inference):      output['dense_vecs'] = F.normalize(output['dense_vecs'], dim=-1)
                                  output['colbert_vecs'] = F.normalize(output['colbert_vecs'], dim=-1)
    inference/embedder/encoder_only/m3.py (M3Embedder.encode_single_device):
        _process_token_weights:   for _token in ['cls_token', 'eos_token', 'pad_token', 'unk_token']: ...
                                      unused_tokens.add(_token_id)
                                  for w, idx in zip(token_weights, input_ids):
                                      if idx not in unused_tokens and w > 0:
                                          if w > result[idx]: result[idx] = w
        _process_colbert_vecs:    tokens_num = np.sum(attention_mask)
                                  return colbert_vecs[:tokens_num - 1]
    runner.py: Linear(hidden, colbert_dim or hidden) and Linear(hidden, 1), loaded from
    colbert_linear.pt and sparse_linear.pt (torch.load(..., weights_only=True)).

    → {"dense_vecs": [n, H], "lexical_weights": [{token id (str): weight}], "colbert_vecs": [[tokens-1, C]]}."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    heads = {}
    for name in ("sparse_linear", "colbert_linear"):
        state = torch.load(f"{path}/{name}.pt", map_location="cpu", weights_only=True)
        heads[name] = torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
        heads[name].load_state_dict(state)
    unused = {tok.convert_tokens_to_ids(tok.special_tokens_map[t])
              for t in ("cls_token", "eos_token", "pad_token", "unk_token") if t in tok.special_tokens_map}
    dense, lexical, colbert = [], [], []
    with torch.no_grad():
        for text in texts:
            enc = tok([text], truncation=True, max_length=max_length, return_tensors="pt")
            hidden = model(**enc, return_dict=True).last_hidden_state
            dense.append(F.normalize(hidden[:, 0], dim=-1)[0].numpy())
            weights = torch.relu(heads["sparse_linear"](hidden)).squeeze(-1)[0].numpy()
            result: dict[str, float] = {}
            for w, idx in zip(weights, enc["input_ids"][0].tolist()):
                if idx not in unused and w > 0 and w > result.get(str(idx), 0):
                    result[str(idx)] = w
            lexical.append(result)
            vecs = heads["colbert_linear"](hidden[:, 1:]) * enc["attention_mask"][:, 1:][:, :, None].float()
            vecs = F.normalize(vecs, dim=-1)[0].numpy()
            colbert.append(vecs[: int(np.sum(enc["attention_mask"][0].numpy())) - 1])
    return {"dense_vecs": np.stack(dense), "lexical_weights": lexical, "colbert_vecs": colbert}
