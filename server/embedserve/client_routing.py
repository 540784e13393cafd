"""The Client's routing decisions (least-drain, embedserve.client), as pure functions of what it
knows of each pod: the last `embedfleet-drain-ms` a pod answered with (every answer carries it,
refusals included: milliseconds of model time queued ahead there), how long ago, how many of
this client's calls are on their way there now and since when the oldest of them has waited, and
how long this client's answered calls there took.

- `pick`: the better of two pods drawn at random ("power of two choices": near the best pod's
  latency without every client herding onto the one pod that looked best a moment ago); round
  robin while no pod's estimate is known yet.
- `aged_drain_ms`: an estimate fades as it ages (halved every AGE_HALF_LIFE_S, forgotten after
  FORGET_S): a pod the client stopped sending to because it was slow is tried again, and its
  next answer says whether it still is.
- `load_ms`: what a pod counts as when picking: its aged estimate, except that while this client
  has calls unanswered there it does not fade, and it is at least the wait of the oldest of them
  (peak-EWMA's idea: what the client sees counts). A pod that stopped answering (frozen, a
  partition) thus looks slower every millisecond instead of idle.
- `hedge_delay_s`: when a try that has not answered is sent once more to another pod: after
  the pod's queue (its estimate) and what this client's calls there usually take (`latency`,
  smoothed as TCP smooths round trips), so that a request that is simply big is not "late".
- `RetryBudget`, `budget_for`: the retries that multiply load (embedserve.client.spends_budget)
  and hedges stay a small share of successful calls, so that a fleet that is slow or refusing
  everywhere is not sent twice its load: modelled on gRPC's retry throttling (gRFC A6), one
  budget per target for every Client of the process.
"""

from __future__ import annotations

import math
import os
import random
import threading
import weakref
from typing import Hashable, NamedTuple, Sequence

AGE_HALF_LIFE_S = 1.0  # an estimate counts half after this long without news from its pod
FORGET_S = 5.0  # and not at all after this: the pod is "unknown", as if new
TIE_MS = 5.0  # drains closer than this (or than TIE_SHARE of the larger) are equal: in-flight decides
TIE_SHARE = 0.2
HEDGE_FACTOR = 2.0  # a try is late when it outlives its pod's drain twice over ...
# ... plus what this client's calls there usually take, and never less than this (the round trip,
# a batch's wait, scheduling noise: below it a hedge mostly duplicates a call about to answer)
HEDGE_MARGIN_S = 0.25
LATENCY_GAIN, DEVIATION_GAIN = 1 / 8, 1 / 4  # RFC 6298's smoothing of round trips
HEDGE_MIN_LEFT_S = 0.1  # a hedge needs at least this much of the deadline left to be of use
# Retry throttling, modelled on gRPC's retryThrottling: every successful call earns TOKEN_RATIO,
# every charged retry or hedge spends 1, and one is allowed while the tokens are above half of
# MAX_TOKENS. In the long run charged retries and hedges are then at most a tenth of successful
# calls, with MAX_TOKENS / 2 (10) at once for a stall; when calls stop succeeding (every pod
# refusing or gone), they stop after those 10 rather than doubling the load. Not A6 itself: A6
# takes a token for every failed attempt with a retryable code (whether or not it is retried)
# and charges a hedge by its outcome; here a token is taken for a retry or hedge as it is sent,
# and the retries that multiply no load are not charged at all (a pod's drain or death, booked
# room: embedserve.client.spends_budget).
MAX_TOKENS = 20.0
TOKEN_RATIO = 0.1
UNKNOWN_MS = 1e9  # what a server sends when it has measured no service rate yet


class PodView(NamedTuple):
    """What the client knows of one pod when it picks."""

    drain_ms: float | None  # the latest estimate it answered with; None: none yet
    age_s: float  # since that answer
    in_flight: int  # this client's calls sent there and not answered yet
    waited_s: float = 0.0  # how long the oldest of them has waited (0 with none)
    usual_s: float = 0.0  # how long this client's answered calls there usually take (0: none yet)


def aged_drain_ms(drain_ms: float | None, age_s: float) -> float | None:
    """The estimate as it counts now; None once forgotten (or never heard)."""
    if drain_ms is None or age_s >= FORGET_S:
        return None
    return drain_ms * 0.5 ** (max(0.0, age_s) / AGE_HALF_LIFE_S)


def load_ms(pod: PodView) -> float | None:
    """The pod's estimate as it counts when picking; None: nothing known. It fades only while
    none of this client's calls is there: an unanswered call means news is coming, not that the
    pod was left alone. And a call of ours unanswered there for t seconds longer than calls there
    usually take says the pod is at least t behind, whatever it said last (a frozen pod said
    "idle" before it froze). Only the overdue part counts: a call a few milliseconds into its
    usual 20 says nothing of the pod (counting it cost a tenth of P50 at equal pods)."""
    drain = pod.drain_ms if pod.in_flight else aged_drain_ms(pod.drain_ms, pod.age_s)
    if not pod.in_flight:
        return drain
    overdue_ms = max(0.0, pod.waited_s - pod.usual_s) * 1000
    return overdue_ms if drain is None else max(drain, overdue_ms)


def _key(pod: PodView) -> tuple[float, float]:
    """Lower is better. A pod with nothing known counts as an idle one (0): it is tried, and answers."""
    load = load_ms(pod)
    return (0.0 if load is None else load), pod.in_flight


def better(a: PodView, b: PodView) -> int:
    """0 if `a` is the better pod, 1 if `b`: the lower drain estimate; between drains that differ
    by less than the tie (a few ms: one batch's noise), the fewer calls in flight; then `a`."""
    (da, fa), (db, fb) = _key(a), _key(b)
    if abs(da - db) > max(TIE_MS, TIE_SHARE * max(da, db)):
        return 0 if da < db else 1
    return 1 if fb < fa else 0


def pick(pods: Sequence[PodView], turn: int, rng: random.Random) -> int:
    """The index of the pod for the next try. `turn`: the client's count of picks so far (round
    robin's position while no estimate is known)."""
    if not pods:
        raise ValueError("no pod to pick from")
    if len(pods) == 1:
        return 0
    if all(load_ms(p) is None for p in pods):
        return turn % len(pods)
    i, j = rng.sample(range(len(pods)), 2)
    return (i, j)[better(pods[i], pods[j])]


def hedge_delay_s(pod: PodView, latency: tuple[float, float] | None, remaining_s: float | None) -> float | None:
    """Seconds after which a try not answered yet is sent to a second pod as well; None: no hedge
    (no deadline left for a second try to be of use, or the pod said it knows no rate yet). Late
    means: past the pod's queue twice over, plus what this client's answered calls there usually
    take (`latency`: smoothed mean and deviation, see `latency_after`; mean + 4 deviations, as
    TCP's retransmission timer), at least HEDGE_MARGIN_S — a request's own compute is in that, so
    on an idle pod a call that is merely big is not duplicated. A held call (waiting on the server for its booked
    room) is late by this measure too, and its hedge goes where there is room sooner."""
    drain = aged_drain_ms(pod.drain_ms, pod.age_s)
    if drain is not None and drain >= UNKNOWN_MS:
        return None
    usual = HEDGE_MARGIN_S if latency is None else max(HEDGE_MARGIN_S, latency[0] + 4 * latency[1])
    delay = HEDGE_FACTOR * (drain or 0.0) / 1000 + usual
    if remaining_s is not None and delay + HEDGE_MIN_LEFT_S >= remaining_s:
        return None
    return delay


def latency_after(latency: tuple[float, float] | None, sample_s: float) -> tuple[float, float]:
    """(smoothed latency, smoothed deviation) of a pod's answered calls after one more answer
    (RFC 6298: the first sample sets the mean, half of it the deviation)."""
    if latency is None:
        return sample_s, sample_s / 2
    mean, deviation = latency
    deviation += DEVIATION_GAIN * (abs(sample_s - mean) - deviation)
    return mean + LATENCY_GAIN * (sample_s - mean), deviation


class RetryBudget:
    """Retry throttling modelled on gRPC's (gRFC A6, the service config's retryThrottling; how it
    differs: MAX_TOKENS's comment): `max_tokens` in (0, 1000], full at start, `token_ratio` in
    (0, 1] earned by each successful call (`succeeded`), 1 spent by each charged retry or hedge
    (`spend`), which is allowed only while the tokens are above max_tokens / 2. Shared by every
    Client of a process for one target (`budget_for`): a Client made per request starts with
    nothing of its own, so code that makes one per call cannot hedge every late call or retry
    every refusal. Thread-safe (Clients on several event loops)."""

    def __init__(self, max_tokens: float = MAX_TOKENS, token_ratio: float = TOKEN_RATIO):
        if not 0 < max_tokens <= 1000:
            raise ValueError(f"max_tokens={max_tokens!r}: must be in (0, 1000], as gRPC's retryThrottling")
        if not 0 < token_ratio <= 1:
            raise ValueError(f"token_ratio={token_ratio!r}: must be in (0, 1], as gRPC's retryThrottling")
        self.max_tokens, self.token_ratio = float(max_tokens), float(token_ratio)
        self.tokens = self.max_tokens
        self._lock = threading.Lock()
        self._spent: set | None = None  # budget_for's: where a budget below max_tokens keeps itself alive

    def allows(self) -> bool:
        """Whether a retry or hedge may be sent now (without spending)."""
        return self.tokens > self.max_tokens / 2

    def spend(self) -> bool:
        """Take one token for a retry or a hedge; False (nothing taken): throttled, do not send it."""
        with self._lock:
            if self.tokens <= self.max_tokens / 2:
                return False
            self.tokens -= 1.0
            if self._spent is not None:
                self._spent.add(self)
            return True

    def succeeded(self) -> None:
        """A call succeeded: earn token_ratio, up to max_tokens."""
        with self._lock:
            self.tokens = min(self.max_tokens, self.tokens + self.token_ratio)
            if self._spent is not None and self.tokens == self.max_tokens:
                self._spent.discard(self)


# The process's budgets, by target. Held weakly: a target's budget lives while a Client uses it
# or while it is below max_tokens (then `_spent` holds it: a Client made per call must find what
# the last one spent). A full budget no Client uses is dropped, as it equals a new one: a process
# that talks to ever new targets keeps only those with calls or debts.
_budgets: "weakref.WeakValueDictionary[Hashable, RetryBudget]" = weakref.WeakValueDictionary()
_spent: set[RetryBudget] = set()
_budgets_lock = threading.Lock()


def budget_for(target: Hashable) -> RetryBudget:
    """The process's one RetryBudget for `target`, made at first use. The Client passes the target
    as parsed (client_pods.parse_target: `x:50051` and `dns:///x:50051` are one target), or the
    string as given when it is of a scheme left to gRPC."""
    with _budgets_lock:
        budget = _budgets.get(target)
        if budget is None:
            budget = _budgets[target] = RetryBudget()
            budget._spent = _spent
        return budget


def forget_budgets() -> None:
    """Every target's budget forgotten (the next Client of a target starts full), and a new lock:
    in a child process after fork (a lock another thread of the parent held would stay held
    there; the parent's Clients are not the child's), and between tests."""
    global _budgets_lock
    _budgets_lock = threading.Lock()
    _budgets.clear()
    _spent.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=forget_budgets)


def drain_ms(metadata) -> float | None:
    """`embedfleet-drain-ms` from an answer's trailing metadata; None if absent or unreadable (an
    older server, a proxy's own refusal)."""
    for key, value in metadata or ():
        if key == "embedfleet-drain-ms":
            try:
                ms = float(value)
            except ValueError:
                return None
            return ms if math.isfinite(ms) and ms >= 0 else None
    return None
