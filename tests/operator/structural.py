"""What a real API server does to a custom resource with its CRD's structural openAPIV3Schema
before it stores it (Kubernetes' "Field pruning" and "Defaulting" of CustomResourceDefinitions):
fields the schema does not name are dropped, silently, unless a node says
x-kubernetes-preserve-unknown-fields; missing fields with a `default` get it where their parent
object exists. apiVersion, kind and metadata are the API server's own (never pruned by the
schema). The emulator applies both to the custom resources it serves with a schema."""

from __future__ import annotations

import copy

OWN = ("apiVersion", "kind", "metadata")


def prune(obj, schema: dict, root: bool = True):
    """`obj` with what `schema` does not name removed (in place; also returned)."""
    if isinstance(obj, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        keep = schema.get("x-kubernetes-preserve-unknown-fields")
        for key in list(obj):
            if root and key in OWN:
                continue
            if props is not None and key in props:
                prune(obj[key], props[key], root=False)
            elif isinstance(extra, dict):
                prune(obj[key], extra, root=False)
            elif not keep and extra is not True:
                del obj[key]
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            prune(item, schema["items"], root=False)
    return obj


def default(obj, schema: dict):
    """`obj` with the schema's defaults where a field is missing and its parent exists (in place)."""
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                default(obj[key], sub)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            default(item, schema["items"])
    return obj
