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
- `hedge_tokens`, `may_hedge`: hedges stay a small share of calls, so that a fleet that is slow
  everywhere is not sent twice its load.
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple, Sequence

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
HEDGE_BUDGET = 0.1  # hedges per call, in the long run
HEDGE_BURST = 10.0  # hedges at once (a stalled pod's calls in flight), and the budget at start
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


def hedge_tokens(tokens: float) -> float:
    """The hedge budget after one more call: HEDGE_BUDGET earned per call, at most HEDGE_BURST
    saved; a hedge spends 1 (`may_hedge`). When every pod is slow, hedging would only double the
    load: a token bucket keeps hedges to a tenth of calls, with a burst for one pod's stall."""
    return min(HEDGE_BURST, tokens + HEDGE_BUDGET)


def may_hedge(tokens: float) -> bool:
    return tokens >= 1.0


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
