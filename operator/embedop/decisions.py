"""What the operator decided for each mode-keda service, for KEDA to read (embedop.scaler): the
replica count (mode operator's decision, autoscale.decide, taken by the same autoscaling step) and
whether the service has had demand within its idle window (autoscaling.idleSeconds). Written by
that step on the leader, read by the scaler's RPCs, on the operator's one event loop (no locks).
Emptied when this pod stops leading: a follower has no decision to give.

A service's first decision counts as demand when it has pods: an operator that just started (or
a new leader) has not seen the service's past, and must not take a serving fleet to zero before
an idle window has passed under its own eyes. At zero it starts idle: counted as demand there, a
restart or a leader change would wake every service at zero."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import AsyncIterator

Key = tuple[str, str]  # (namespace, name): the ScaledObject's, which is named as its service


@dataclasses.dataclass(frozen=True)
class Published:
    count: int  # the decided replica count
    active: bool  # demand within the idle window
    at: float  # when it was decided (monotonic)


class Decisions:
    def __init__(self):
        self._published: dict[Key, Published] = {}
        self._last_demand: dict[Key, float] = {}
        self._changed: dict[Key, asyncio.Event] = {}  # set when a key's `active` flips (StreamIsActive)

    def publish(self, key: Key, count: int, demanded: bool, idle_s: float, now: float, running: bool = True) -> Published:
        """A decision: `count` replicas; `demanded`: the service had demand at this step;
        `running`: it has pods (its Deployment's count is above 0)."""
        if demanded or (key not in self._last_demand and running):
            self._last_demand[key] = now
        elif key not in self._last_demand:
            self._last_demand[key] = -math.inf
        published = Published(count, now - self._last_demand[key] < idle_s, now)
        before = self._published.get(key)
        self._published[key] = published
        if before is None or before.active != published.active:
            self._flip(key)
        return published

    def get(self, key: Key) -> Published | None:
        return self._published.get(key)

    def forget(self, key: Key) -> None:
        """The service left mode keda, or went."""
        self._published.pop(key, None)
        self._last_demand.pop(key, None)
        self._flip(key)

    def clear(self) -> None:
        """This pod no longer leads: every stream ends (its connection closes with the server)."""
        keys = list(self._published)
        self._published.clear()
        self._last_demand.clear()
        for key in keys:
            self._flip(key)

    def _flip(self, key: Key) -> None:
        event = self._changed.pop(key, None)
        if event is not None:
            event.set()

    async def activity(self, key: Key) -> AsyncIterator[bool | None]:
        """The key's `active` now, then each time it flips (None: no decision, or none any more)."""
        while True:
            event = self._changed.setdefault(key, asyncio.Event())
            published = self._published.get(key)
            yield None if published is None else published.active
            await event.wait()
