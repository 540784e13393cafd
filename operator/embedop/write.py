"""Writing one owned object: created when it does not exist, applied when it is ours, held when
what we apply does not stick.

- **Create first.** An object we do not see is created (POST), never server-side applied: a forced
  apply of a name someone else took between our read and our write would take their object over
  (our fields forced onto it, its selector rewritten, and the garbage collector deleting it with
  the service). A create answers 409 AlreadyExists instead (Conflict); the reconcile then reads
  it fresh and, not ours, reports it (NotOwned). Only objects we have seen to be ours are applied.
- **The create's fields become our apply's.** The API server records a create as an Update by our
  field manager, not an Apply: those fields would stay owned by that entry when a later apply
  stops sending one (an env entry removed from the spec would stay for good,
  kubernetes/kubernetes#99003). So, right after the create, our Update entry becomes our Apply
  entry (`adoption`: what client-go's csaupgrade does for kubectl), by a JSON patch whose `test`
  operations check the entry it rewrites (a controller's status write meanwhile does not stop it;
  a changed entry is read again); and, should that patch have failed, at the next reconcile that
  finds the entry still there (`adopted`: no request otherwise). A patch refused for another reason
  (a webhook or admission policy that refuses UPDATEs of the object, RBAC) is not tried again for
  ADOPT_BACKOFF_S, for that object (its uid), logged: each reconcile would otherwise send it again
  and again for nothing. (A failed `test` answers 422, as do a ValidatingAdmissionPolicy's refusal
  and an invalid object: only a re-read that finds the entry changed tells them apart.)
- **Held when it does not stick.** Every apply's answer is compared with what was sent
  (drift.after_apply, remembered per object in Cluster.applied): a render the API server keeps
  pruning or a webhook keeps rewriting is not applied again after a few tries (`held`), and the
  service says why (condition FieldNotPersisted, and a Warning Event; not Degraded: status.py)."""

from __future__ import annotations

import copy
import logging

from embedop import drift
from embedop.cache import Cluster
from embedop.kube import FIELD_MANAGER, Conflict, NotFound, Rejected

log = logging.getLogger(__name__)

ADOPT_ATTEMPTS = 3
ADOPT_BACKOFF_S = drift.STUCK_BACKOFF_S  # an adoption refused: not tried again for an hour, as a held render
FIELD_NOT_PERSISTED = drift.FIELD_NOT_PERSISTED


def _key(obj: dict) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]


def _union(a: dict, b: dict) -> dict:
    """Two FieldsV1 sets (tries of `f:`/`k:`/`v:`/`i:` keys, `.` for the node itself) as one."""
    out = dict(a)
    for k, v in b.items():
        out[k] = _union(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def adoption(obj: dict, manager: str = FIELD_MANAGER) -> list[dict] | None:
    """The JSON patch that makes `manager`'s Update entry of `obj`'s managedFields (the main
    resource's, not a subresource's) part of its Apply entry (merged into it, or the entry
    itself turned into it), or None when there is none. Each entry rewritten is tested first."""
    entries = (obj.get("metadata") or {}).get("managedFields") or []

    def find(operation: str) -> int | None:
        return next((i for i, e in enumerate(entries) if e.get("manager") == manager and e.get("operation") == operation
                     and not e.get("subresource")), None)

    update, applied = find("Update"), find("Apply")
    if update is None:
        return None
    at = lambda i: f"/metadata/managedFields/{i}"  # noqa: E731
    tests = [{"op": "test", "path": at(update), "value": entries[update]}]
    if applied is None:
        return tests + [{"op": "replace", "path": f"{at(update)}/operation", "value": "Apply"}]
    merged = _union(entries[applied].get("fieldsV1") or {}, entries[update].get("fieldsV1") or {})
    return tests + [{"op": "test", "path": at(applied), "value": entries[applied]},
                    {"op": "replace", "path": f"{at(applied)}/fieldsV1", "value": merged},
                    {"op": "remove", "path": at(update)}]


async def create(cluster: Cluster, obj: dict, adopt: bool = True) -> dict:
    """Create `obj` (Conflict when an object of its name exists); `adopt`: then make the create's
    fields our apply's (for an object we apply later). → the object as stored."""
    stored = await cluster.create(obj)
    return await adopted(cluster, obj["kind"], stored) if adopt else stored


async def adopted(cluster: Cluster, kind: str, stored: dict) -> dict:
    """`stored` (ours, of `kind`: a listed object may not say) with our field manager's Update
    entry made part of its Apply entry (`adoption`); no request when there is none. → the object
    as it is now."""
    meta = stored["metadata"]
    refused = cluster.unadopted.get(meta.get("uid", ""))
    if refused is not None and cluster.clock() < refused:
        return stored
    for _ in range(ADOPT_ATTEMPTS):
        if (operations := adoption(stored)) is None:
            return stored
        try:
            return await cluster.json_patch(kind, meta["namespace"], meta["name"], operations)
        except NotFound:
            return stored
        except Rejected as e:
            if e.code == 422:  # a test failed (the entry moved), or a refusal that answers 422
                fresh = await cluster.get(kind, meta["namespace"], meta["name"], fresh=True)
                if fresh is None:
                    return stored
                if adoption(fresh) != operations:
                    stored = fresh
                    continue
            return _refused(cluster, kind, stored, e)
        except Conflict:  # the object changed under the patch: read it again
            fresh = await cluster.get(kind, meta["namespace"], meta["name"], fresh=True)
            if fresh is None:
                return stored
            stored = fresh
    log.warning("%s %s/%s: the fields of its create are still owned by an Update of %s (tried again at the next "
                "check)", kind, meta["namespace"], meta["name"], FIELD_MANAGER)
    return stored


def _refused(cluster: Cluster, kind: str, stored: dict, error: Rejected) -> dict:
    meta = stored["metadata"]
    cluster.unadopted[meta.get("uid", "")] = cluster.clock() + ADOPT_BACKOFF_S
    log.warning("%s %s/%s: the fields of its create could not be made %s's apply (%s); not tried again for %.0f min "
                "(a field the operator later stops sending may stay until then)", kind, meta["namespace"],
                meta["name"], FIELD_MANAGER, error, ADOPT_BACKOFF_S / 60)
    return stored


def held(cluster: Cluster, obj: dict, live: dict | None) -> str | None:
    """The FieldNotPersisted message when `obj` (stamped) is held: not to be applied now over
    `live` (an object that is gone is made again whatever its fields did)."""
    record = cluster.applied.get(_key(obj))
    if live is not None and drift.held(record, obj, cluster.clock()):
        return drift.stuck_message(obj["kind"], obj["metadata"]["name"], record)
    return None


def record(cluster: Cluster, sent: dict, stored: dict) -> str | None:
    """Remember `sent` (stamped) as applied, `stored` as the API's answer. → the FieldNotPersisted
    message when this apply starts a hold."""
    key = _key(sent)
    cluster.applied[key] = now = drift.after_apply(cluster.applied.get(key), sent, stored, cluster.clock())
    if now.held_until is not None:
        log.warning("%s/%s/%s: %s not stored as sent; holding its apply", *key, ", ".join(now.paths))
        return drift.stuck_message(sent["kind"], sent["metadata"]["name"], now)
    return None


async def put(cluster: Cluster, obj: dict, live: dict | None, **kwargs) -> tuple[dict, str | None]:
    """Create `obj` (stamped) when `live` is None, else apply it (`kwargs`: Cluster.apply's), and
    remember whether it stuck. → (the object as stored, the FieldNotPersisted message when it
    is held from now on)."""
    sent = copy.deepcopy(obj)
    stored = await create(cluster, obj) if live is None else await cluster.apply(obj, **kwargs)
    return stored, record(cluster, sent, stored)
