"""Whether a live object still is what we render: judged against what the API server stores, not
what we send. The server drops empty values (omitempty), adds defaults and writes quantities in
canonical form (subset); a field or list entry we stopped sending is seen through the digest of
our last apply (stamped); a render whose fields the server does not keep as sent is held rather
than applied at every check (after_apply, held). Pure."""

from __future__ import annotations

import dataclasses
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


# A container's image: a policy that pins digests (Kyverno's verifyImages mutateDigest) stores
# `repo:tag` as `repo:tag@sha256:…`, the same image, which stays what the tag named when it was
# admitted (the kubelet pulls by the digest). Equal, so it is neither applied again nor held.
IMAGE_PATHS = (("containers", "image"), ("initContainers", "image"))


def _pinned(sent, stored) -> bool:
    return (isinstance(sent, str) and isinstance(stored, str) and "@" not in sent
            and stored.startswith(f"{sent}@sha256:"))


def _same_scalar(a, b, path: tuple[str, ...] = ()) -> bool:
    if path[-2:] in IMAGE_PATHS and _pinned(a, b):
        return True
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
    return next(_differences(desired, actual, path, ""), None) is None


def differences(desired, actual) -> list[str]:
    """The JSON paths (`.spec.template.spec.containers[name=server].env[name=X].value`,
    `.spec.targetPorts[0]`) where `actual` does not hold what `desired` sets, as `subset` judges."""
    return list(_differences(desired, actual, (), ""))


def _differences(desired, actual, path: tuple[str, ...], where: str):
    """`path`: the dict keys down to `desired` (QUANTITY_PATHS match it); `where`: its JSON path."""
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            yield where or "."
            return
        for k, v in desired.items():
            if k in actual:
                yield from _differences(v, actual[k], (*path, k), f"{where}.{k}")
            elif v not in ("", [], {}):
                yield f"{where}.{k}"
        return
    if isinstance(desired, list):
        if not isinstance(actual, list):
            yield where or "."
        elif desired and all(isinstance(d, dict) and "name" in d for d in desired):
            # A list keyed under server-side apply (env, containers, ports, volumes, volumeMounts,
            # ownerReferences): entries another manager added (a mutating webhook's sidecar,
            # `kubectl set env`) stay whatever we apply, and are not ours to judge. (An entry we
            # stopped sending is caught by the applied-render stamp: see `drifted`.)
            for d in desired:
                entry = f"{where}[name={d['name']}]"
                same = [a for a in actual if isinstance(a, dict) and a.get("name") == d["name"]]
                if not any(next(_differences(d, a, path, entry), None) is None for a in same):
                    yield from (_differences(d, same[0], path, entry) if same else [entry])
        elif len(desired) != len(actual):
            yield where or "."
        else:
            for i, (d, a) in enumerate(zip(desired, actual)):
                yield from _differences(d, a, path, f"{where}[{i}]")
        return
    if not _same_scalar(desired, actual, path):
        yield where or "."


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


# Fields that do not stick. An apply whose answer (the object as the API server stored it) lacks
# or differs in a field we sent would be applied again at every check, forever: the server prunes
# a field its schema lacks (an InferencePool CRD older than the render), a mutating webhook
# rewrites one, a defaulting we undo. After STUCK_APPLIES such applies of one render within
# STUCK_WINDOW_S the render is not applied again until it changes, or for STUCK_BACKOFF_S
# (a CRD upgraded, a webhook removed); a retry then that does not stick either holds again at once.
STUCK_APPLIES, STUCK_WINDOW_S, STUCK_BACKOFF_S = 3, 600.0, 3600.0
FIELD_NOT_PERSISTED = "FieldNotPersisted"  # the condition (and the Event's reason) while a render is held


@dataclasses.dataclass(frozen=True)
class Applied:
    """What this operator remembers of its applies of one object: the digest of the render last
    applied (its APPLIED stamp); when that render was applied and did not stick (within
    STUCK_WINDOW_S); the JSON paths that did not stick the last time; until when it is held."""
    digest: str
    times: tuple[float, ...] = ()
    paths: tuple[str, ...] = ()
    held_until: float | None = None


def digest_of(obj: dict) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(APPLIED)


def after_apply(before: Applied | None, sent: dict, stored: dict, now: float) -> Applied:
    """The record after `sent` (stamped) was applied (or created) and the API answered `stored`."""
    digest = digest_of(sent) or ""
    paths = tuple(differences(_unguarded(sent), stored))
    if not paths:  # stored as sent: nothing to hold, nothing to count
        return Applied(digest)
    same = before is not None and before.digest == digest
    times = (*(t for t in (before.times if same else ()) if now - t < STUCK_WINDOW_S), now)
    again = same and before.held_until is not None  # the retry after a hold: held again
    held = now + STUCK_BACKOFF_S if len(times) >= STUCK_APPLIES or again else None
    return Applied(digest, times, paths, held)


def held(record: Applied | None, desired: dict, now: float) -> bool:
    """Whether `desired` (stamped) is not to be applied now: the same render did not stick and
    its hold has not run out."""
    return (record is not None and record.held_until is not None and now < record.held_until
            and record.digest == digest_of(desired))


def stuck_message(kind: str, name: str, record: Applied) -> str:
    """The FieldNotPersisted condition's message for an object held by `record`."""
    return (f"{kind}/{name}: {', '.join(record.paths)} not stored as sent, applied {STUCK_APPLIES} times "
            f"within {STUCK_WINDOW_S / 60:.0f} min (the API server prunes a field its schema lacks, e.g. a CRD older "
            f"than this operator, or a mutating webhook rewrites it); not applied again until what the operator "
            f"renders for it changes, or for {STUCK_BACKOFF_S / 60:.0f} min")
