"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it, so that
of several operator pods (a rollout's surge, replicas for a fast fail-over) exactly one writes.

kopf's own peering is not used: it pauses kopf's handlers but not the operator's own tasks (the
service loops and their autoscaling), and two paused peers freeze each other. Here every write
checks `held()` first (cache.Cluster), and the service loops run only while the lease is held.

The holder renews the lease every fifth of its duration. A candidate takes it over only after it
has seen the lease unchanged for a whole duration, timed by its own clock (never by comparing
another pod's timestamps with it, so clock skew between nodes does not matter). The holder counts
itself leader only until a third of a duration, or the API timeout if longer, before a successor
may take over, counted from the moment it *sent* its last successful renewal (client-go's renew
deadline: 10 s of 15): the old holder has stopped starting writes, and the rest is room for one
already on the wire. (No client-side election fences a write the API server commits later still;
the Deployment's writes are also guarded by resourceVersions.) On a clean stop the lease is released, so a successor takes over at
its next look instead of after a duration.

Every call is bounded in all by the API timeout (kube.Kube), and the lease must leave room for a
renewal that takes all of it (config.check_lease): the holder renews every fifth of a duration and
must hear back before it stops.

A *lapse* is not a loss: when renewals fail (an API server too slow or unreachable) the holder
stops writing at its deadline, but its service loops only pause (every write checks held()), with
their autoscaling history, and go on when a renewal lands. Only a lease seen held by another pod
(or released, or gone) ends the term: the loops close (on_stop), and a later term starts afresh,
since the other pod may have scaled meanwhile. A renewal guarded by the resourceVersion of our own
last write can only land if no one wrote the lease since, so no successor came and went unseen.

The election runs as long as the operator does: a round that fails in a way no one foresaw is
logged and tried again, never the end of the task (which would leave the operator alive, its
liveness green, and nobody writing)."""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Awaitable, Callable

from embedop.config import check_lease
from embedop.kube import Conflict, Kube, Rejected, Retryable

log = logging.getLogger(__name__)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # MicroTime


class Leadership:
    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, duration_s: int,
                 on_start: Callable[[], Awaitable[None]], on_stop: Callable[[], Awaitable[None]],
                 request_s: float = 0.0):
        """`request_s`: the longest an API request of ours may take (its timeout): the holder stops
        starting writes that long (and at least a third of a duration) before a successor may
        start, so that a write already on the wire lands first. `on_start`: this pod may act
        (again: after a lapse too; idempotent); `on_stop`: the term is over (another pod leads)."""
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.duration_s = duration_s  # whole seconds: what the Lease can say (leaseDurationSeconds)
        check_lease(duration_s, request_s)
        self.deadline_s = duration_s - max(duration_s / 3, request_s)
        self.on_start, self.on_stop = on_start, on_stop
        self._held_until = 0.0  # loop time
        self._seen: tuple | None = None  # the lease's record as last seen, and since when (loop time)
        self._seen_at = 0.0
        self._leading = False  # a term: from taking the lease until another holder is seen
        self._acting = False  # within the term, whether on_start has run since the last lapse
        self._lost = False  # a round saw the lease held by another pod, released, or gone
        self._mine: dict | None = None  # the lease as our last successful write left it

    def held(self) -> bool:
        return asyncio.get_running_loop().time() < self._held_until

    async def run(self) -> None:
        try:
            while True:
                wait = self.duration_s / 5  # the holder renews, a candidate looks
                try:
                    await self._try()
                except (Retryable, Rejected) as e:  # an outage, the Lease deleted, RBAC: try again soon
                    # (not later than the holder's next renewal: a longer Retry-After would cost the lease)
                    self._mine, wait = None, min(getattr(e, "retry_after", None) or self.duration_s / 10, self.duration_s / 5)
                    log.warning("leader election: %s", e)
                except Exception:  # noqa: BLE001 - an answer no one foresaw: the election goes on
                    self._mine, wait = None, self.duration_s / 10
                    log.exception("leader election: a round failed; trying again in %.1f s", wait)
                try:
                    await self._follow()
                except Exception:  # noqa: BLE001 - the fleet's own failure; the next round follows again
                    log.exception("leader election: acting on the lease failed")
                await asyncio.sleep(wait)
        finally:
            if self._leading:
                await self._release()

    async def _follow(self) -> None:
        """Act on what the round found: a term ends when another holder was seen; a lapse only
        pauses (held() is false until a renewal lands); holding the lease, act."""
        if self._lost and self._leading:
            self._leading = self._acting = False
            log.info("lost leadership of %s/%s", self.namespace, self.name)
            await self.on_stop()
        self._lost = False
        if self.held() and not self._acting:
            log.info("%s leadership of %s/%s", "resumed" if self._leading else "acquired", self.namespace, self.name)
            self._leading = True
            await self.on_start()
            self._acting = True  # only once it has: a failure is followed again next round
        elif not self.held() and self._acting:
            self._acting = False
            log.warning("leader election: the lease of %s/%s lapsed (no renewal landed in time); writes pause until "
                        "one does, the services' loops and their history are kept", self.namespace, self.name)

    async def _try(self) -> None:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        if self._mine is not None:  # the holder renews from its own last write: one request
            try:
                self._mine = await self.kube.merge_patch("Lease", self.namespace, self.name, self._renewal(self._mine))
                self._held_until = sent + self.deadline_s
                return
            except Conflict:  # changed behind our back: look at it
                self._mine = None
        lease = await self.kube.get("Lease", self.namespace, self.name)
        if lease is None:
            self._lost = True  # deleted: whoever holds it next starts afresh
            try:
                self._mine = await self.kube.create(self._lease(transitions=0))
            except Conflict:  # another candidate created it first
                return
            self._held_until = sent + self.deadline_s
            return
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._seen:
            self._seen, self._seen_at = record, loop.time()
        holder = spec.get("holderIdentity")
        duration = spec.get("leaseDurationSeconds") or self.duration_s
        if holder == self.identity:
            body = self._renewal(lease)
        elif not holder or loop.time() - self._seen_at >= duration:  # released, or expired: take it
            body = {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                    "spec": self._lease(transitions=(spec.get("leaseTransitions") or 0) + 1)["spec"]}
        else:
            self._held_until, self._mine, self._lost = 0.0, None, True
            return
        if holder != self.identity:  # ours now is a new term: whatever was held before is over
            self._lost = True
        try:
            self._mine = await self.kube.merge_patch("Lease", self.namespace, self.name, body)
        except Conflict:  # someone else renewed or took it meanwhile
            self._held_until, self._mine, self._lost = 0.0, None, True
            return
        self._held_until = sent + self.deadline_s

    def _renewal(self, lease: dict) -> dict:
        return {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": {"renewTime": _now(), "leaseDurationSeconds": self.duration_s}}

    def _lease(self, transitions: int) -> dict:
        now = _now()
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": self.duration_s,
                         "acquireTime": now, "renewTime": now, "leaseTransitions": transitions}}

    async def _release(self) -> None:
        """Give the lease up (a clean stop): a successor need not wait a whole duration."""
        self._held_until, self._mine = 0.0, None
        try:
            lease = await self.kube.get("Lease", self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                await self.kube.merge_patch("Lease", self.namespace, self.name, {
                    "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                    "spec": {"holderIdentity": None}})
        except Exception as e:  # noqa: BLE001 - stopping anyway: the lease expires by itself
            log.warning("leader election: could not release the lease: %s", e)
