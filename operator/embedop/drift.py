"""Whether a live object still is what we render: judged against what the API server stores, not
what we send. The server drops empty values (omitempty), adds defaults and writes quantities in
canonical form (subset); a field or list entry we stopped sending is seen through the digest of
our last apply (stamped). Pure."""

from __future__ import annotations

import decimal
import hashlib
import json

from lightkube.utils.quantity import parse_quantity

from embedop import crd

# The fields we write that the API server stores as resource.Quantity, rewritten in its canonical
# form ("2.5" → "2500m", "1024Mi" → "1Gi", "1000m" → "1"): compared as quantities. Everything else
# is compared exactly (an env value "1k" is not "1000", false is not 0). Suffixes of the path of
# dict keys (list positions left out); "*" is any key.
QUANTITY_PATHS = (("resources", "requests", "*"), ("resources", "limits", "*"), ("emptyDir", "sizeLimit"),
                  ("target", "averageValue"), ("target", "value"))


def _is_quantity(path: tuple[str, ...]) -> bool:
    return any(len(path) >= len(q) and all(k in ("*", p) for k, p in zip(q, path[-len(q):])) for q in QUANTITY_PATHS)


def _same_scalar(a, b, path: tuple[str, ...] = ()) -> bool:
    if not _is_quantity(path):
        return a == b and isinstance(a, bool) == isinstance(b, bool)
    if str(a) == str(b):
        return True
    try:
        qa, qb = parse_quantity(str(a)), parse_quantity(str(b))
    except (ValueError, decimal.InvalidOperation):
        return False
    return qa is not None and qa == qb


def subset(desired, actual, path: tuple[str, ...] = ()) -> bool:
    """Whether every field we set has our value as the server stores it: it may add defaults of
    its own, writes quantities in its canonical form, and omits empty strings, lists and maps (an
    env entry's `value: ""` comes back without its value; a NetworkPolicy peer's `matchExpressions: []`
    without it). `path`: where `desired` sits in its object."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(subset(v, actual[k], (*path, k)) if k in actual else v in ("", [], {})
                                                for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(actual, list):
            return False
        if desired and all(isinstance(d, dict) and "name" in d for d in desired):
            # A list keyed under server-side apply (env, containers, ports, volumes, volumeMounts,
            # ownerReferences): entries another manager added (a mutating webhook's sidecar,
            # `kubectl set env`) stay whatever we apply, and are not ours to judge. (An entry we
            # stopped sending is caught by the applied-render stamp: see `drifted`.)
            return all(any(isinstance(a, dict) and a.get("name") == d["name"] and subset(d, a, path) for a in actual)
                       for d in desired)
        return len(desired) == len(actual) and all(subset(d, a, path) for d, a in zip(desired, actual))
    return _same_scalar(desired, actual, path)


# On each object we apply: a digest of what we sent. A field or list entry we stop sending (an env
# entry removed from the spec) is removed by our next apply, but a check of what we send against
# what is stored cannot see it missing; the digest of the last apply says the render changed.
APPLIED = f"{crd.GROUP}/applied"


def stamped(obj: dict) -> dict:
    """`obj` with the digest of itself (resourceVersion and the digest left out) as APPLIED."""
    meta = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
    meta["annotations"] = {k: v for k, v in (meta.get("annotations") or {}).items() if k != APPLIED}
    digest = hashlib.sha256(json.dumps({**obj, "metadata": meta}, sort_keys=True).encode()).hexdigest()[:16]
    out = {**obj, "metadata": {**obj["metadata"], "annotations": {**meta["annotations"], APPLIED: digest}}}
    return out


def drifted(desired: dict, live: dict | None) -> bool:
    """Whether `desired` (stamped) must be applied: the object is missing, or a field we send no
    longer has our value as the API stores it, the stamp included (our render changed)."""
    return live is None or not subset(_unguarded(desired), live)


def _unguarded(obj: dict) -> dict:
    meta = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
    return {**obj, "metadata": meta}
