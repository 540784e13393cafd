"""One background task per EmbeddingService while this operator pod leads: the periodic reconcile
(drift, status), at once when a watched object of the service changes, and, in mode operator, the
autoscaler's steps.

Deliberately not kopf timers or daemons: kopf puts a finalizer on every object that has one, and a
finalizer outlives the operator (after `helm uninstall` the services hang in Terminating, their
GPU pods run on, and deleting the namespace hangs). Without one, deleting a service never waits for
the operator: the garbage collector removes what it owned, through the ownerReferences."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import defaultdict
from typing import Callable

from embedop import autoscale, autoscaler, crd, reconcile, spec as specs, status
from embedop.cache import Cluster, NotLeader
from embedop.config import OperatorSettings
from embedop.decisions import Decisions
from embedop.kube import NotFound, Retryable
from embedop.render import SERVICE_LABEL
from embedop.scrape import Reader

log = logging.getLogger(__name__)


def retry_in(failures: int, first_s: float, cap_s: float) -> float:
    """The wait after `failures` (≥ 1) failed passes in a row: `first_s`, doubled per further
    failure, at most `cap_s` (the periodic check's interval). Pure; the loop takes up to 20% off
    at random."""
    return min(cap_s, first_s * 2 ** min(failures - 1, 30))


class Fleet:
    def __init__(self, cluster: Cluster, settings: OperatorSettings,
                 on_outcome: Callable[[reconcile.Outcome], None],
                 on_decision: Callable[[dict, autoscaler.Step], None], leading: bool = False):
        self.cluster, self.settings = cluster, settings
        self.on_outcome, self.on_decision = on_outcome, on_decision
        self.tasks: dict[tuple[str, str], asyncio.Task] = {}
        self.kicks: defaultdict[tuple[str, str], asyncio.Event] = defaultdict(asyncio.Event)
        self.generations: dict[tuple[str, str], tuple] = {}  # each service's (uid, generation), as last seen
        # One write sequence per service at a time within this process (handlers, loop, autoscaler);
        # across processes the resourceVersion guards keep them correct, and the lease keeps
        # a second operator pod from writing at all.
        self.locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)
        # Mode keda's decisions, for KEDA (embedop.scaler): this pod's while it leads.
        self.decisions = Decisions()
        # In a leadership term (lead() to close()): every service has its loop. Not whether this
        # pod may write at this instant (cluster.may_write, which each pass checks): a service seen
        # while a renewal is late must still get its loop, or it waits for its next change (a lapse
        # that the election itself saw go by resumes with lead(), but not one a renewal ended first).
        self.leading = leading

    def ensure(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if self.leading and (key not in self.tasks or self.tasks[key].done()):
            self.kicks[key].set()  # its first pass reconciles at once
            self.tasks[key] = asyncio.create_task(self._run(namespace, name), name=f"embedop:{namespace}/{name}")

    def stop(self, namespace: str, name: str) -> None:
        task = self.tasks.pop((namespace, name), None)
        self.generations.pop((namespace, name), None)
        self.decisions.forget((namespace, name))
        # A service made again under this name starts KEDA's rebuild schedule afresh, not at its 5 min.
        self.cluster.rebuilt.pop((namespace, name), None)
        if task is not None:
            task.cancel()

    def changed(self, namespace: str, name: str, version: tuple) -> None:
        """A service was seen (listed, created, changed): its loop runs, and reconciles now if it
        is another (uid) or its spec moved (generation). Its own status writes come back as events
        too: those move neither and cost no reconcile."""
        key = (namespace, name)
        if self.generations.get(key) != version and key in self.tasks:
            self.kicks[key].set()
        self.generations[key] = version
        self.ensure(namespace, name)

    def kick(self, kind: str, event: str, obj: dict) -> None:
        """A watched object of a service changed (a rollout's progress, a hand edit, a deletion):
        its loop reconciles now. Several changes before it runs are one reconcile. A pod's
        change waits for the autoscaler's next step, but a pod whose models do not fit its device
        (its termination message): the service is Degraded at once, not at the next periodic check."""
        if kind == "Pod" and not status.misfit([obj]):
            return
        meta = obj.get("metadata") or {}
        service = (meta.get("labels") or {}).get(SERVICE_LABEL) or meta.get("name", "").removesuffix("-headless")
        if (key := (meta.get("namespace"), service)) in self.tasks:
            self.kicks[key].set()
        # A marker in the log (the tests wait for it rather than for time to pass).
        log.debug("followed %s %s/%s (%s)", kind, meta.get("namespace"), meta.get("name"), event)

    async def lead(self) -> None:
        """This pod now holds the lease: every known service gets its loop."""
        self.leading = True
        for namespace, name in list(self.cluster.stores[crd.KIND].objects):
            self.ensure(namespace, name)

    async def close(self) -> None:
        self.leading = False
        tasks = list(self.tasks.values())
        self.tasks.clear()
        self.decisions.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def reconcile(self, namespace: str, name: str) -> reconcile.Outcome | None:
        """None when this pod does not lead (another one reconciles)."""
        if not self.cluster.may_write():
            return None
        async with self.locks[namespace, name]:
            outcome = await reconcile.reconcile(self.cluster, self.settings, namespace, name)
        self.on_outcome(outcome)
        return outcome

    async def _exists(self, namespace: str, name: str) -> bool:
        """Whether the service is there and not being deleted, as the API says now (unknown, in
        an outage: there, and the next pass looks again)."""
        try:
            body = await self.cluster.get(crd.KIND, namespace, name, fresh=True)
        except Retryable:
            return True
        return body is not None and not body["metadata"].get("deletionTimestamp")

    async def _run(self, namespace: str, name: str) -> None:
        try:
            await self._loop(namespace, name)
        finally:  # a marker in the log (the tests wait for it: nothing acts on the service after)
            self.decisions.forget((namespace, name))
            log.debug("%s/%s: loop ended", namespace, name)

    async def _loop(self, namespace: str, name: str) -> None:
        loop = asyncio.get_running_loop()
        kick = self.kicks[namespace, name]
        history = autoscale.History()
        next_resync = next_scale = loop.time()
        last_measured = -status.MEASURED_REFRESH_S
        failures = 0  # failed passes in a row: each waits longer (retry_in), kicks included

        def backoff(retry_after: float | None = None) -> float:
            nonlocal failures, next_resync, next_scale
            failures += 1
            wait = retry_in(failures, self.settings.retry_seconds, self.settings.resync_seconds)
            wait = max(retry_after or 0.0, wait * random.uniform(0.8, 1.0))  # a 429's Retry-After, if longer
            next_resync = next_scale = loop.time() + wait
            return wait

        async with Reader() as reader:
            while True:
                delay = max(0.0, min(next_resync, next_scale) - loop.time())
                if failures:  # backing off: nothing for this service before then, watch events included
                    await asyncio.sleep(delay)
                else:
                    try:
                        await asyncio.wait_for(kick.wait(), delay)
                    except TimeoutError:
                        pass
                try:
                    if not self.cluster.may_write():
                        # The lease lapsed (a renewal that timed out): this pod acts again once it
                        # renews, or its loops are closed when another pod takes the lease.
                        kick.clear()
                        next_resync = next_scale = loop.time() + self.settings.retry_seconds
                        continue
                    if kick.is_set() or loop.time() >= next_resync:
                        kick.clear()
                        next_resync = loop.time() + self.settings.resync_seconds
                        outcome = await self.reconcile(namespace, name)
                        if outcome is not None and outcome.gone:
                            return
                        log.debug("%s/%s: periodic check done", namespace, name)
                    if loop.time() >= next_scale:
                        next_scale = loop.time() + self.settings.retry_seconds  # unless the step says otherwise
                        due = loop.time() - last_measured >= status.MEASURED_REFRESH_S
                        async with self.locks[namespace, name]:
                            step = await autoscaler.step(self.cluster, self.settings, reader, namespace, name,
                                                         history, loop.time(), measured_due=due, decisions=self.decisions)
                        if step.body is None or step.body["metadata"].get("deletionTimestamp"):
                            return
                        if due and step.decision is not None:
                            last_measured = loop.time()
                        interval = specs.defaulted(step.body.get("spec") or {})["autoscaling"]["intervalSeconds"]
                        next_scale = loop.time() + interval
                        # Not autoscaled now (no decision): start afresh if it is again.
                        history = step.history if step.decision is not None else autoscale.History()
                        if step.decision is not None:
                            self.on_decision(step.body, step)
                    failures = 0
                except NotFound as e:
                    # The service went while a step ran, or an object it owns did (a Deployment
                    # deleted since its copy was read answers 404 to its scale subresource): only
                    # the first ends the loop; the next pass re-reads and re-creates the second.
                    if not await self._exists(namespace, name):
                        return
                    log.warning("%s/%s: %s; again in %.1f s", namespace, name, e, backoff())
                except NotLeader:  # the lease lapsed mid-step: see above
                    next_resync = next_scale = loop.time() + self.settings.retry_seconds
                except Retryable as e:  # a 429 (API Priority and Fairness) says how long at least
                    log.warning("%s/%s: %s; again in %.1f s", namespace, name, e, backoff(e.retry_after))
                except Exception:  # noqa: BLE001 - a bug must not end the service's loop for good
                    log.exception("%s/%s: loop step failed; again in %.1f s", namespace, name, backoff())
