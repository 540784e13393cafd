"""A multi-vector (late-interaction, ColBERT) model's declaration, read as sentence-transformers
6.2's `MultiVectorEncoder(path)` reads it: its own saves (modules Transformer, Dense,
MultiVectorMask, Normalize; the query expansion in the Transformer's sentence_bert_config.json,
the skiplist in the mask's config, the query and document prefixes as the prompts "query" and
"document") and PyLate's (v3: modules Transformer and pylate's Dense, the ColBERT settings at the
top of config_sentence_transformers.json with model_type "ColBERT": query_prefix,
document_prefix, query_length, document_length, attend_to_expansion_tokens, skiplist_words,
which sentence-transformers turns into the same modules; the punctuation skiplist when unsaid).

File reading and pure decisions only: the tokenizer applies the prefixes and the expansion
(embedserve.batching.multivector_tokenization), the device the projection, the normalization and
the skiplist (embedserve.model.token_head)."""

from __future__ import annotations

import dataclasses
import json
import string
from pathlib import Path

# A row's side, in its ids (embedserve.model.token_head says why): bits above every vocabulary
# (ids are int32; the largest vocabularies hold ~260k ids < 2^18).
QUERY = 1 << 30  # on a query row's first id
EXPANSION = 1 << 29  # on each of a query's expansion tokens
ID_BITS = EXPANSION - 1

# sentence-transformers' module classes of a MultiVectorEncoder this server runs, by class name.
_SERVED = {"Transformer", "Dense", "MultiVectorMask", "Normalize", "Dropout"}
_PYLATE_KEYS = ("query_length", "document_length", "query_expansion", "do_query_expansion",
                "attend_to_expansion_tokens", "attend_to_mask_tokens", "query_prefix", "document_prefix",
                "skiplist_words")


class Unserved(ValueError):
    """A multi-vector model declares what this server cannot serve as declared."""


@dataclasses.dataclass(frozen=True)
class Expansion:
    """ColBERT's query expansion (sentence-transformers' QueryExpansionConfig): queries padded
    with `token` (None: the tokenizer's mask token, else its EOS) to `length` tokens; "fixed" also
    cuts longer queries there, "min" only pads. `attend`: whether the encoder attends to the
    expansion tokens (False: they are computed, and scored, but no token attends to them)."""

    strategy: str = "fixed"
    attend: bool = False
    token: str | None = None
    length: int = 32


@dataclasses.dataclass(frozen=True)
class MultiVector:
    dense: tuple[Path, ...]  # token-level Dense module directories, in order
    normalize: bool  # a token-level Normalize
    prompts: dict[str, str]  # "query" and "document": the text put before each side's texts
    expansion: Expansion | None  # queries only
    query_length: int | None  # a query's tokens at most (None: the model's max length)
    document_length: int | None  # a document's tokens at most (None: the model's max length)
    skiplist: tuple[str, ...]  # tokens left out of documents' vectors (sentence-transformers' skiplist_words)
    skiplist_tasks: tuple[str, ...] = ("document",)
    prefixes: dict[str, str] = dataclasses.field(default_factory=dict)  # PyLate's: registered as special tokens
    mean: bool = False  # similarity_fn_name meanmaxsim: MaxSim over the query's token count
    # Resolved with the tokenizer (prepare): the skiplist's ids, the expansion's.
    skiplist_ids: tuple[int, ...] = ()
    expansion_id: int | None = None

    def resolved(self, hf_tokenizer) -> "MultiVector":
        return dataclasses.replace(self, skiplist_ids=tuple(skiplist_ids(hf_tokenizer, self.skiplist)),
                                   expansion_id=expansion_id(hf_tokenizer, self.expansion))

    def prompt(self, is_query: bool) -> str:
        """The side's prompt, as encode_query / encode_document pick it (the model's own "query" or
        "document" prompt; none: no prompt, never the default one)."""
        return self.prompts.get("query" if is_query else "document") or ""


def _json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def read(root: Path, modules: list[dict], st: dict) -> MultiVector | None:
    """The model directory's multi-vector declaration; None: not a multi-vector model."""
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    pylate = st.get("model_type") == "ColBERT"
    if st.get("model_type") != "MultiVectorEncoder" and not pylate and "MultiVectorMask" not in kinds:
        return None
    unserved = [m["type"] for m, k in zip(modules, kinds) if k not in _SERVED]
    if unserved or not kinds or kinds[0] != "Transformer":
        raise Unserved(f"a multi-vector model of modules {', '.join(kinds)}: this server runs a Transformer, "
                       f"Dense projections, a MultiVectorMask and Normalize ({', '.join(unserved) or 'no Transformer first'})")
    transformer = _json(root / modules[0].get("path", "") / "sentence_bert_config.json") or {}
    dense, mask = [], None
    for m, kind in zip(modules[1:], kinds[1:]):
        path = root / m.get("path", "")
        if kind == "Dense":
            config = _json(path / "config.json") or {}
            if config.get("module_input_name", "token_embeddings") != "token_embeddings":
                raise Unserved(f"{path.name}: a Dense over {config['module_input_name']}, not the token vectors")
            dense.append(path)
        elif kind == "MultiVectorMask":
            mask = _json(path / "config.json") or {}
    prompts = {k: v for k, v in (st.get("prompts") or {}).items() if v is not None}
    prefixes = {}
    if pylate:  # sentence-transformers' _parse_model_config: the prefix before any saved prompt
        for key, side in (("query_prefix", "query"), ("document_prefix", "document")):
            if key in st:
                prefixes[side] = prefix = st[key] or ""
                prompts[side] = prefix + (prompts.get(side) or "").removeprefix(prefix)
    knobs = {**_pylate_knobs(st), **{k: transformer[k] for k in ("query_length", "document_length", "query_expansion")
                                     if k in transformer}}
    if pylate or any(k in st for k in _PYLATE_KEYS):
        # PyLate's saves: [Transformer, Dense]; sentence-transformers appends the mask (punctuation
        # unless saved otherwise) and a token-level Normalize.
        words = st.get("skiplist_words")
        mask = {"skiplist_words": list(string.punctuation) if words is None else words}
        normalize = True
    else:
        normalize = "Normalize" in kinds
    mask = mask or {}
    if mask.get("keep_only_token_ids"):
        raise Unserved("a MultiVectorMask with keep_only_token_ids (image-patch documents): not served")
    tasks = mask.get("skiplist_tasks") or ["document"]
    return MultiVector(tuple(dense), normalize, prompts, _expansion(knobs.get("query_expansion")),
                       _positive(knobs.get("query_length"), "query_length"),
                       _positive(knobs.get("document_length"), "document_length"),
                       tuple(mask.get("skiplist_words") or ()), tuple([tasks] if isinstance(tasks, str) else tasks),
                       prefixes, st.get("similarity_fn_name") == "meanmaxsim")


def _pylate_knobs(st: dict) -> dict:
    """PyLate's top-level settings as sentence-transformers translates them: query_length is the
    expansion's length (32 when unsaid), expansion on unless do_query_expansion is false."""
    knobs = {k: st[k] for k in ("query_length", "document_length", "query_expansion")
             if k in st and (st[k] is not None or k == "query_expansion")}
    if "query_expansion" not in knobs and any(k in st for k in _PYLATE_KEYS):
        if st.get("do_query_expansion") is False:
            knobs["query_expansion"] = None
        else:
            attend = st.get("attend_to_expansion_tokens", st.get("attend_to_mask_tokens"))
            length = knobs.pop("query_length", None) or st.get("query_length") or 32
            knobs["query_expansion"] = {"strategy": "fixed", "attend": bool(attend), "length": length}
    return knobs


def _expansion(said) -> Expansion | None:
    if said is None:
        return None
    strategy, length = said.get("strategy"), said.get("length")
    if strategy not in ("fixed", "min") or not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise Unserved(f"query_expansion {said!r}: expected strategy fixed or min and a positive length")
    return Expansion(strategy, bool(said.get("attend", False)), said.get("token"), length)


def _positive(n, name: str) -> int | None:
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise Unserved(f"{name} {n!r} is not a positive integer")
    return n


def register_prefixes(hf_tokenizer, prefixes: dict[str, str]) -> None:
    """PyLate's prefixes ("[Q] ", "[D] ") made special tokens of the tokenizer, as
    MultiVectorEncoder._register_prefix_tokens does, so that a prefix put before a text as text is
    read as the one token it was trained as (an in-vocabulary prefix the tokenizer would split)."""
    from transformers import AddedToken

    added = set(getattr(hf_tokenizer, "added_tokens_encoder", None) or {})
    vocab = hf_tokenizer.get_vocab()
    register = []
    for value in prefixes.values():
        if not value or not value.split():
            continue
        for prefix in (value, value.split(None, 1)[0]):
            if prefix not in added and prefix not in vocab:
                continue
            if hf_tokenizer.tokenize(prefix) != [prefix]:
                register.append(AddedToken(prefix, normalized=False, special=True))
            break
    if register:
        hf_tokenizer.add_special_tokens({"additional_special_tokens": register})


def skiplist_ids(hf_tokenizer, words: tuple[str, ...]) -> list[int]:
    """The skiplist's words → token ids, as MultiVectorMask.resolve_with_tokenizer: a word that is
    not one token of the vocabulary (its id the unknown token's) is left out."""
    unk, unk_token = getattr(hf_tokenizer, "unk_token_id", None), getattr(hf_tokenizer, "unk_token", None)
    ids = []
    for word in words:
        i = hf_tokenizer.convert_tokens_to_ids(word)
        if i is None or (unk is not None and i == unk and word != unk_token):
            continue
        ids.append(int(i))
    return ids


def expansion_id(hf_tokenizer, expansion: Expansion | None) -> int | None:
    """The id queries are expanded with: the declared token, else the mask token, else EOS."""
    if expansion is None:
        return None
    if expansion.token is not None:
        return int(hf_tokenizer.convert_tokens_to_ids(expansion.token))
    for i in (hf_tokenizer.mask_token_id, hf_tokenizer.eos_token_id):
        if i is not None:
            return int(i)
    raise Unserved("query expansion needs a token: this tokenizer has no mask or EOS token (declare one)")
