"""MODEL_PATH → everything the server must know before the worker loads the weights: the files,
the task, how the model was declared to be served (pooling, Dense, Normalize, max_seq_length,
prompts) with the environment's overrides, the buckets that fit, and the tokenizer. Blocking
(a download, file reads): run it off the event loop."""

from __future__ import annotations

import dataclasses
import logging

from embedserve.model import activation, declared, llm_prompt, llm_rerank, m3
from embedserve.model import simulated
from embedserve.config import Settings
from embedserve.model.declared import Head
from embedserve.model.encoder import task_of
from embedserve.model.source import resolve
from embedserve.batching import multivector_tokenization
from embedserve.batching.flagged_tokenization import FLAGS_OF, FlaggedTokenizer
from embedserve.batching.tokenization import TextTokenizer, vocab_ids
from embedserve.model import colbert

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Prepared:
    model_dir: str
    task: str  # embed | classify | rerank | sparse | multivector | bgem3
    labels: list[str]  # classify: the label of each logit
    head: Head
    buckets: tuple[int, ...]
    tokenizer: TextTokenizer
    exclude_ids: list[int]
    activation: str = ""  # rerank, classify: the logits' activation (embedserve.model.activation)
    sep_id: int | None = None  # rerank: the separator between a pair's texts (token types)


def usable_buckets(buckets: tuple[int, ...], max_length: int) -> tuple[int, ...]:
    """Buckets for texts of at most `max_length` tokens: none longer, and `max_length` itself
    when it falls between two (so the longest texts get a bucket of their own size)."""
    kept = tuple(b for b in buckets if b < max_length)
    return kept + (max_length,) if max_length <= buckets[-1] else buckets


def prepare(s: Settings) -> Prepared:
    from transformers import AutoConfig, AutoTokenizer

    sim = simulated.parse(s.model_path) is not None
    # The simulator borrows the packaged tokenizer.
    model_dir = str(resolve("" if sim else s.model_path, s.model_cache_dir, s.trust_remote_code, s.model_revision))
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=s.trust_remote_code)
    hf_tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=s.trust_remote_code)
    said = declared.read(model_dir)
    st_config = declared.st_config(model_dir)
    score = None if sim else llm_rerank.read(model_dir, config, hf_tok, s.task)  # an LLM reranker's answer tokens
    # LONG_TEXTS=window asks for an embedder's windows: a BGE-M3 checkpoint stays one under TASK=auto.
    heads = m3.has_heads(model_dir) and not (s.task == "auto" and s.long_texts == "window")
    task = "embed" if sim else task_of(config, s.task, st_config.get("model_type") == "CrossEncoder",
                                       sparse=said.splade is not None, multivector=said.multivector is not None,
                                       llm_reranker=score is not None, m3=heads)
    if s.task == "auto" and m3.has_heads(model_dir) and not sim:
        log.info("the checkpoint carries BGE-M3's heads (%s, %s): %s", m3.SPARSE_FILE, m3.COLBERT_FILE,
                 "served as bgem3 (dense by default; sparse and ColBERT vectors on request); TASK=embed serves it as "
                 "a plain embedder (declared pooling, /embed_all, long texts)" if task == "bgem3" else
                 "served as an embedder under LONG_TEXTS=window (TASK=bgem3: its three outputs, no windows)")
    if task == "bgem3" and not m3.has_heads(model_dir):
        raise declared.DeclarationError(f"TASK=bgem3 needs BGE-M3's heads beside the checkpoint: {m3.SPARSE_FILE} "
                                        f"and {m3.COLBERT_FILE} (state dicts saved with torch.save)")
    if said.multivector is not None:  # PyLate's prefixes made tokens first: the tokenizer serialized below has them
        colbert.register_prefixes(hf_tok, said.multivector.prefixes)
        try:
            said = dataclasses.replace(said, multivector=said.multivector.resolved(hf_tok))
        except colbert.Unserved as e:
            raise declared.DeclarationError(str(e)) from None
    act = ""
    if task == "rerank":
        try:
            act, act_notes = activation.resolve(st_config, config.to_dict(), 1 if score else int(config.num_labels))
        except activation.ActivationError as e:
            raise declared.DeclarationError(str(e)) from None
        for note in act_notes:
            log.info("%s", note)
    elif task == "classify":  # as transformers' text-classification pipeline scores it
        act, why = activation.for_classifier(getattr(config, "problem_type", None), int(config.num_labels),
                                             getattr(config, "function_to_apply", None))
        log.info("classify activation: torch.nn.%s (%s)", act, why)
    architectures = getattr(config, "architectures", None) or []
    if "HF_ColBERT" in architectures:  # sentence-transformers reads its root linear.weight and artifact.metadata
        raise declared.DeclarationError("a Stanford-NLP ColBERT checkpoint (HF_ColBERT) is not served as it is: save it "
                                        "with sentence-transformers' MultiVectorEncoder(path).save(...) and serve that")
    if task == "sparse" and not any(a.endswith("ForMaskedLM") for a in architectures):
        # AutoModelForMaskedLM would load any encoder, with a random MLM head and only a warning.
        raise declared.DeclarationError(f"TASK=sparse needs a masked-LM checkpoint (*ForMaskedLM: SPLADE pools its "
                                        f"vocabulary logits); this model's architecture is {architectures or 'unknown'}")
    labels = [config.id2label[i] for i in range(config.num_labels)] if task == "classify" else []
    head, notes = declared.resolve(
        declared.for_task(said, task), s.pooling, s.normalize, getattr(hf_tok, "model_max_length", None),
        getattr(config, "max_position_embeddings", None), s.buckets[-1])
    if task == "bgem3":  # its dense vector is CLS, normalized (embedserve.model.m3), whatever else is declared
        head = dataclasses.replace(head, pooling=("cls",), normalize=True, dense=())
        notes = [n for n in notes if "modules.json" not in n] + ["bgem3: dense = CLS, normalized; sparse and ColBERT "
                                                                 "from sparse_linear.pt and colbert_linear.pt"]
    for note in notes:
        log.info("%s", note)
    log.info("serving as declared: %s", head.describe())
    # An LLM reranker: its answer tokens in the head (the Encoder reads them), its pairs as prompts.
    head, pair_prompt = (llm_prompt.for_model(model_dir, hf_tok, config.model_type, dataclasses.replace(
        head, logit_score=score)) if score else (head, None))
    tokenizer = (multivector_tokenization.for_model(hf_tok, head.max_length, s.truncate, head.lower_case, head.multivector)
                 if task == "multivector" else
                 FlaggedTokenizer.from_hf(hf_tok, head.max_length, s.truncate, head.lower_case, pair_prompt, flags=task)
                 if task in FLAGS_OF else
                 TextTokenizer.from_hf(hf_tok, head.max_length, s.truncate, head.lower_case, pair_prompt))
    exclude = vocab_ids(hf_tok, s.exclude_tokens)
    if exclude and not any(m in ("mean", "mean_sqrt_len_tokens", "weightedmean") for m in head.pooling):
        raise declared.DeclarationError(
            f"EXCLUDE_TOKENS leaves tokens out of mean pooling; this model pools by {head.describe()['pooling']}")
    return Prepared(model_dir, task, labels, head, usable_buckets(s.buckets, head.max_length), tokenizer, exclude,
                    act, hf_tok.sep_token_id)
