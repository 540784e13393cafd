"""Admission control: pure decisions on an estimator snapshot.

Throughput strategy (predictive): refuse a request when admitting it would make the backlog take
longer than MAX_DRAIN_TIME_MS to compute at the measured service rate, so latency never gets the
chance to climb. Latency strategy (reactive): shed 25% of requests while the windowed P95 is
above LATENCY_SOFT_MS, all above LATENCY_HARD_MS; the window is time-based, so it empties and
admission resumes by itself.
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
    # Padded tokens of the largest batch the batcher forms. A batch takes a bucket's rows
    # together, so a row can be overtaken by one batch of rows admitted after it: that much
    # is held back from the drain budget, so accepted requests finish within MAX_DRAIN_TIME_MS.
    reorder_tokens: float = 0.0


@dataclasses.dataclass(frozen=True)
class Decision:
    admit: bool
    reason: str = ""  # drain_time | latency_soft | latency_hard
    retry_after_ms: int = 0


ADMIT = Decision(True)


def decide(snap: Snapshot, cost_tokens: float, policy: Policy, draw: float) -> Decision:
    """Admit or refuse a request costing `cost_tokens` padded tokens. `draw` is uniform in
    [0, 1) (injected so tests control the soft-shedding lottery)."""
    if policy.throughput and snap.queued_tokens > 0:
        # An empty queue always admits: otherwise one request larger than the drain budget
        # could never be served at all.
        rate = snap.service_rate
        # Never hold back more than half the budget: with batches that long (a slow device, a
        # tiny budget) the bound cannot hold anyway, and admission must not degenerate into
        # "only when idle".
        reorder = min(policy.reorder_tokens, 0.5 * policy.max_drain_s * rate)
        after = snap.queued_tokens + cost_tokens + reorder
        if rate <= 0 or after / rate > policy.max_drain_s:
            if rate <= 0:
                return Decision(False, "drain_time", _ms(policy.max_drain_s))
            # Come back when today's backlog is gone, not the moment one request fits: refused
            # clients then return spread over a drain period instead of all at once, and a busy
            # server does not spend its CPU refusing the same requests again and again.
            excess_s = (after - policy.max_drain_s * rate) / rate
            return Decision(False, "drain_time", _ms(max(excess_s, snap.drain_s)))
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
    near_drain = policy.throughput and snap.drain_s > DEGRADED_AT * policy.max_drain_s
    near_latency = policy.latency and snap.p95_latency_s > DEGRADED_AT * policy.latency_soft_s
    return "degraded" if near_drain or near_latency else "healthy"


def _ms(seconds: float) -> int:
    return max(1, int(math.ceil(seconds * 1000)))


def uniform() -> float:
    return random.random()
