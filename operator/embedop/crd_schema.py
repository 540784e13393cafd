"""Builders of OpenAPI v3 schema fragments, as a CustomResourceDefinition's structural schema
wants them (every field typed, with a description; Kubernetes' int-or-string and open objects
spelled its way). Pure; crd.py builds the EmbeddingService's schema from them."""

from __future__ import annotations

from typing import Any


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
