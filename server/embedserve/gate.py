"""The door every request passes before any work is spent on it: count the offer once, let a
booked retry in, ask admission (pure, admission.py), and for what does not fit now, book the
moment it will and either hold the caller until then (a caller that said it waits) or refuse it
with that moment (RESOURCE_EXHAUSTED / 429 + retry-after). Runs on the event loop."""

from __future__ import annotations

import asyncio
import math
from typing import Callable, NamedTuple, Protocol

from embedserve import admission
from embedserve.errors import Overloaded
from embedserve.estimator import Estimator
from embedserve.reservations import ReservationBook


class Caller(NamedTuple):
    """What the transport knows of the caller (a tuple: one per request)."""

    retry: bool = False  # the request was refused before: not new demand
    deadline_s: float | None = None  # how long the caller still waits (gRPC deadline)
    waits: bool = False  # it asked to wait server-side for booked room (metadata embedfleet-queue: wait)


class Observer(Protocol):
    def rejected(self, reason: str) -> None: ...

    def held(self) -> None: ...


class Gate:
    def __init__(self, estimator: Estimator, policy: admission.Policy, observer: Observer,
                 draw: Callable[[], float] = admission.uniform):
        self.estimator, self.policy, self.observer, self.draw = estimator, policy, observer, draw
        self.book = ReservationBook()
        self.last_rejection = -math.inf

    async def admit(self, key: int, cost: float, caller: Caller) -> None:
        """Return once the request may join the queue; raise Overloaded if it may not. `key`
        identifies the request's content: a retry finds the moment booked for it by that.

        At its booked moment a marked retry (or a held caller) joins the queue as promised; room
        nobody claims never idles the device, since a new request is judged on the present queue
        alone. An unmarked request with the same texts is another caller: new demand, no claim."""
        if not caller.retry:  # a retry is the same demand again, not new demand
            self.estimator.offered(cost)
        now = self.estimator.clock()
        # A marked retry whose moment has come is first in line; an unmarked request with the same
        # texts is another caller, and new demand.
        if caller.retry and self.book.claim(key, now):
            return
        if caller.retry and (early := self.book.due_in(key, now)) is not None:
            self._refuse("drain_time", early)  # back before its moment: its booking stands
        snap = self.estimator.snapshot(latency=self.policy.latency)
        decision = admission.decide(snap, cost, self.policy, self.draw(), self.book.reserved_tokens)
        if decision.admit:
            return
        wait_s = decision.retry_after_ms / 1000
        if not decision.book:
            self._refuse(decision.reason, wait_s)
        done_s = wait_s + self.policy.max_drain_s  # admitted then, computed within the budget
        if caller.deadline_s is not None and caller.deadline_s < done_s:
            self._refuse(decision.reason, done_s)  # gone by then: book nothing, say when it could be done
        booking = self.book.book(key, cost, now, wait_s)
        if not caller.waits:
            self._refuse(decision.reason, wait_s)
        self.observer.held()
        await self._hold(booking, wait_s)  # then in, as a retry on time would be

    async def _hold(self, booking, wait_s: float) -> None:
        """The caller waits here for its booked moment instead of coming back: no round trip, and
        its retry cannot land on another pod, where nothing is booked for it."""
        try:
            await asyncio.sleep(wait_s)
        finally:  # its moment, or the caller went away: either way the booking is done
            self.book.take(booking)

    def _refuse(self, reason: str, wait_s: float) -> None:
        self.last_rejection = self.estimator.clock()
        self.observer.rejected(reason)
        raise Overloaded(reason, max(1, math.ceil(wait_s * 1000)))
