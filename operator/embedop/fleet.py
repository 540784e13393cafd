"""One background task per EmbeddingService: the periodic reconcile (drift, status) and, in mode
operator, the autoscaler's steps.

Deliberately not kopf timers or daemons: kopf puts a finalizer on every object that has one, and a
finalizer outlives the operator (after `helm uninstall` the services hang in Terminating, their
GPU pods run on, and deleting the namespace hangs). Without one, deleting a service never waits for
the operator: the garbage collector removes what it owned, through the ownerReferences."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Callable

import aiohttp

from embedop import autoscale, autoscaler, reconcile, spec as specs
from embedop.config import OperatorSettings
from embedop.kube import Kube, NotFound, Retryable

log = logging.getLogger(__name__)
RETRY_S = 5.0


class Fleet:
    def __init__(self, kube: Kube, settings: OperatorSettings,
                 on_outcome: Callable[[reconcile.Outcome], None],
                 on_decision: Callable[[dict, autoscaler.Step], None]):
        self.kube, self.settings = kube, settings
        self.on_outcome, self.on_decision = on_outcome, on_decision
        self.tasks: dict[tuple[str, str], asyncio.Task] = {}
        # One write sequence per service at a time within this process (handlers, loop, autoscaler);
        # across processes the resourceVersion guards keep them correct.
        self.locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)

    def ensure(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if key not in self.tasks or self.tasks[key].done():
            self.tasks[key] = asyncio.create_task(self._run(namespace, name), name=f"embedop:{namespace}/{name}")

    def stop(self, namespace: str, name: str) -> None:
        task = self.tasks.pop((namespace, name), None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def reconcile(self, namespace: str, name: str) -> reconcile.Outcome:
        async with self.locks[namespace, name]:
            outcome = await reconcile.reconcile(self.kube, self.settings, namespace, name)
        self.on_outcome(outcome)
        return outcome

    async def _run(self, namespace: str, name: str) -> None:
        try:
            await self._loop(namespace, name)
        finally:  # a marker in the log (the tests wait for it: nothing acts on the service after)
            log.debug("%s/%s: loop ended", namespace, name)

    async def _loop(self, namespace: str, name: str) -> None:
        loop = asyncio.get_running_loop()
        history = autoscale.History()
        # The handler that started the loop has just reconciled; the autoscaler's first step (which
        # records desiredReplicas) comes at once.
        next_resync, next_scale = loop.time() + self.settings.resync_seconds, loop.time()
        async with aiohttp.ClientSession() as session:
            while True:
                await asyncio.sleep(max(0.0, min(next_resync, next_scale) - loop.time()))
                try:
                    if loop.time() >= next_resync:
                        next_resync = loop.time() + self.settings.resync_seconds
                        if (await self.reconcile(namespace, name)).gone:
                            return
                        log.debug("%s/%s: periodic check done", namespace, name)
                    if loop.time() >= next_scale:
                        next_scale = loop.time() + RETRY_S  # unless the step says otherwise
                        async with self.locks[namespace, name]:
                            step = await autoscaler.step(self.kube, self.settings, session, namespace, name,
                                                         history, loop.time())
                        if step.body is None or step.body["metadata"].get("deletionTimestamp"):
                            return
                        interval = specs.defaulted(step.body.get("spec") or {})["autoscaling"]["intervalSeconds"]
                        next_scale = loop.time() + interval
                        # Not autoscaled now (no decision): start afresh if it is again.
                        history = step.history if step.decision is not None else autoscale.History()
                        if step.decision is not None:
                            self.on_decision(step.body, step)
                except NotFound:  # the service went while a step ran
                    return
                except Retryable as e:
                    log.warning("%s/%s: %s; again in %.0f s", namespace, name, e, RETRY_S)
                    next_resync = min(next_resync, loop.time() + RETRY_S)
                except Exception:  # noqa: BLE001 - a bug must not end the service's loop for good
                    log.exception("%s/%s: loop step failed", namespace, name)
