"""Builders of OpenAPI v3 schema fragments, as a CustomResourceDefinition's structural schema
wants them (every field typed, with a description; Kubernetes' int-or-string and open objects
spelled its way), the fields of one model (the spec's own and each spec.models entry's), and a
schema's defaults applied as the API server applies them. Pure; crd.py builds the
EmbeddingService's schema from them."""

from __future__ import annotations

from typing import Any

import yaml


def typed(type_: str, description: str, **extra: Any) -> dict:
    return {"type": type_, "description": description, **extra}


def integer(description, default=None, minimum=None, maximum=None) -> dict:
    s = typed("integer", description)
    for key, value in (("default", default), ("minimum", minimum), ("maximum", maximum)):
        if value is not None:
            s[key] = value
    return s


def number(description, default=None, minimum=None, maximum=None) -> dict:
    s = integer(description, default, minimum, maximum)
    s["type"] = "number"
    return s


def string(description, default=None, **extra) -> dict:
    s = typed("string", description, **extra)
    if default is not None:
        s["default"] = default
    return s


def boolean(description, default) -> dict:
    return typed("boolean", description, default=default)


def obj(description, properties: dict, default: dict | None = None, **extra) -> dict:
    s = typed("object", description, properties=properties, **extra)
    if default is not None:
        s["default"] = default
    return s


def quantity(description, default=None) -> dict:
    s = {"description": description, "x-kubernetes-int-or-string": True,
         "pattern": r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$", "anyOf": [{"type": "integer"}, {"type": "string"}]}
    if default is not None:
        s["default"] = default
    return s


def kubernetes(description: str, type_: str = "object") -> dict:
    """A field of a Kubernetes type passed through to the pod as written. Its schema is left open
    here; the operator checks it against the Kubernetes models (spec.problems), and what the API
    server still refuses shows as the Degraded condition with the API's message."""
    if type_ == "array":
        return {"type": "array", "description": description,
                "items": {"type": "object", "description": "One entry, as Kubernetes defines it.",
                          "x-kubernetes-preserve-unknown-fields": True}}
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def string_map(description: str) -> dict:
    return {"type": "object", "description": description, "additionalProperties": {"type": "string"}}


def int_or_percent(description: str, default) -> dict:
    return {"description": description, "x-kubernetes-int-or-string": True, "default": default,
            "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^[0-9]+%$"}]}


# What a server may be told to serve (its TASK setting, besides auto: the server infers it).
TASKS = ("embed", "rerank", "sparse", "classify", "bgem3")
POOLING_PATTERN = r"^(cls|mean|max|lasttoken|weightedmean|mean_sqrt_len_tokens)(\+(cls|mean|max|lasttoken|weightedmean|mean_sqrt_len_tokens))*$"


def model_fields(model: str, revision: str, task: str, pooling: str) -> dict:
    """The fields that say what one model is and how it is served, by name: the spec's own (one
    model) and each spec.models entry's, with the same types and limits and their own descriptions."""
    return {
        "model": string(model, minLength=1, maxLength=512),
        "modelRevision": string(revision, maxLength=256, pattern=r"^[^\s]+$"),
        "task": string(task, enum=list(TASKS)),
        "pooling": obj(pooling, {
            "strategy": string("Overrides the model's declared pooling: cls, mean, max, lasttoken, weightedmean or "
                               "mean_sqrt_len_tokens (several joined by +, concatenated). Unset: as declared.",
                               pattern=POOLING_PATTERN),
            "normalize": typed("boolean", "Overrides the model's declaration: L2-normalise the vectors or not. Unset: as declared (a Normalize module)."),
            "excludeTokens": {"type": "array", "description": "Control tokens (strings in the model's vocabulary) left out of mean pooling: "
                              "a deliberate deviation from sentence-transformers. A token the vocabulary lacks fails the server's start-up, naming it.",
                              "items": {"type": "string", "minLength": 1}, "maxItems": 64},
        }, default={}),
    }


def with_defaults(value: Any, schema: dict) -> Any:
    """Apply the schema's defaults as the API server would (missing fields of present objects;
    an absent object with a default of {} is created and defaulted too)."""
    if schema.get("type") == "object" and isinstance(value, dict):
        out = dict(value)
        for name, prop in schema.get("properties", {}).items():
            if name not in out and "default" in prop:
                out[name] = _copy(prop["default"])
            if name in out:
                out[name] = with_defaults(out[name], prop)
        return out
    if schema.get("type") == "array" and isinstance(value, list) and "items" in schema:
        return [with_defaults(v, schema["items"]) for v in value]
    return value


def _copy(v):
    return yaml.safe_load(yaml.safe_dump(v))
