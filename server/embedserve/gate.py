"""The door every request passes before any work is spent on it: count the offer once, let a
booked retry in, ask admission (pure, admission.py), and for what does not fit now, book the
moment it will and either hold the caller until then (a caller that said it waits) or refuse it
with that moment (RESOURCE_EXHAUSTED / 429 + retry-after). Runs on the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Callable, Protocol

from embedserve import admission
from embedserve.errors import Overloaded
from embedserve.estimator import Estimator
from embedserve.reservations import ReservationBook


@dataclasses.dataclass(frozen=True)
class Caller:
    """What the transport knows of the caller."""

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
        identifies the request's content: a retry finds the room booked for it by that."""
        if not caller.retry:  # a retry is the same demand again, not new demand
            self.estimator.offered(cost)
        now = self.estimator.clock()
        if self.book.claim(key, now):
            return  # its booked moment has come: the room was kept for it
        if caller.retry and (early := self.book.due_in(key, now)) is not None:
            self._refuse("drain_time", early)  # back before its moment: its booking stands
        decision = admission.decide(self.estimator.snapshot(), cost, self.policy, self.draw(), self.book.reserved_tokens)
        if decision.admit:
            return
        wait_s = decision.retry_after_ms / 1000
        if decision.book:
            done_s = wait_s + self.policy.max_drain_s  # admitted then, computed within the budget
            if caller.deadline_s is not None and caller.deadline_s < done_s:
                self._refuse(decision.reason, done_s)  # gone by then: book nothing, say when it could be done
            booking = self.book.book(key, cost, now, wait_s)
            if caller.waits:
                await self._hold(booking, wait_s)
                return
        self._refuse(decision.reason, wait_s)

    async def _hold(self, booking, wait_s: float) -> None:
        """The caller waits here for its booked moment instead of coming back: no round trip, and
        its retry cannot land on another pod, where nothing is booked for it."""
        self.observer.held()
        try:
            await asyncio.sleep(wait_s)
        except asyncio.CancelledError:  # the caller went away: its room goes to others
            self.book.cancel(booking)
            raise
        self.book.take(booking)

    def _refuse(self, reason: str, wait_s: float) -> None:
        self.last_rejection = self.estimator.clock()
        self.observer.rejected(reason)
        raise Overloaded(reason, max(1, math.ceil(wait_s * 1000)))
