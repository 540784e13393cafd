"""How a model's authors declared it should be served: the sentence-transformers files beside the
weights (modules.json, 1_Pooling/config.json, Dense and Normalize modules, sentence_bert_config.json,
config_sentence_transformers.json), read as `SentenceTransformer(model).encode(texts)` reads them,
and the environment's overrides on top. sentence-transformers is the reference: an index built
with it and queried through us must agree.

`read()` is file reading; `resolve()` is a pure decision, with the log lines that say what the
environment changed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

# Pooling modes sentence-transformers offers for encoders (its names; "last" is our old alias),
# kept with the settings that name them.
from embedserve.config import POOLING_ALIASES as ALIASES, POOLING_MODES
from embedserve.model import colbert

_LEGACY_POOLING = {  # sentence-transformers < 6 saved one boolean per mode, in this order
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken",
}
# Modules that change nothing at inference.
_NO_OPS = {"Dropout"}
# A SparseEncoder's modules this server runs: a masked-LM transformer, then SPLADE pooling. The
# rest of sentence-transformers' sparse family is named in the refusal: a SparseAutoEncoder (CSR
# over a dense encoder), a SparseStaticEmbedding (inference-free, a learned weight per token) and
# the Router that pairs one with an encoder for queries and documents.
_SPARSE_UNSERVED = {"SparseAutoEncoder", "SparseStaticEmbedding", "Router", "Asym", "CSRSparsity"}
SPLADE_STRATEGIES = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")


class DeclarationError(ValueError):
    """The model declares something this server cannot serve as declared."""


@dataclasses.dataclass(frozen=True)
class Declared:
    """What the model directory says. `sentence_transformers` is False for a plain transformers
    checkpoint, which sentence-transformers serves with mean pooling and no normalization."""

    sentence_transformers: bool = False
    pooling: tuple[str, ...] = ("mean",)
    include_prompt: bool = True
    dense: tuple[Path, ...] = ()  # Dense module directories, in order
    normalize: bool = False
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: dict[str, str] = dataclasses.field(default_factory=dict)
    default_prompt_name: str | None = None
    # Matryoshka: the leading dimensions to serve by default. sentence-transformers takes it as
    # SentenceTransformer(..., truncate_dim=) and does not save it; a model's authors state it as
    # `truncate_dim` in config_sentence_transformers.json, beside the prompts.
    truncate_dim: int | None = None
    splade: "Splade | None" = None  # a SparseEncoder (MLM transformer + SpladePooling)
    multivector: "colbert.MultiVector | None" = None  # a MultiVectorEncoder, or PyLate's ColBERT


@dataclasses.dataclass(frozen=True)
class Splade:
    """SpladePooling as a SparseEncoder declares it: log1p(activation(MLM logits)), masked by
    attention, pooled over tokens; then the top `max_active_dims` per row when it saves one."""

    strategy: str = "max"  # max | sum over tokens
    activation: str = "relu"  # relu | log1p_relu (a second log1p)
    max_active_dims: int | None = None


@dataclasses.dataclass(frozen=True)
class Head:
    """What the server runs after the transformer, and how it prepares text: the effective
    declaration (the model's, with the environment's overrides)."""

    pooling: tuple[str, ...]
    normalize: bool
    dense: tuple[Path, ...]
    max_length: int  # tokens per text, special tokens included
    lower_case: bool
    prompts: dict[str, str]
    default_prompt_name: str | None
    truncate_dim: int | None = None  # dimensions served by default (None: all)
    splade: Splade | None = None  # task sparse: how the MLM logits are pooled
    multivector: "colbert.MultiVector | None" = None  # task multivector: its token vectors' declaration
    # An LLM reranker's answer tokens (embedserve.model.llm_rerank.LogitScore; None: not one).
    logit_score: object | None = None

    def prompt(self, name: str | None) -> str:
        """The text put before each input: `name`'s prompt, else the default one, else none.
        An unknown name is the caller's error (its message names the ones there are)."""
        if name:
            if name not in self.prompts:
                known = ", ".join(sorted(self.prompts)) or "none"
                raise KeyError(f"unknown prompt_name {name!r}; this model's prompts: {known}")
            return self.prompts[name]
        return self.prompts.get(self.default_prompt_name, "") if self.default_prompt_name else ""

    def dimension(self, model_dim: int) -> int:
        """Dimensions served by default: the declared truncate_dim, else every one the model
        computes (a truncate_dim over that is refused at start-up: `check_dimension`)."""
        return min(self.truncate_dim, model_dim) if self.truncate_dim else model_dim

    def check_dimension(self, model_dim: int) -> None:
        if self.truncate_dim and self.truncate_dim > model_dim:
            raise DeclarationError(f"truncate_dim {self.truncate_dim} exceeds the model's {model_dim} dimensions")

    def describe(self) -> dict:
        splade = self.splade
        return {"pooling": f"splade_{splade.strategy}" if splade else "tokens" if self.multivector else "+".join(self.pooling),
                "normalize": self.normalize, "max_length": self.max_length,
                "dense_layers": len(self.dense), "prompts": sorted(self.prompts),
                "default_prompt_name": self.default_prompt_name or "", "truncate_dim": self.truncate_dim or 0}


def _json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _pooling_modes(config: dict) -> tuple[str, ...]:
    mode = config.get("pooling_mode")
    if mode is None:  # the older format: one flag per mode
        mode = [name for key, name in _LEGACY_POOLING.items() if config.get(key)] or ["mean"]
    modes = (mode,) if isinstance(mode, str) else tuple(mode)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise DeclarationError(f"1_Pooling declares pooling {bad}; this server pools {', '.join(POOLING_MODES)}")
    return modes


def _splade(modules: list[dict], root: Path, st: dict) -> Splade | None:
    """A SparseEncoder's declaration (None: not one). Refuses, by name, the sparse modules this
    server does not run, and a SPLADE pooling it does not know."""
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    if st.get("model_type") != "SparseEncoder" and "SpladePooling" not in kinds and "MLMTransformer" not in kinds:
        return None
    unserved = [m["type"] for m, k in zip(modules, kinds) if k in _SPARSE_UNSERVED]
    if unserved:
        raise DeclarationError(f"a SparseEncoder with {', '.join(unserved)}: this server serves SPLADE "
                               "(an MLM transformer and SpladePooling) only")
    first = _json(root / modules[0].get("path", "") / "sentence_bert_config.json") or {}
    mlm = kinds[0] == "MLMTransformer" or (kinds[0] == "Transformer" and first.get("transformer_task") == "fill-mask")
    if not mlm or "SpladePooling" not in kinds:
        raise DeclarationError(f"a SparseEncoder of modules {', '.join(kinds)}: this server serves SPLADE "
                               "(an MLM transformer and SpladePooling) only")
    pooling = modules[kinds.index("SpladePooling")]
    config = _json(root / pooling.get("path", "") / "config.json") or {}
    strategy, activation = config.get("pooling_strategy", "max"), config.get("activation_function", "relu")
    if strategy not in SPLADE_STRATEGIES or activation not in SPLADE_ACTIVATIONS:
        raise DeclarationError(f"SpladePooling {strategy}/{activation}: this server pools "
                               f"{'/'.join(SPLADE_STRATEGIES)} with {'/'.join(SPLADE_ACTIVATIONS)}")
    extra = [k for k in kinds[1:] if k not in ("SpladePooling", *_NO_OPS)]
    if extra:
        raise DeclarationError(f"a SparseEncoder with {', '.join(extra)} after its pooling: not served")
    top = st.get("max_active_dims")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top <= 0):
        raise DeclarationError(f"max_active_dims {top!r} is not a positive integer")
    return Splade(strategy, activation, top)


def st_config(model_dir: str | Path) -> dict:
    """config_sentence_transformers.json ({} when absent): its model_type says a CrossEncoder."""
    found = _json(Path(model_dir) / "config_sentence_transformers.json")
    return found if isinstance(found, dict) else {}


def read(model_dir: str | Path) -> Declared:
    """The model directory's sentence-transformers declaration (a plain checkpoint: the defaults)."""
    root = Path(model_dir)
    modules = _json(root / "modules.json")
    if not modules:
        return Declared()
    st = _json(root / "config_sentence_transformers.json") or {}
    if (splade := _splade(modules, root, st)) is not None:
        return dataclasses.replace(_prompted(root, st), splade=splade, pooling=())
    try:
        multivector = colbert.read(root, modules, st)
    except colbert.Unserved as e:
        raise DeclarationError(str(e)) from None
    if multivector is not None:  # its prompts: the query and document prefixes (PyLate's composed in)
        return dataclasses.replace(_prompted(root, {**st, "prompts": multivector.prompts}),
                                   multivector=multivector, pooling=(), normalize=multivector.normalize)
    pooling, include_prompt, dense, normalize = ("mean",), True, [], False
    unsupported = []
    for i, module in enumerate(modules):
        kind = module["type"].rsplit(".", 1)[-1]
        path = root / module.get("path", "")
        if kind == "Transformer" and i == 0:
            continue
        if kind == "LogitScore":  # an LLM reranker's score: read by embedserve.model.llm_rerank
            continue
        if kind == "Pooling":
            config = _json(path / "config.json") or {}
            pooling, include_prompt = _pooling_modes(config), bool(config.get("include_prompt", True))
        elif kind == "Dense":
            dense.append(path)
        elif kind == "Normalize":
            normalize = True
        elif kind not in _NO_OPS:
            unsupported.append(module["type"])
    if unsupported:
        raise DeclarationError(f"modules.json declares modules this server does not run: {', '.join(unsupported)}")
    if not include_prompt:
        raise DeclarationError("1_Pooling declares include_prompt: false (prompt tokens left out of pooling); "
                               "this server pools every token of a prompted text")
    return dataclasses.replace(_prompted(root, st), pooling=pooling, include_prompt=include_prompt,
                               dense=tuple(dense), normalize=normalize)


def _prompted(root: Path, st: dict) -> Declared:
    """What every sentence-transformers model declares beside its modules: max_seq_length, lower
    case, prompts."""
    bert = _json(root / "sentence_bert_config.json") or {}
    prompts = {k: v for k, v in (st.get("prompts") or {}).items() if v is not None}
    default = st.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise DeclarationError(f"default_prompt_name {default!r} is not among the prompts {sorted(prompts)}")
    truncate_dim = st.get("truncate_dim")
    if truncate_dim is not None and (not isinstance(truncate_dim, int) or isinstance(truncate_dim, bool) or truncate_dim < 1):
        raise DeclarationError(f"config_sentence_transformers.json declares truncate_dim {truncate_dim!r}; "
                               "expected a positive integer")
    return Declared(True, max_seq_length=bert.get("max_seq_length"), do_lower_case=bool(bert.get("do_lower_case", False)),
                    prompts=prompts, default_prompt_name=default, truncate_dim=truncate_dim)


def for_task(declared: Declared, task: str) -> Declared:
    """The declaration as the served task reads it: TASK=sparse on a plain masked-LM checkpoint
    pools as SparseEncoder's defaults do (max, relu); a SparseEncoder serves no other task."""
    if task == "sparse" and declared.splade is None:
        if declared.sentence_transformers:
            raise DeclarationError("TASK=sparse: this model declares sentence-transformers modules, not a SparseEncoder")
        return dataclasses.replace(declared, splade=Splade(), pooling=())
    if task != "sparse" and declared.splade is not None:
        raise DeclarationError(f"TASK={task}: this model is a SparseEncoder (SPLADE), served as TASK=sparse")
    if task == "multivector" and declared.multivector is None:
        raise DeclarationError("TASK=multivector: this model declares no multi-vector modules (a sentence-transformers "
                               "MultiVectorEncoder, or PyLate's ColBERT)")
    if task != "multivector" and declared.multivector is not None:
        raise DeclarationError(f"TASK={task}: this model is a multi-vector (ColBERT) model, served as TASK=multivector")
    return declared


def resolve(declared: Declared, pooling: str, normalize: bool | None, tokenizer_max_length: int | None,
            max_positions: int | None, largest_bucket: int) -> tuple[Head, list[str]]:
    """The effective head: the declaration, then POOLING / NORMALIZE where set (`pooling` "" and
    `normalize` None: as declared). Tokens per text: the declared max_seq_length, else the
    tokenizer's model_max_length, capped by the position table (as sentence-transformers), and
    by the largest bucket (said in the log when that cuts what the model could read).
    → (head, log lines)."""
    notes = []
    modes = declared.pooling
    if declared.multivector is not None and (pooling or normalize is not None):
        raise DeclarationError("POOLING and NORMALIZE do not apply to a multi-vector model (its token vectors, as declared)")
    if declared.splade is not None and (pooling or normalize):
        raise DeclarationError("POOLING and NORMALIZE do not apply to a SparseEncoder (SPLADE pooling, never normalized)")
    if pooling:
        wanted = tuple(ALIASES.get(m, m) for m in pooling.split("+"))
        if wanted != modes:
            notes.append(f"POOLING={pooling} overrides the model's declared pooling {'+'.join(modes)}")
        modes = wanted
    norm = declared.normalize
    if normalize is not None and normalize != norm:
        notes.append(f"NORMALIZE={str(normalize).lower()} overrides the model's declaration ({'a' if norm else 'no'} Normalize module)")
        norm = normalize
    limits = [n for n in (declared.max_seq_length, tokenizer_max_length, max_positions) if n and n < 1_000_000]
    model_max = min(limits) if limits else largest_bucket
    if model_max > largest_bucket:
        notes.append(f"the model reads {model_max} tokens per text; the largest bucket ({largest_bucket}) "
                     "cuts texts shorter: add a bucket to serve them whole")
    if not declared.sentence_transformers and declared.splade is None:
        notes.append("no sentence-transformers modules.json: mean pooling, no normalization "
                     "(as SentenceTransformer serves a plain checkpoint)")
    head = Head(modes, norm, declared.dense, min(model_max, largest_bucket), declared.do_lower_case,
                dict(declared.prompts), declared.default_prompt_name, declared.truncate_dim, declared.splade,
                declared.multivector)
    return head, notes
