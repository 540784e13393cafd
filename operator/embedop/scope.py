"""One operator per namespace: refuse to run where another embedfleet release's operator already
covers a namespace this one would watch; checked at start-up and again at the start of each
leadership term (Term), since claims come and go while an operator runs (a release installed or
uninstalled, an operator run outside the chart, a check that could not read the claims before).

Every release of the chart has a claim: a Lease in its own namespace, labelled CLAIM_LABEL, whose
WATCHED annotation names the namespaces its operator watches ("*": all). Two operators whose
scopes overlap (a cluster-wide one and any other; two for one namespace) would both reconcile and
scale the same EmbeddingServices: each holds its own leader Lease, so leader election does not
stop them. The claims are static (the chart's, not renewed): the older one (the API server's
creationTimestamp, one clock; ties broken by namespace and name) keeps its scope, and an operator
whose claim is newer, or that has none (run outside the chart), exits with an error naming the
other release, before it has written anything. Pods of one release share its claim, so a rollout
never refuses itself.

decide() is pure; check() reads the claims (one label-selected list across the cluster, from the
API server's watch cache)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from embedop.kube import Kube, NotFound, Rejected

log = logging.getLogger(__name__)

CLAIM_LABEL = "embedfleet.dev/scope-claim"
WATCHED = "embedfleet.dev/watch-namespaces"
ALL = "*"
RELEASE_LABEL = "app.kubernetes.io/instance"


@dataclasses.dataclass(frozen=True)
class Claim:
    namespace: str  # the release's (and the claim Lease's) namespace
    name: str  # the claim Lease's name
    created: str  # metadata.creationTimestamp (RFC 3339, UTC: orders as text)
    watched: frozenset[str]  # {ALL} or namespace names
    release: str = ""

    @classmethod
    def of(cls, lease: dict) -> "Claim":
        meta = lease.get("metadata") or {}
        raw = ((meta.get("annotations") or {}).get(WATCHED) or ALL).strip()
        # A claim without its annotation (or an empty one) is taken at its widest: all namespaces.
        watched = frozenset(n.strip() for n in raw.split(",") if n.strip()) or frozenset({ALL})
        return cls(meta.get("namespace", ""), meta.get("name", ""), meta.get("creationTimestamp") or "",
                   frozenset({ALL}) if ALL in watched else watched, (meta.get("labels") or {}).get(RELEASE_LABEL, ""))

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    def precedes(self, other: "Claim") -> bool:
        return (self.created, self.namespace, self.name) < (other.created, other.namespace, other.name)

    def describe(self) -> str:
        who = f"release {self.release} in namespace {self.namespace}" if self.release else f"namespace {self.namespace}"
        return f"the embedfleet operator of {who} (claim Lease {self.namespace}/{self.name}, watching {scope_text(self.watched)})"


def scope_text(watched: frozenset[str]) -> str:
    return "all namespaces" if ALL in watched else "namespace(s) " + ", ".join(sorted(watched))


def overlap(a: frozenset[str], b: frozenset[str]) -> bool:
    return ALL in a or ALL in b or bool(a & b)


def decide(claims: list[Claim], own: tuple[str, str] | None, watched: frozenset[str]) -> list[Claim]:
    """The other releases' claims that keep this operator from running: those that overlap
    `watched` (this operator's namespaces, or {ALL}) and precede its own claim `own` (namespace,
    name), which, when it is not among `claims` (none configured, or not created yet), precedes
    nothing. Empty: it may run."""
    mine = next((c for c in claims if c.key == own), None)
    return [c for c in claims if c.key != own and overlap(c.watched, watched)
            and (mine is None or c.precedes(mine))]


def refusal(blocking: list[Claim], watched: frozenset[str], own: tuple[str, str] | None) -> str:
    me = f"claim Lease {own[0]}/{own[1]}" if own else "no claim of its own (not installed by the chart)"
    others = "; ".join(c.describe() for c in blocking)
    return (f"refusing to start: this operator (watching {scope_text(watched)}, {me}) overlaps {others}, "
            "which claimed it first. Two operators would both reconcile and scale the same EmbeddingServices. "
            "Uninstall one release, or give each its own watchNamespace (see docs/operator.md, \"Several releases\")")


def own_claim(pod_namespace: str, claim: str) -> tuple[str, str] | None:
    """This operator's claim (namespace, name): EMBEDOP_SCOPE_CLAIM in its pod's namespace; None
    outside the chart."""
    return (pod_namespace, claim) if pod_namespace and claim else None


async def check(kube: Kube, own: tuple[str, str] | None, namespaces: list[str]) -> str | None:
    """The refusal message, or None when this operator may run. An API that does not let it list
    the claims (RBAC without the chart's scope ClusterRole: scopeCheck.enabled=false) is a warning,
    not a refusal."""
    watched = frozenset(namespaces) or frozenset({ALL})
    try:
        # resourceVersion=0: from the API server's watch cache. A consistent list would be a range
        # read in etcd of every Lease of the cluster (each node's heartbeat is one), filtered after.
        # The cache trails etcd by moments, and the claims are made at install, not while we look.
        leases, _ = await kube.list_versioned("Lease", None, {CLAIM_LABEL: "true"}, cached=True)
    except (NotFound, Rejected) as e:
        log.warning("could not read other operators' scope claims (%s): not checking for overlapping operators "
                    "(the chart's scopeCheck.enabled=false gives no right to)", e)
        return None
    # The selector is the API server's; checked again here (a claim is only what carries the label).
    claims = [Claim.of(lease) for lease in leases
              if ((lease.get("metadata") or {}).get("labels") or {}).get(CLAIM_LABEL) == "true"]
    if own is not None and own not in {c.key for c in claims}:
        log.info("this operator's scope claim %s/%s does not exist (yet): it yields to every other claim", *own)
    blocking = decide(claims, own, watched)
    if blocking:
        return refusal(blocking, watched, own)
    log.info("scope: watching %s; no other operator's claim overlaps it", scope_text(watched))
    return None


class Term:
    """The check again at the start of each leadership term, before the leader writes anything:
    `passed` is false from the term's start until the check has passed (the writes wait for it:
    handlers.py). A lapse resumed is the same term (no other pod led meanwhile): not checked again.
    A refusal calls `refused` with its message (the operator stops, as at start-up); a check that
    fails (Retryable: the API not answering) raises, and the leader tries again at its next round."""

    def __init__(self, kube: Kube, own: tuple[str, str] | None, namespaces: list[str],
                 refused: Callable[[str], None]):
        self.kube, self.own, self.namespaces, self.refused = kube, own, namespaces, refused
        self.passed = False

    async def start(self) -> bool:
        """Whether this pod may act in this term."""
        if not self.passed:
            if (message := await check(self.kube, self.own, self.namespaces)) is not None:
                self.refused(message)
                return False
            self.passed = True
        return True

    def end(self) -> None:
        self.passed = False
