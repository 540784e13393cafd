"""An LLM reranker's prompt for a (query, text) pair, as sentence-transformers 6.2's CrossEncoder
builds it for a text-generation Transformer whose tokenizer has a chat template (its
Transformer.preprocess, "message" modality), reduced at start-up to three strings around the two
texts (`Pieces`); embedserve.batching.prompted_pairs makes token rows of them.

sentence-transformers makes the pair two messages, roles "query" and "document"
(InputFormatter.pair_to_messages; content a plain string in the "flat" message format,
[{"type": "text", "text": ...}] in the "structured" one), after a "system" message holding the
model's default prompt when it declares one (prepend_prompt_to_messages), and renders them with
the tokenizer's chat template (apply_chat_template, no generation prompt of its own).

Rendering Jinja per pair would cost tens of microseconds each, on the event loop or in a front end
(which has no transformers): the template is rendered once, here, with sentinels for the two
texts, and every pair is then `before + query + between + text + after`. That holds only for a
template that puts the texts in verbatim: probe pairs (with the whitespace a `trim` would eat,
braces an escape would change) are rendered both ways and must agree, else the model is refused
at start-up, as is a template the pair's texts do not reach (sentence-transformers refuses those
too).

A model whose tokenizer has no chat template (or whose saved Transformer has no "message"
modality) takes sentence-transformers' "text" path: the tokenizer's own pair encoding
(embedserve.batching.tokenization.pair_rows), the default prompt before the query. No torch here:
front ends read `Pieces`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from embedserve.model.declared import DeclarationError, Head

# The roles sentence-transformers gives a pair's two texts (base.modality.PAIR_ROLES).
ROLES = ("query", "document")
# Stand-ins for the texts while the template is rendered: private-use characters no template
# writes itself.
_SENTINELS = ("\ue000query\ue001", "\ue000document\ue001")
# Pairs that must render as the pieces say: sentence-transformers' own probes (does each text
# reach the prompt?), then texts with edge whitespace, inner newlines and braces (would a template
# trim, escape or otherwise change them?).
_PROBES = (("alpha", "bravo"), ("charlie", "bravo"), ("alpha", "foxtrot"), ("  a\n b  ", "\tc {{ d }} e \n"))
# Model types whose message format sentence-transformers knows without reading the template
# (base.modality.KNOWN_MODEL_TYPES_MESSAGE_FORMATS), and the template fragments that make it
# choose the structured format (InputFormatter._infer_format).
_KNOWN_FORMATS = {"apertus": "flat", "deepseek_v3": "flat", "gpt_oss": "flat", "seed_oss": "flat"}
_STRUCTURED = ("content[0]", ".type", "'type'", '"type"', "item.type", "message.content[")


class TemplateError(ValueError):
    """The chat template cannot carry a pair the way this module serves it."""


@dataclasses.dataclass(frozen=True)
class Pieces:
    """A pair's prompt is before + query + between + text + after."""

    before: str
    between: str
    after: str
    truncation_side: str = "right"

    def render(self, query: str, text: str) -> str:
        return self.before + query + self.between + text + self.after

    def spec(self) -> dict:
        return dataclasses.asdict(self)


def message_format(template: str | None, model_type: str, declared: str | None = None) -> str:
    """"flat" or "structured", as sentence-transformers picks it: the Transformer's saved
    modality_config (sentence_bert_config.json) when it names one, else by model type, else by
    the template's text. Pure."""
    if declared in ("flat", "structured"):
        return declared
    if model_type in _KNOWN_FORMATS:
        return _KNOWN_FORMATS[model_type]
    if not isinstance(template, str) or not template:
        return "structured"
    return "structured" if any(p in template for p in _STRUCTURED) else "flat"


def _messages(query: str, text: str, fmt: str, system: str) -> list[dict]:
    def content(value: str):
        return value if fmt == "flat" else [{"type": "text", "text": value}]

    head = [{"role": "system", "content": content(system)}] if system else []
    return head + [{"role": role, "content": content(v)} for role, v in zip(ROLES, (query, text))]


def pieces(hf_tokenizer, fmt: str, system: str = "") -> Pieces:
    """The tokenizer's chat template (transformers' apply_chat_template renders it) → the pieces
    around a pair's texts; `system`: the model's default prompt, a system message before the
    pair. At start-up, in the model's process. TemplateError when a text does not reach the
    prompt (sentence-transformers refuses such a template too) or is changed on its way."""
    def render(query: str, text: str) -> str:
        return str(hf_tokenizer.apply_chat_template(_messages(query, text, fmt, system), tokenize=False))

    try:
        whole = render(*_SENTINELS)
    except Exception as e:  # noqa: BLE001 - a template that raises on a pair serves no pair
        raise TemplateError(f"the chat template cannot render a 'query'/'document' pair ({type(e).__name__}: {e})") from None
    q, d = _SENTINELS
    if whole.count(q) != 1 or whole.count(d) != 1 or whole.index(q) > whole.index(d):
        missing = [r for r, s in zip(ROLES, _SENTINELS) if whole.count(s) != 1]
        why = (f"the {' and '.join(map(repr, missing))} content does not reach the prompt exactly once" if missing
               else "it puts the document before the query")
        raise TemplateError(f"the chat template cannot carry a 'query'/'document' pair: {why}")
    before, rest = whole.split(q)
    between, after = rest.split(d)
    out = Pieces(before, between, after, getattr(hf_tokenizer, "truncation_side", "right") or "right")
    for probe in _PROBES:
        if render(*probe) != out.render(*probe):
            raise TemplateError(f"the chat template changes a pair's texts as it renders them (the pair {probe!r}); "
                                "this server puts them in verbatim")
    return out


def chat_format(model_dir: str | Path, hf_tokenizer) -> str | None:
    """Whether sentence-transformers renders pairs through the chat template: None when it does
    not, else the message format its saved Transformer names ("" when none: inferred). It does
    when the saved modality_config (sentence_bert_config.json) has "message", or, with none saved
    (a plain checkpoint), when the tokenizer has a chat template."""
    path = Path(model_dir) / "sentence_bert_config.json"
    said = json.loads(path.read_text()) if path.is_file() else {}
    config = said.get("modality_config") if isinstance(said, dict) else None
    if isinstance(config, dict):
        message = config.get("message")
        return None if not isinstance(message, dict) else str(message.get("format", "") or "").replace("auto", "")
    return "" if getattr(hf_tokenizer, "chat_template", None) else None


def for_model(model_dir: str | Path, hf_tokenizer, model_type: str, head: Head) -> tuple[Head, dict | None]:
    """An LLM reranker's pair prompt: (the head its service reads, the pieces as a dict for
    TextTokenizer, or None for the tokenizer's pair encoding). With a chat template the default
    prompt is the system message inside the pieces, so the head served declares no default
    prompt (shaping would put it before the query a second time). DeclarationError for a
    template this server cannot serve."""
    fmt = chat_format(model_dir, hf_tokenizer)
    if fmt is None:
        return head, None
    fmt = message_format(getattr(hf_tokenizer, "chat_template", None), model_type, fmt or None)
    try:
        found = pieces(hf_tokenizer, fmt, head.prompt(None))
    except TemplateError as e:
        raise DeclarationError(str(e)) from None
    return dataclasses.replace(head, default_prompt_name=None), found.spec()
