"""The door every request passes before any work is spent on it: count the offer once, let a
booked retry in, ask admission (pure, policy.py), and for what does not fit now, book the
moment it will and either hold the caller until then (a caller that said it waits) or refuse it
with that moment (RESOURCE_EXHAUSTED / 429 + retry-after); under sustained overload, refuse it
as final (policy.still_sustained). Runs on the event loop."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from typing import Callable, NamedTuple, Protocol

from embedserve.admission.policy import Policy, decide, still_sustained, uniform
from embedserve.errors import Overloaded
from embedserve.admission.estimator import Estimator
from embedserve.admission.reservations import ReservationBook


class Caller(NamedTuple):
    """What the transport knows of the caller (a tuple: one per request)."""

    retry: bool = False  # the request was refused before: not new demand
    deadline_s: float | None = None  # how long the caller still waits (gRPC deadline)
    waits: bool = False  # it asked to wait server-side for booked room (metadata embedfleet-queue: wait)
    # A traced request's stamps (embedserve.tracing.Recorder): each stage it passes stamps them.
    # None when tracing is off or the request is not sampled: nothing is stamped.
    trace: object = None
    # A hedge: a second try of a request a client already sent to another pod (metadata / header
    # embedfleet-hedge: 1). Duplicate demand, counted where the first try went: not new demand.
    hedge: bool = False


class Observer(Protocol):
    def rejected(self, reason: str) -> None: ...

    def held(self) -> None: ...


class Gate:
    def __init__(self, estimator: Estimator, policy: Policy, observer: Observer,
                 draw: Callable[[], float] = uniform):
        self.estimator, self.policy, self.observer, self.draw = estimator, policy, observer, draw
        self.book = ReservationBook()
        self.last_rejection = -math.inf
        self._held: list[tuple[float, int, float, asyncio.Future]] = []  # (moment, seq, tokens, wake), a heap
        self._seq = itertools.count()
        self._joining = 0.0  # tokens of callers woken by release_held that have not resumed yet
        self._sustained = False  # still_sustained (policy.py)
        self._over_since: float | None = None  # since when new demand has exceeded the service rate

    def sustained(self, snap) -> bool:
        """Sustained overload now (for /health): refused without booking."""
        return still_sustained(snap.arrival_rate, snap.capacity_rate, self._sustained)

    async def admit(self, key: int, cost: float, caller: Caller) -> None:
        """Return once the request may join the queue; raise Overloaded if it may not. `key`
        identifies the request's content: a retry finds the moment booked for it by that.

        At its booked moment a marked retry (or a held caller) joins the queue as promised; room
        nobody claims never idles the device, since a new request is judged on the present queue
        alone. An unmarked request with the same texts is another caller: new demand, no claim."""
        # A retry, or a hedge, is the same demand again, not new demand.
        demand_before = None if caller.retry or caller.hedge else self.estimator.offered(cost)
        now = self.estimator.clock()
        # A marked retry whose moment has come is first in line; an unmarked request with the same
        # texts is another caller, and new demand.
        if caller.retry and self.book.claim(key, now):
            if caller.trace is not None:
                caller.trace.decision = "claimed"
            return
        if caller.retry and (early := self.book.due_in(key, now)) is not None:
            self._refuse("drain_time", early)  # back before its moment: its booking stands
        snap = self.estimator.snapshot(latency=self.policy.latency)
        if demand_before is not None:
            self._follow_demand(demand_before, snap.capacity_rate, now)  # beside other models' demand
        over_for = 0.0 if self._over_since is None else now - self._over_since
        # Bookings past their grace leave before they count: nothing else may read the book for
        # hours (probes over gRPC), and dead ones inflated every refusal's moment.
        reserved = self.book.reserved(now)
        decision = decide(snap, cost, self.policy, self.draw(), reserved, self._sustained, over_for)
        self._sustained = self._sustained or decision.final
        if decision.admit:
            return
        wait_s = decision.retry_after_ms / 1000
        if not decision.book:
            self._refuse(decision.reason, wait_s, decision.final)
        # Admitted then, behind less than the budget, then its own work.
        done_s = wait_s + self.policy.max_drain_s + cost / max(snap.service_rate, 1e-9)
        if caller.deadline_s is not None and caller.deadline_s < done_s:
            self._refuse(decision.reason, done_s)  # gone by then: book nothing, say when it could be done
        booking = self.book.book(key, cost, now, wait_s)
        if caller.trace is not None:
            caller.trace.booked_ms = wait_s * 1000
        if not caller.waits:
            self._refuse(decision.reason, wait_s)
        self.observer.held()
        if caller.trace is not None:
            caller.trace.decision = "held"
        await self._hold(booking, wait_s)  # then in, as a retry on time would be

    def _follow_demand(self, arrival_rate: float, service_rate: float, now: float) -> None:
        """At each new request, with the arrival rate read just before it: since when demand has
        exceeded capacity without a break, and whether a sustained overload has ended."""
        self._sustained = still_sustained(arrival_rate, service_rate, self._sustained)
        if arrival_rate < service_rate:
            self._over_since = None
        elif self._over_since is None:
            self._over_since = now

    async def _hold(self, booking, wait_s: float) -> None:
        """The caller waits here for its booked moment instead of coming back: no round trip, and
        its retry cannot land on another pod, where nothing is booked for it. It joins earlier if
        the queue has room first (release_held)."""
        wake = asyncio.get_running_loop().create_future()
        heapq.heappush(self._held, (booking.at, next(self._seq), booking.tokens, wake))
        timer = asyncio.get_running_loop().call_later(wait_s, _wake, wake)
        try:
            await wake
        finally:  # its moment, or the caller went away: either way the booking is done
            timer.cancel()
            _wake(wake)  # so release_held skips it
            # Woken early, it was counted as joining; from here to its enqueue nothing yields.
            self._joining -= 0.0 if wake.cancelled() else wake.result() or 0.0
            self.book.take(booking)

    def release_held(self) -> None:
        """After a batch: held callers join now, earliest moment first, while the queue is under
        the limit. Their moment was computed behind every booking then standing, and bookings
        whose owners never come back (clients that gave up) expire only later: without this,
        callers held for them would wait while the device idles."""
        while self._held and self._held[0][3].done():  # joined at its moment, or gone
            heapq.heappop(self._held)
        if not self._held:
            return
        snap = self.estimator.snapshot(latency=False)
        # Callers woken by an earlier batch resume on a later loop turn: their tokens are not
        # queued yet, but the room is theirs.
        room = self.policy.backlog_limit_s * snap.service_rate - snap.backlog_tokens - self._joining
        while self._held and room > 0:
            _, _, tokens, wake = heapq.heappop(self._held)
            if not wake.done():
                wake.set_result(tokens)
                self._joining += tokens
                room -= tokens

    def release_all(self) -> None:
        """The engine will compute nothing more (lost for good): every held caller resumes now and
        meets its refusal (UNAVAILABLE: another pod serves it) instead of waiting, up to the
        reservation horizon, for a moment no batch will bring (release_held runs after batches)."""
        while self._held:
            _wake(heapq.heappop(self._held)[3])

    def _refuse(self, reason: str, wait_s: float, final: bool = False) -> None:
        self.last_rejection = self.estimator.clock()
        self.observer.rejected(reason)
        raise Overloaded(reason, max(1, math.ceil(wait_s * 1000)), final)


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
