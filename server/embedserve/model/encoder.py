"""The model on its device: loading, dtype, attention layout, torch.compile / CUDA graphs, and one
forward pass + pooling per batch (padded rows, or packed rows: embedserve.model.batches, .varlen).
Constructed and used only on the model-worker thread (compiled graphs live there)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from embedserve.model import llm_rerank, token_states, varlen
from embedserve.config import ConfigError, Settings
from embedserve.model.cuda_graphs import CudaGraphs
from embedserve.model.declared import Head
from embedserve.model.m3 import M3Heads, unused_ids
from embedserve.model.m3_rows import FLAGS, ID_BITS, M3Rows
from embedserve.model.states_rows import StatesRows
from embedserve.model.batches import PackedBatch, PackSpec, padded_rows, random_packed
from embedserve.model.pooling import Pooler
from embedserve.model.sparse_rows import SparseRows, to_csr
from embedserve.model.token_rows import TokenRows
from embedserve.model.splade import splade_pool
from embedserve.model.token_head import TokenHead, kept_rows
from embedserve.model.batches import Batch

log = logging.getLogger(__name__)
# Tasks whose model is a sequence classifier: its logits are the output (no pooling).
SCORING = ("classify", "rerank")


@dataclasses.dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    compile: bool  # torch.compile (inductor) each shape
    static_shapes: bool
    cuda_graphs: bool = False  # replay one captured CUDA graph per shape
    attention: str = "padded"  # padded rows, or "packed" rows with variable-length attention


def choose_placement(settings: Settings, cuda_available: bool, bf16_supported: bool) -> Placement:
    """DEVICE/DTYPE/COMPILE/STATIC_SHAPES/ATTENTION → what the worker runs (pure). `attention`
    is what the settings ask for; the Encoder keeps it only for a model the kernels serve
    (ATTENTION=auto falls back to padded, ATTENTION=packed refuses to start)."""
    name = settings.device
    if name == "auto":
        name = "cuda" if cuda_available else "cpu"
    device = torch.device(name)
    on_gpu = device.type == "cuda"
    if settings.dtype == "auto":
        dtype = (torch.bfloat16 if bf16_supported else torch.float16) if on_gpu else torch.float32
    else:
        dtype = getattr(torch, settings.dtype)
    mode = ("graphs" if on_gpu else "false") if settings.compile == "auto" else settings.compile
    compile_ = mode == "true"
    graphs = on_gpu and mode in ("graphs", "true")
    static = (graphs or compile_) if settings.static_shapes == "auto" else settings.static_shapes == "true"
    # Packed rows by default where FlashAttention-2 runs them: CUDA, half precision.
    packed = settings.attention == "packed" or (settings.attention == "auto" and on_gpu and dtype in varlen.HALF)
    # Without static shapes every new batch shape would capture (or compile) another graph.
    return Placement(device, dtype, compile_, static, graphs and static, "packed" if packed else "padded")


def _declined(settings: Settings, reason: str) -> tuple[str, str]:
    """Packed rows cannot serve this model here: padded rows under ATTENTION=auto (said in the
    log and in /health), a start-up error under ATTENTION=packed. → ("padded", reason)."""
    if settings.attention == "packed":
        raise ConfigError(f"ATTENTION=packed: {reason}")
    log.warning("attention: padded rows (%s)", reason)
    return "padded", reason


class Encoder:
    """An AutoModel encoder plus pooling (or a sequence classifier's logits, task classify; a
    masked LM's SPLADE weights, task sparse: dense [rows, vocabulary], sparsified by the service);
    `run(batch)` → float32 [rows, dim] numpy."""

    def __init__(self, model_dir: str, settings: Settings, placement: Placement, exclude_ids: list[int],
                 task: str = "embed", head: Head | None = None, sep_id: int | None = None):
        from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSequenceClassification

        self.placement = placement
        self.settings = settings
        self.task = task
        if placement.device.type == "cuda":  # cuda:N: this (the worker's) thread loads and captures there
            torch.cuda.set_device(placement.device)
        # An LLM reranker (embedserve.model.llm_rerank): a causal LM, scored from its LM head's rows.
        self.logit_score = head.logit_score if head is not None and task == "rerank" else None
        loader = (AutoModelForCausalLM if self.logit_score is not None else
                  AutoModelForSequenceClassification if task in SCORING else
                  AutoModelForMaskedLM if task == "sparse" else AutoModel)

        def load(**extra):
            model = loader.from_pretrained(model_dir, dtype=placement.dtype, trust_remote_code=settings.trust_remote_code,
                                           **extra)
            return model.to(placement.device).eval()

        # declined: why packed rows, asked for, do not serve this model (shown in /health).
        self.attention, self.declined = self._attention(model_dir, settings, placement, task)
        self.model = load(**({"attn_implementation": varlen.NAME} if self.attention == "packed" else {}))
        # The answer tokens' rows of the LM head, copied (a reload below has the same weights).
        self.answer = llm_rerank.Answer(self.model, self.logit_score) if self.logit_score is not None else None
        self.position_offset = varlen.position_offset(self.model.config) if self.attention == "packed" else 0
        head = head or Head(("mean",), True, (), 512, False, {}, None)
        exclude = torch.tensor(exclude_ids, dtype=torch.int64)
        self.pooler = Pooler(head.pooling, head.dense, head.normalize, exclude,
                             norms=settings.long_texts == "window" and task == "embed").to(placement.device).eval()
        self.splade = head.splade if task == "sparse" else None
        # multivector: token vectors (embedserve.model.token_head), its declaration's settings.
        self.tokens = TokenHead.declared(head.multivector).to(placement.device).eval() if task == "multivector" else None
        # BGE-M3 (task bgem3): its sparse and ColBERT heads beside the encoder (embedserve.model.m3).
        self.m3 = self._m3_heads(model_dir) if task == "bgem3" else None
        self.probe_flags = sum(FLAGS.values()) if self.m3 is not None else 0  # warm start's probe reads every head
        # An embed model's rows may ask for their hidden states (TEI's /embed_all:
        # embedserve.model.token_states; such a batch runs eager, see run).
        self.states = task == "embed" and self.logit_score is None
        self.states_dim = int(self.model.config.hidden_size) if self.states else 0
        # Output width: the embedding dimension (after any Dense layers), one logit per label, or
        # (sparse) one weight per vocabulary entry: the MLM head's width.
        hidden = int(self.model.config.hidden_size)
        self.dim = (1 if self.logit_score is not None else int(self.model.config.num_labels) if task in SCORING else
                    int(self.model.config.vocab_size) if self.splade else
                    self.tokens.output_dim(hidden) if self.tokens else
                    hidden if self.m3 is not None else self.pooler.output_dim(hidden))
        # A cross-encoder (rerank) of token types reads its pairs' second segments as type 1.
        types = int(getattr(self.model.config, "type_vocab_size", 1) or 1)
        self.sep_id = sep_id if task == "rerank" and types > 1 and sep_id is not None else None
        if self.attention == "packed" and (reason := self._check_packed()) is not None:
            self.attention, self.declined = _declined(settings, reason)
            self.model = load()  # afresh, as the model loads by default (switching back may not take)
        if self.answer is not None:
            llm_rerank.check(self.model, self.answer, self.logit_score, placement.device, placement.dtype)
            if llm_rerank.shed(self.model):  # no full forward runs after the check
                log.info("LLM reranker: the untied LM head let go (its answer rows kept)")
        self._forward = self._packed if self.attention == "packed" else self._eager
        if placement.compile:
            # One graph per static shape: let dynamo keep them all rather than fall back to
            # eager after its default 8 recompilations.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
            self._forward = torch.compile(self._forward, dynamic=False)
        if placement.cuda_graphs:
            self._forward = CudaGraphs(self._forward, placement.device)

    @staticmethod
    def _attention(model_dir: str, settings: Settings, placement: Placement, task: str) -> tuple[str, str | None]:
        """The attention layout this model runs: the placement's, unless the kernels cannot serve
        this model (then padded under ATTENTION=auto, a start-up error under ATTENTION=packed).
        → (layout, why packed rows were declined, or None)."""
        if placement.attention != "packed":
            return "padded", None
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=settings.trust_remote_code)
        on_gpu = placement.device.type == "cuda"
        capability = torch.cuda.get_device_capability(placement.device) if on_gpu else None
        reason = varlen.unsupported(config, task, placement.device.type, placement.dtype, capability,
                                    settings.buckets[-1])
        if reason is None and on_gpu:
            heads = int(config.num_attention_heads)
            reason = varlen.self_check(placement.device, placement.dtype, heads, varlen.head_size(config),
                                       placement.cuda_graphs, causal=varlen.is_causal(config))
        if reason is not None:
            return _declined(settings, reason)
        varlen.register()
        log.info("attention: packed rows (%s)", "reference attention on CPU" if not on_gpu else
                 "varlen_attn, FlashAttention-2" if placement.dtype in varlen.HALF else "memory-efficient varlen kernel")
        return "packed", None

    def _check_packed(self) -> str | None:
        """The loaded model on a few packed rows (a padding tail and empty rows as served)
        against the same rows padded, through transformers' own SDPA. Catches what the kernel's
        check cannot: a model class that ignores the row bounds (remote code) and so attends
        across rows, or that refuses the packed keywords. None: they agree."""
        config, dev = self.model.config, self.placement.device
        longest = min(64, int(config.max_position_embeddings) - self.position_offset)
        spec = PackSpec(max_len=longest, max_rows=8, ladder=(4 * longest,))
        batch = random_packed(3 * longest, spec, int(config.vocab_size), np.random.default_rng(0))
        ids, mask = (t.to(dev) for t in padded_rows(batch))
        packed = (batch.input_ids, batch.positions, batch.segments, batch.cu_seqlens)
        padded = "sdpa" if getattr(self.model, "_supports_sdpa", False) else "eager"
        try:
            with torch.inference_mode():
                got = self._packed(*(t.to(dev) for t in packed), batch.max_len)
                if self.m3 is not None:  # BGE-M3: its dense rows lead its flat output (M3Heads.packed)
                    got = got[: (len(batch.cu_seqlens) - 1) * self.dim].view(-1, self.dim)
                got = got[: batch.rows].float()
                self.model.set_attn_implementation(padded)
                try:
                    want = self._eager(ids, mask).float()
                finally:
                    self.model.set_attn_implementation(varlen.NAME)
        except Exception as e:  # noqa: BLE001 - any failure means "not for this model"
            return f"packed rows fail on this model ({type(e).__name__}: {e})"
        got, want = got[:, : self.dim], want[:, : self.dim]  # not LONG_TEXTS' norm column (Pooler.norms)
        # Per row, the error's length relative to the vector's: blind to scale (unnormalized
        # models) and to where in the vector bf16 rounds; attending across rows is far above it.
        # One score per row (an LLM reranker's) has no scale of its own near 0: the rows' largest.
        scale = want.norm(dim=-1) if want.shape[-1] > 1 else want.abs().max().expand(want.shape[0])
        error = float(((got - want).norm(dim=-1) / scale.clamp(min=1e-6)).max())
        tolerance = 5e-2 if self.placement.dtype in varlen.HALF else 1e-4
        if not error <= tolerance:  # NaN fails too
            return f"packed rows differ from padded rows by {error:.3g} (relative, per row; > {tolerance})"
        return None

    def _m3_heads(self, model_dir: str) -> M3Heads:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=self.settings.trust_remote_code)
        self.m3_unused = np.asarray(unused_ids(tokenizer), dtype=np.int64)
        self.m3_vocab = int(self.model.config.vocab_size)
        heads = M3Heads.load(model_dir, int(self.model.config.hidden_size))
        return heads.to(self.placement.device, self.placement.dtype).eval()

    def _packed(self, ids: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor, cu_seqlens: torch.Tensor,
                max_len: int, states: bool = False) -> torch.Tensor:
        """One stream of rows end to end ([T] tensors, see embedserve.model.batches) → [S, dim]."""
        if self.logit_score is not None:
            return llm_rerank.packed(self.model, self.answer, ids, positions + self.position_offset, cu_seqlens,
                                     max_len)
        ids = ids & ID_BITS  # what a row asks rides on its first id (m3_rows.FLAGS, states_rows.STATES)
        hidden = self.model(input_ids=ids.unsqueeze(0), position_ids=(positions + self.position_offset).unsqueeze(0),
                            cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_len,
                            max_length_k=max_len).last_hidden_state[0]
        if self.m3 is not None:
            return self.m3.packed(hidden, cu_seqlens)
        pooled = self.pooler.packed(hidden, ids, positions, segments, cu_seqlens)
        return (pooled, hidden) if states else pooled

    def _eager(self, ids: torch.Tensor, mask: torch.Tensor, states: bool = False) -> torch.Tensor:
        if self.logit_score is not None:
            return llm_rerank.padded(self.model, self.answer, ids, mask)
        if self.task in SCORING:
            types = {} if self.sep_id is None else {"token_type_ids": token_types(ids, mask, self.sep_id)}
            return self.model(input_ids=ids, attention_mask=mask, **types).logits.float()
        if self.splade is not None:
            return splade_pool(self.model(input_ids=ids, attention_mask=mask).logits, mask, self.splade)
        if self.tokens is not None:
            return self.tokens(self.model, ids, mask)
        ids = ids & ID_BITS  # what a row asks rides on its first id (m3_rows.FLAGS, states_rows.STATES)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        if self.m3 is not None:
            return self.m3(hidden, mask)
        pooled = self.pooler(hidden, ids, mask)
        return (pooled, hidden) if states else pooled

    def run(self, batch: Batch | PackedBatch) -> np.ndarray | SparseRows | TokenRows | M3Rows:
        dev = self.placement.device
        if isinstance(batch, PackedBatch) != (self.attention == "packed"):
            raise TypeError(f"a {type(batch).__name__} for an encoder of {self.attention} rows")
        if isinstance(batch, PackedBatch):
            tensors, extra = (batch.input_ids, batch.positions, batch.segments, batch.cu_seqlens), (batch.max_len,)
        else:
            tensors, extra = (batch.input_ids, batch.attention_mask), ()
        # A batch with rows asking for their token states (TEI's /embed_all) runs outside the
        # captured graphs and torch.compile: a graph's output stays allocated in the shared pool
        # for every shape, and the hidden states of every shape held so would cost every embed
        # server gigabytes for a rarely asked answer.
        asking = self.states and token_states.asking(batch)
        with torch.inference_mode():
            if dev.type == "cuda":  # pinned host memory: the copies to the device run async
                tensors = tuple(t.pin_memory() for t in tensors)
                if not self.placement.cuda_graphs or asking:  # graphs copy into their static inputs
                    tensors = tuple(t.to(dev, non_blocking=True) for t in tensors)
            states = None
            if asking:
                out, hidden = (self._packed if isinstance(batch, PackedBatch) else self._eager)(*tensors, *extra, states=True)
                states = token_states.picked(hidden, batch)
            else:
                out = self._forward(*tensors, *extra)
            if self.m3 is not None and isinstance(batch, PackedBatch):
                return self.m3.unpack_packed(out, batch.input_ids, batch.positions, batch.cu_seqlens, batch.rows,
                                             self.m3_vocab, self.m3_unused)
            if self.m3 is not None:
                return self.m3.unpack(out, batch.input_ids, batch.attention_mask, batch.rows, self.m3_vocab,
                                      self.m3_unused)
            # .cpu() waits for the result, so a graph's static output is read before its next replay.
            out = out[: batch.rows].cpu()
        if self.tokens is not None:  # each row's kept token vectors only, cut out on the worker's thread
            return kept_rows(out)
        out = out.numpy()
        if self.pooler.norms and self.splade is None and self.task not in SCORING:  # LONG_TEXTS=window (Pooler.head)
            batch.norms, out = out[:, -1].copy(), np.ascontiguousarray(out[:, :-1])
        # SPLADE: sparse here, on the worker's thread (counted as model-busy time), so no request
        # holds its rows dense (embedserve.model.sparse_rows).
        return to_csr(out) if self.splade is not None else out if states is None else StatesRows(out, states)

    def memory(self) -> dict[str, int]:
        if self.placement.device.type != "cuda":
            return {}
        return {
            "allocated": torch.cuda.memory_allocated(self.placement.device),
            "reserved": torch.cuda.memory_reserved(self.placement.device),
        }


def token_types(ids: torch.Tensor, mask: torch.Tensor, sep_id: int) -> torch.Tensor:
    """Right-padded pair rows ([CLS] query [SEP] text [SEP] pad...) → their token_type_ids, as
    the tokenizer's pair encoding gives them: 1 for every token after a row's first separator,
    0 up to and including it and on padding. Derived here so the rows stay ids and lengths
    through the queues, batches and IPC. Pure tensor ops on the device, no host sync (it runs
    inside a captured CUDA graph). The one case it differs from the tokenizer: a query holding the
    separator itself as literal text ("[SEP]", which the tokenizer reads as the special token)
    makes the rest of that query type 1 here, where the tokenizer keeps the whole query type 0."""
    sep = (ids == sep_id).to(torch.int32)
    before = sep.cumsum(dim=1) - sep  # separators strictly before each position
    return ((before > 0) & mask.bool()).to(ids.dtype)


def task_of(config, requested: str, cross_encoder: bool = False, sparse: bool = False,
            multivector: bool = False, llm_reranker: bool = False, m3: bool = False) -> str:
    """TASK auto → what the checkpoint is: a declared SparseEncoder (`sparse`) is sparse; a
    declared MultiVectorEncoder or PyLate ColBERT model (`multivector`) is multivector; a
    *ForSequenceClassification checkpoint of one label (TEI's rule), or one its authors declared a
    sentence-transformers CrossEncoder (`cross_encoder`), reranks; of several labels it
    classifies; BGE-M3's two head files beside the checkpoint (`m3`) make it bgem3 (its dense
    vector is what an embeddings client gets, at an embedder's cost: model.m3); anything else embeds.
    An LLM reranker (`llm_reranker`: declared, or TASK=rerank on a *ForCausalLM:
    embedserve.model.llm_rerank.read decides) reranks. TASK=rerank
    on a model of other than one label is a start-up error (one score per pair is what rerank is)."""
    if llm_reranker:
        return "rerank"
    labels = int(getattr(config, "num_labels", 0) or 0)
    architectures = getattr(config, "architectures", None) or []
    classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    if cross_encoder and not classifier and requested in ("auto", "rerank"):
        raise ConfigError(f"the model is declared a CrossEncoder but its architecture is {architectures or 'unknown'}; "
                          "this server reranks with *ForSequenceClassification checkpoints only")
    if requested == "rerank" and (labels != 1 or not classifier):
        why = f"it has {labels} labels" if labels != 1 else f"its architecture is {architectures or 'unknown'}"
        raise ConfigError(f"TASK=rerank needs a *ForSequenceClassification checkpoint of one label (one score "
                          f"per pair); {why}: serve it with TASK=classify or TASK=embed")
    if requested != "auto":
        return requested
    if sparse:
        return "sparse"
    if multivector:
        return "multivector"
    if m3 and not classifier:
        return "bgem3"
    if classifier:
        return "rerank" if labels == 1 else "classify"
    return "embed"
