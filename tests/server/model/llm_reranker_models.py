"""Tiny LLM rerankers for the tests: a 2-layer Qwen3ForCausalLM with random weights (fixed seed)
and a byte-level BPE tokenizer trained here (as Qwen's: special tokens written by the chat
template, "yes" and "no" single tokens, merges across words), saved three ways:

- `st`: as sentence-transformers 6.2 saves an LLM reranker: CrossEncoder(plain checkpoint) (a
  text-generation Transformer and LogitScore over "yes"/"no"), with a chat template in the
  Qwen3-Reranker style (the query and document roles, the default prompt as <Instruct>) and a
  default prompt;
- `plain`: the original Qwen3-Reranker layout, a plain *ForCausalLM checkpoint with a ChatML
  template that carries any role (sentence-transformers renders the pair through it);
- `plain_text`: a plain *ForCausalLM checkpoint whose tokenizer has no chat template
  (sentence-transformers tokenizes the pair as a text pair).

The tokenizer reads at most MAX_LENGTH tokens, so long pairs are cut and the template's tail is
restored."""

from __future__ import annotations

from pathlib import Path

MAX_LENGTH = 128
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    "{% for m in messages %}{% if m.role == 'system' %}<Instruct>: {{ m.content }}\n"
    "{% elif m.role == 'query' %}<Query>: {{ m.content }}\n"
    "{% elif m.role == 'document' %}<Document>: {{ m.content }}{% endif %}{% endfor %}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "<|im_start|>assistant\n")
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_CORPUS = [
    "yes", "no", "yes no yes no", "Judge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be yes or no.", "<Query>: <Document>: <Instruct>: <think> </think>",
    "how far away from the earth is the moon on an average day of the year", "the moon is about 384,400 kilometres",
    "cheese is made from milk; paris; lunar distance; the distance between the earth and the moon changes",
    "Given a web search query, retrieve relevant passages that answer the query", "system user assistant query document",
]


def build_tokenizer(out: Path, template: str | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS * 20, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert tok.token_to_id("yes") is not None and tok.token_to_id("no") is not None
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=MAX_LENGTH)
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(out)
    return fast


def build(root: Path) -> dict[str, str]:
    """The three directories (see the module's docstring) → their paths by name."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dirs = {name: root / name for name in ("raw", "st", "plain", "plain_text")}
    for name, template in (("raw", RERANKER_TEMPLATE), ("plain", CHATML_TEMPLATE), ("plain_text", None)):
        tokenizer = build_tokenizer(dirs[name], template)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # answers that differ by pair: the "yes" row apart from the "no" row
        yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
        model.lm_head.weight[yes] = 0.3 * torch.randn_like(model.lm_head.weight[yes])
        model.lm_head.weight[no] = 0.3 * torch.randn_like(model.lm_head.weight[no])
    for name in ("raw", "plain", "plain_text"):
        model.save_pretrained(dirs[name])
    CrossEncoder(str(dirs["raw"]), device="cpu", prompts={"instruct": INSTRUCTION},
                 default_prompt_name="instruct").save(str(dirs["st"]))
    return {name: str(d) for name, d in dirs.items()}
