"""Admission control: pure decisions on an estimator snapshot.

Throughput strategy (predictive): a request joins the queue at once when the backlog ahead of it
computes within MAX_DRAIN_TIME_MS less the batcher's reorder window at the measured service rate,
so accepted latency stays bounded by the budget plus the request's own work. A request that finds
no room is not dropped but scheduled: it is told when there will be (`retry_after_ms`) and its
tokens are booked for its retry (reservations.py), provided
the moment lies within RESERVATION_HORIZON_MS. Beyond it, the overload is more than booking can
absorb (a flood cannot book the future): the request is refused and told not to come back soon,
and so is every request that finds no room, booking nothing, until the arrival rate falls below
the service rate (`sustained`). Booking turns a burst into a short wait; under sustained overload
it would only turn the excess into a queue as deep as the horizon, served ones waiting that long. Latency strategy (reactive): shed 25% of requests while the
windowed P95 is above LATENCY_SOFT_MS, all above LATENCY_HARD_MS; the window is time-based, so
it empties and admission resumes by itself.

Every quantity is in real tokens, as the estimator's.
"""

from __future__ import annotations

import dataclasses
import math
import random

from embedserve.estimator import Snapshot

SOFT_SHED_FRACTION = 0.25
DEGRADED_AT = 0.8  # fraction of a threshold at which health reports "degraded"


@dataclasses.dataclass(frozen=True)
class Policy:
    throughput: bool
    latency: bool
    max_drain_s: float
    latency_soft_s: float
    latency_hard_s: float
    # The batcher's reorder window (batching.reorder_window): rows admitted up to this much
    # after a row may run before it, so that much time is held back from the drain budget and
    # accepted requests finish within MAX_DRAIN_TIME_MS plus their own batch.
    reorder_s: float = 0.0
    horizon_s: float = 10.0  # furthest future a refused request may book (RESERVATION_HORIZON_MS)

    @property
    def backlog_limit_s(self) -> float:
        """The backlog, in seconds of model time, a request may join at once."""
        return self.max_drain_s - self.reorder_s


@dataclasses.dataclass(frozen=True)
class Decision:
    admit: bool
    reason: str = ""  # drain_time | sustained | latency_soft | latency_hard
    retry_after_ms: int | None = 0  # None: do not retry soon (sustained overload)
    book: bool = False  # keep room for the retry at retry_after_ms


ADMIT = Decision(True)


def sustained(snap: Snapshot, was: bool, decision: Decision | None = None) -> bool:
    """Whether overload is sustained after `decision`: it becomes so when a request finds the
    horizon full, and stays so while new demand arrives faster than the device serves it (the
    shared arrival/service signal), so a lull between refusals does not start booking again."""
    return (was and snap.arrival_rate >= snap.service_rate) or (decision is not None and decision.reason == "sustained")


def decide(snap: Snapshot, cost_tokens: float, policy: Policy, draw: float, reserved_tokens: float = 0.0,
           overload_sustained: bool = False) -> Decision:
    """Admit, schedule or refuse a request of `cost_tokens` real tokens (its size decides
    nothing here, by design: see below; the gate books it). `reserved_tokens` are
    booked for earlier refused requests' retries: they wait ahead of this one. `draw` is uniform
    in [0, 1) (injected so tests control the soft-shedding lottery). `overload_sustained`: see
    `sustained`."""
    if policy.throughput and snap.queued_tokens > 0:
        # An empty queue always admits: otherwise one request larger than the drain budget
        # could never be served at all.
        rate = snap.service_rate
        if rate <= 0:
            return Decision(False, "drain_time", _ms(policy.max_drain_s))
        room = policy.backlog_limit_s * rate
        if snap.queued_tokens >= room:
            # Size-neutral: a request joins while the work *ahead of it* is within the limit,
            # whatever its own size. Asking that its own tokens fit too refused long requests
            # almost always under overload (the queue hovers at the limit and every short one
            # slips into the room a batch frees): the accepted mix halved its tokens per request
            # and long texts starved. Each accepted request still waits behind less than the
            # limit; the queue overshoots it by at most one request's tokens.
            # Admission is work-conserving: the present queue alone decides, so booked room that
            # its owner never claims cannot idle the device. This request's moment is when the
            # queue and everything booked before it have drained below the limit.
            wait_s = (snap.queued_tokens + reserved_tokens - room) / rate
            if wait_s <= policy.horizon_s and not overload_sustained:
                return Decision(False, "drain_time", _ms(wait_s), book=True)
            if policy.horizon_s <= 0:  # booking off: told when there will be room, nothing more
                return Decision(False, "drain_time", _ms(wait_s))
            # The horizon is full: more excess than booking absorbs. A retry would find the same,
            # and each costs the host a refusal: fail now, and let the fleet scale.
            return Decision(False, "sustained", None)
    if policy.latency and snap.p95_latency_s > policy.latency_hard_s:
        return Decision(False, "latency_hard", _ms(max(snap.drain_s, policy.latency_soft_s)))
    if policy.latency and snap.p95_latency_s > policy.latency_soft_s and draw < SOFT_SHED_FRACTION:
        return Decision(False, "latency_soft", _ms(max(snap.drain_s, policy.latency_soft_s / 4)))
    return ADMIT


def status(snap: Snapshot, policy: Policy, ready: bool, rejecting: bool) -> str:
    """starting → healthy → degraded (near a threshold) → overloaded (rejecting now)."""
    if not ready:
        return "starting"
    if rejecting:
        return "overloaded"
    near_drain = policy.throughput and snap.drain_s > DEGRADED_AT * policy.backlog_limit_s
    near_latency = policy.latency and snap.p95_latency_s > DEGRADED_AT * policy.latency_soft_s
    return "degraded" if near_drain or near_latency else "healthy"


def _ms(seconds: float) -> int:
    return max(1, int(math.ceil(seconds * 1000)))


def uniform() -> float:
    return random.random()
