"""Admission control: pure decisions on an estimator snapshot.

Throughput strategy (predictive): a request joins the queue at once when the backlog ahead of it
computes within MAX_DRAIN_TIME_MS less the batcher's reorder window at the measured service rate,
so accepted latency stays bounded by the budget plus the request's own work. A request that finds
no room is not dropped but scheduled: it is told when there will be (`retry_after_ms`) and its
tokens are booked for its retry (reservations.py), provided the moment lies within
RESERVATION_HORIZON_MS (a flood cannot book the future); past it, it is told when booking will
be possible again. Booking turns a burst into a short wait. Under *sustained* overload it would
only turn the excess into a queue as deep as the horizon, every served call waiting that long:
so once the horizon is full and new demand has exceeded capacity for a whole horizon, every
request that finds no room is refused as `sustained`, books nothing and is told not to retry,
until demand falls clearly below capacity (`still_sustained`).

Latency strategy (reactive): shed 25% of requests while the windowed P95 is above
LATENCY_SOFT_MS, all above LATENCY_HARD_MS; the window is time-based, so it empties and
admission resumes by itself.

Every quantity is in real tokens, as the estimator's.
"""

from __future__ import annotations

import dataclasses
import math
import random

from embedserve.admission.estimator import Snapshot

SOFT_SHED_FRACTION = 0.25
# Sustained overload ends when new demand falls below this fraction of the service rate: both are
# averages that wander by a few percent, and ending on a dip would start booking again at once.
SUSTAINED_EXIT = 0.9
DEGRADED_AT = 0.8  # fraction of a threshold at which health reports "degraded"


@dataclasses.dataclass(frozen=True)
class Policy:
    throughput: bool
    latency: bool
    max_drain_s: float
    latency_soft_s: float
    latency_hard_s: float
    # The batcher's reorder window (batching.decisions.reorder_window): rows admitted up to this much
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
    retry_after_ms: int = 0
    book: bool = False  # keep room for the retry at retry_after_ms
    final: bool = False  # do not retry soon: sustained overload (retry_after_ms is a back-off)


ADMIT = Decision(True)


def still_sustained(arrival_rate: float, service_rate: float, was: bool) -> bool:
    """A sustained overload lasts while new demand (the shared arrival/service signal) has not
    fallen clearly below capacity: a lull between refusals does not start booking again."""
    return was and arrival_rate >= SUSTAINED_EXIT * service_rate


def decide(snap: Snapshot, cost_tokens: float, policy: Policy, draw: float, reserved_tokens: float = 0.0,
           sustained: bool = False, over_for_s: float = 0.0) -> Decision:
    """Admit, schedule or refuse a request of `cost_tokens` real tokens (its size decides
    nothing here, by design: see below; the gate books it). `reserved_tokens` are
    booked for earlier refused requests' retries: they wait ahead of this one. `draw` is uniform
    in [0, 1) (injected so tests control the soft-shedding lottery). `sustained`: the overload
    is (still_sustained); `over_for_s`: how long new demand has exceeded the service rate."""
    backlog = snap.backlog_tokens  # with several models on the device, theirs too (in this model's tokens)
    if policy.throughput and backlog > 0:
        # An empty queue always admits: otherwise one request larger than the drain budget
        # could never be served at all.
        rate = snap.service_rate
        if rate <= 0:
            return Decision(False, "drain_time", _ms(policy.max_drain_s))
        room = policy.backlog_limit_s * rate
        if backlog >= room:
            # Size-neutral: a request joins while the work *ahead of it* is within the limit,
            # whatever its own size. Asking that its own tokens fit too refused long requests
            # almost always under overload (the queue hovers at the limit and every short one
            # slips into the room a batch frees): the accepted mix halved its tokens per request
            # and long texts starved. Each accepted request still waits behind less than the
            # limit; the queue overshoots it by at most one request's tokens.
            # Admission is work-conserving: the present queue alone decides, so booked room that
            # its owner never claims cannot idle the device. This request's moment is when the
            # queue and everything booked before it have drained below the limit.
            wait_s = (backlog + reserved_tokens - room) / rate
            if wait_s <= policy.horizon_s and not sustained:
                return Decision(False, "drain_time", _ms(wait_s), book=True)
            if policy.horizon_s <= 0:  # booking off: told when there will be room, nothing more
                return Decision(False, "drain_time", _ms(wait_s))
            if sustained or over_for_s >= policy.horizon_s:
                # The horizon is full and demand has outrun capacity for as long: not a burst.
                # A retry would find the same, and each costs the host a refusal: fail now (the
                # fleet scales on the same signal); the back-off is for clients that retry anyway.
                return Decision(False, "sustained", _ms(policy.horizon_s), final=True)
            # A burst past the horizon: back when booking is possible again.
            return Decision(False, "drain_time", _ms(wait_s - policy.horizon_s))
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
