"""The autoscaling decision: replicas from the servers' own signal. Pure — samples, policy and
history in; a decision and the next history out.

capacity per replica = median of the serving pods' measured service rates (robust to an outlier
  and to a fresh pod with no samples yet; the last known value when none reports one)
demand = Σ offered rate (rejected demand included: while shedding, the accepted rate understates
  need), each pod's measured as its offered-tokens counter's increase over the interval (the
  interval's exact mean; the arrival-rate gauge, an EMA seen at one instant, only for a pod
  seen for the first time) + the backlog, present at two reads in a row, beyond the queue a pod
  holds at target utilization, to be cleared within targetDrainTime
forecast = demand + upward trend × pod start-up time (a new pod helps only once it is ready), on a
  sustained ramp only (a step is already in demand: extrapolating its jump would overshoot)
recommendation = ceil(forecast / (capacity × targetUtilization)), clamped to [min, max]
scale up at once (by at most ×4 or +4 per decision); scale down only to the highest
recommendation of the stabilization window, which starts out holding the current size (as the
HPA's: an operator restart does not forget why the fleet is as large as it is); pods still starting
(never Ready) count as capacity on its
way, and those the latest recommendation no longer needs are cancelled without waiting for the
window (they never served) once demand is known to have stopped rising (an operator restart, with
no trend yet, never reads as falling). A pod that served and turned unready (a readiness timeout
under load, a node NotReady, a crash and restart) is not starting but *blind* (what the API shows
of it, autoscaler.pod_view, or a decision saw it Ready), as is a failed scrape or an answer
without the shared signal: blindness never lets the fleet shrink (overload makes pods unready, so
cutting them would be a death spiral), though what the readable pods show may still grow it.
One kind of unreadable pod is read as *saturated* instead: a pod whose scrape was taken by its
kernel (an open connection) and got no answer in time, and whose last good reading had demand ≥
capacity × targetUtilization. An overload that starves the servers' event loop starves their
/metrics with it, and holding the count then would leave the fleet overloaded for as long as it
lasts; such a pod's demand is taken as MAX_STEP_FACTOR replicas' worth, so a fleet that cannot
answer grows by the usual step, at each decision where no pod is still starting (pods on their way
count as capacity, as always), until readings return. A refused scrape, one that never connected
(a node gone, a policy dropping packets) or a pod gone stays blind.
All rates and backlogs are in the servers' one unit, real tokens (capacity is real tokens per
second of model-busy time, so padding shows as lower capacity).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

TREND_WINDOW_S = 75.0  # the demand trend is fitted over this much time (5 decisions at 15 s)
DEFAULT_STARTUP_S = 60.0
MAX_STEP_FACTOR, MAX_STEP_ADD = 4, 4
LOOKAHEAD_CAP = 0.25  # the trend may add at most this fraction of current demand
TOLERANCE = 0.1  # recommendations within ±10% of the current size keep it
# Consecutive low recommendations before starting pods go. One: demand is an interval's mean, so
# a low one is a real dip, and pods that would have come too late cost more than a restart.
CANCEL_CONFIRMATIONS = 1
# A surge's pods go once the demand that called them has been gone this fraction of a pod
# start-up: a shorter lull (a quiet quarter-minute inside a step) keeps them, since pods let go
# must start again; a longer one is the spike's end (simulated: 1/4 meets the cost targets on
# spikes of 0.5-2 start-ups, 1/2 does not).
SURGE_LULL = 0.25
# Model-busy seconds after which a pod's service rate is its own measurement, not its warm-up's.
SERVED_BUSY_S = 2.0


@dataclasses.dataclass(frozen=True)
class PodSample:
    name: str
    ready: bool
    scraped: bool  # False: the scrape failed or timed out
    service_rate: float = 0.0  # real tokens/s of model-busy time (capacity)
    arrival_rate: float = 0.0  # offered real tokens/s
    queued_tokens: float = 0.0
    offered_total: float | None = None  # the offered-tokens counter (None: not exported)
    busy_seconds: float | None = None  # model-busy seconds served (None: not exported)
    startup_s: float | None = None  # creation → Ready, when the pod became ready
    backlog_limit_s: float | None = None  # the queue its admission lets grow, s of model time (None: not exported)
    served: bool = False  # the API shows it has been Ready (autoscaler.pod_view), though not now
    task: str | None = None  # the task label of its embedfleet_model_info (None: not exported); not a decision input
    # Not scraped because no answer came in time on a connection the pod had taken (its kernel
    # accepted it in this very scrape: scrape.py): the pod is there and too busy to answer. With a hot last
    # reading, saturated (decide); any other failure is blind.
    timed_out: bool = False

    @property
    def was_ready(self) -> bool:
        """Whether the pod has been Ready, as far as this sample shows (decide also remembers the
        pods it saw so): only a pod that never was is starting."""
        return self.ready or self.served


@dataclasses.dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target_utilization: float
    target_drain_s: float
    scale_up_stabilization_s: float
    scale_down_stabilization_s: float
    max_drain_s: float = 0.5  # the servers' admission budget (spec.admission.maxDrainTimeMs)

    @classmethod
    def from_spec(cls, autoscaling: dict, admission: dict | None = None) -> "Policy":
        return cls(
            autoscaling["minReplicas"], autoscaling["maxReplicas"], autoscaling["targetUtilization"],
            autoscaling["targetDrainTimeMs"] / 1000, autoscaling["scaleUpStabilizationSeconds"],
            autoscaling["scaleDownStabilizationSeconds"],
            **({"max_drain_s": admission["maxDrainTimeMs"] / 1000} if admission else {}),
        )


@dataclasses.dataclass(frozen=True)
class History:
    recommendations: tuple[tuple[float, int], ...] = ()  # (time, clamped recommendation)
    demand: tuple[tuple[float, float], ...] = ()  # (time, offered tokens/s): the trend's points
    capacity: float | None = None  # last known tokens/s per replica
    startup_s: float = DEFAULT_STARTUP_S  # measured time from pod creation to ready
    pods: tuple["Seen", ...] = ()  # each pod as last scraped
    surge: "Surge | None" = None  # the scale-up under way
    startups: tuple[tuple[str, float], ...] = ()  # (pod, creation → its first Ready), as first measured
    served: frozenset[str] = frozenset()  # present pods seen Ready (or served) by a decision


@dataclasses.dataclass(frozen=True)
class Surge:
    """Capacity added within the scale-down window, and what it was added on."""

    last_up: float  # time of its latest step
    base: int  # the size before its first step
    low_since: float | None = None  # since when the recommendation has been back within `base`


@dataclasses.dataclass(frozen=True)
class Seen:
    """What the previous decision read from one pod."""

    name: str
    at: float
    offered_total: float | None
    queued_tokens: float
    load: float | None = None  # its demand over the capacity per replica (None: no capacity known)


@dataclasses.dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    recommendation: int  # before stabilization
    capacity: float | None
    demand: float
    forecast: float
    limited: bool  # demand needs more than maxReplicas
    history: History
    offered: float = 0.0  # Σ offered tokens/s of the scraped pods
    needed: int = 0  # replicas demand needs, before the bounds (what ScalingLimited reports)
    saturated: tuple[str, ...] = ()  # pods read as saturated (saturated_pod)


def offered_rate(sample: PodSample, previous: Seen | None, now: float) -> float:
    """A pod's offered tokens/s: its counter's increase since the last decision when there is
    one (a restarted server's counter starts again from 0: then, and for a new pod, the gauge)."""
    if (sample.offered_total is None or previous is None or previous.offered_total is None
            or now <= previous.at or sample.offered_total < previous.offered_total):
        return sample.arrival_rate
    return (sample.offered_total - previous.offered_total) / (now - previous.at)


def persistent_backlog(sample: PodSample, previous: Seen | None) -> float:
    """Queued tokens that were there at the last decision too: a busy pod's queue comes and goes
    between two reads; a backlog that needs more capacity stays. A first read (a new pod, a
    restarted operator) has nothing to compare with: no backlog yet."""
    return min(sample.queued_tokens, previous.queued_tokens) if previous else 0.0


def trend(points: tuple[tuple[float, float], ...], min_fit: float = 0.6) -> float:
    """Least-squares slope (units per second) of the last few points: 0 with fewer than 3, or
    when the line explains less than `min_fit` of the variance (noise is not a trend, and
    extrapolating it a start-up ahead would turn jitter into replicas)."""
    pts = points
    if len(pts) < 3:
        return 0.0
    mt = sum(t for t, _ in pts) / len(pts)
    mv = sum(v for _, v in pts) / len(pts)
    var_t = sum((t - mt) ** 2 for t, _ in pts)
    var_v = sum((v - mv) ** 2 for _, v in pts)
    if var_t == 0 or var_v == 0:
        return 0.0
    cov = sum((t - mt) * (v - mv) for t, v in pts)
    r2 = cov * cov / (var_t * var_v)
    return cov / var_t if r2 >= min_fit else 0.0


def ramp(points: tuple[tuple[float, float], ...]) -> float:
    """The upward trend to look ahead on: only a sustained ramp, demand up at each of the last
    three reads, and rising lately at the pace fitted over the window. A step is already in demand:
    a fit over a window that holds it reads as a slope, and extrapolating that a start-up ahead
    would overshoot. Each read is an interval's mean, so a step that lands inside an interval reads
    as two rises (old → partial → full), and a backlog it leaves adds a third a read later; but
    then the latest reads rise far faster (or slower) than the window's fit, where a ramp's keep
    its pace."""
    if len(points) < 4 or not all(points[i][1] > points[i - 1][1] for i in (-1, -2, -3)):
        return 0.0
    overall, lately = trend(points), trend(points[-3:], min_fit=0.0)
    return overall if overall > 0 and 0.5 <= lately / overall <= 2.0 else 0.0


def falling(points: tuple[tuple[float, float], ...]) -> bool:
    """Whether demand is known to have stopped rising: not up since the last read (with two
    points) or over the window (three or more). A single point (a new service, or an operator
    restart with no trend yet) never reads as falling."""
    if len(points) < 2:
        return False
    return (points[-1][1] <= points[-2][1]) if len(points) == 2 else trend(points, min_fit=0.0) <= 0


def startups(samples: list[PodSample], known: tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
    """Each present pod's start-up, kept as first measured: a pod whose readiness flapped reports
    the last flap as its Ready time, which says nothing about how long a pod takes to start."""
    first = dict(known)
    return tuple((s.name, first.get(s.name, s.startup_s)) for s in samples
                 if s.name in first or s.startup_s is not None)


def saturated_pod(sample: PodSample, last: Seen | None, served: set[str], policy: Policy) -> bool:
    """Whether a pod reads as saturated: it has served, its scrape timed out on a connection it had
    taken, and its last good reading had demand at or above capacity × targetUtilization."""
    return (sample.name in served and sample.timed_out and not sample.scraped and last is not None
            and last.load is not None and last.load >= policy.target_utilization)


def decide(samples: list[PodSample], current: int, policy: Policy, history: History, now: float) -> Decision:
    """`current` is the Deployment's replica count, starting pods included."""
    # Pods that have been Ready: as the API shows them, or as a decision saw them (a container that
    # crashed and restarts shows neither Ready nor started, though it served). Those that turned
    # unready may still carry load (their connections stay open): what can be read of them counts.
    served = {s.name for s in samples if s.was_ready or s.name in history.served}
    scraped = [s for s in samples if s.name in served and s.scraped]
    # A pod that has served little still reports its warm-up's rate (full rows, an upper bound):
    # the pods that have served decide capacity when there are any.
    measured = [s for s in scraped if s.service_rate > 0]
    seasoned = [s for s in measured if s.busy_seconds is None or s.busy_seconds >= SERVED_BUSY_S]
    rates = [s.service_rate for s in seasoned or measured]
    capacity = statistics.median(rates) if rates else history.capacity
    measured_startups = startups(samples, history.startups)
    startup_s = statistics.median(v for _, v in measured_startups) if measured_startups else history.startup_s
    # Backlog counts only beyond the queue a pod holds at target utilization: admission lets a
    # queue grow to the pod's backlog limit (its drain budget less the batcher's reorder window;
    # the whole budget for a pod that does not say), and a pod busy `target_utilization` of the
    # time holds its share of that, coming and going. Only a queue above it, at two reads in a
    # row, says the pod is saturated (its offered rate, rejections included, says by how much).
    def held(s: PodSample) -> float:
        limit = policy.max_drain_s if s.backlog_limit_s is None else s.backlog_limit_s
        return policy.target_utilization * limit * (s.service_rate or capacity or 0.0)

    seen = {p.name: p for p in history.pods}
    offered = {s.name: offered_rate(s, seen.get(s.name), now) for s in scraped}
    own = {s.name: offered[s.name] + max(0.0, persistent_backlog(s, seen.get(s.name)) - held(s)) / policy.target_drain_s
           for s in scraped}  # each pod's demand
    demand = sum(own.values())
    # A pod not scraped this time keeps its last reading, so the next rate spans both intervals
    # (and a saturated pod stays saturated until it answers again).
    pods = tuple(Seen(s.name, now, s.offered_total, s.queued_tokens, own[s.name] / capacity if capacity else None)
                 for s in scraped) + tuple(
        p for p in history.pods if p.name not in offered and any(s.name == p.name for s in samples))
    saturated = [s.name for s in samples if saturated_pod(s, seen.get(s.name), served, policy)]
    # The trend is the offered load's: a backlog is cleared once, not a rate that goes on growing
    # (counted in it, a step that saturates a pod read as a third rise). The window holds at least
    # four reads, whatever the interval (ramp() needs them).
    interval = now - history.demand[-1][0] if history.demand else 0.0
    window_s = max(TREND_WINDOW_S, 4 * interval)
    demand_points = tuple(p for p in history.demand if p[0] > now - window_s) + ((now, sum(offered.values())),)
    # Look-ahead is for sustained ramps (a few % per start-up, see ramp()), and capped.
    # Capacity decided now is ready in startup_s; capacity decided at the next step, an interval
    # later: until then, what we decide now has to carry the load.
    forecast = demand + min(ramp(demand_points) * (startup_s + interval), LOOKAHEAD_CAP * demand)
    # A saturated pod's demand is past what it can say: MAX_STEP_FACTOR replicas' worth (not in
    # the trend, which is the offered load read).
    if saturated and capacity:
        extra = len(saturated) * MAX_STEP_FACTOR * capacity * policy.target_utilization
        demand, forecast = demand + extra, forecast + extra
    # Pods that served and could not be read, or serve no more (unready): demand is a floor.
    blind = any(s.name in served and not (s.ready and s.scraped) for s in samples)

    def keep(recommendation: int) -> History:
        horizon = now - max(policy.scale_down_stabilization_s, policy.scale_up_stabilization_s)
        # No history (a new service, or the operator restarted): the window starts out holding the
        # current size, as the HPA's does, so the first decision cannot drop 4 pods to 2 at once.
        past = history.recommendations or (((now, current),) if policy.scale_down_stabilization_s else ())
        recs = tuple(r for r in past if r[0] >= horizon) + ((now, recommendation),)
        return History(recs, demand_points, capacity, startup_s, pods, startups=measured_startups,
                       served=frozenset(served))

    if capacity is None:  # nothing measured yet: hold (within bounds)
        desired = min(max(current, policy.min_replicas), policy.max_replicas)
        return Decision(desired, "no service rate measured yet", desired, None, demand, forecast, False,
                        keep(desired), sum(offered.values()))

    exact = forecast / (capacity * policy.target_utilization)
    raw = math.ceil(exact - 1e-9) if forecast > 0 else 0
    if current > 0 and abs(exact / current - 1) <= TOLERANCE:
        raw = current  # within tolerance of the current size: not worth a change (as the HPA)
    recommendation = min(max(raw, policy.min_replicas), policy.max_replicas)
    limited = raw > policy.max_replicas
    new_history = keep(recommendation)
    in_window = lambda seconds: [r for t, r in new_history.recommendations if t >= now - seconds]  # noqa: E731
    # Capacity added within the window is a surge until the window has passed over it.
    surge = history.surge if history.surge and now - history.surge.last_up <= policy.scale_down_stabilization_s else None
    if surge:
        low = recommendation <= surge.base
        surge = dataclasses.replace(surge, low_since=(surge.low_since or now) if low else None)
    not_rising = falling(demand_points)

    if recommendation > current:
        # Scale-up stabilization (0 by default): the lowest recommendation of its window.
        target = min(in_window(policy.scale_up_stabilization_s)) if policy.scale_up_stabilization_s else recommendation
        step = max(current * MAX_STEP_FACTOR, current + MAX_STEP_ADD)
        desired = max(current, min(target, step))
        reason = f"scale up: demand {forecast:.0f} tok/s needs {raw} × {capacity:.0f} tok/s at {policy.target_utilization:.0%}"
        if saturated:
            reason += (f" ({len(saturated)} pod(s) saturated: no answer in time after a reading at or above target, "
                       f"each taken as {MAX_STEP_FACTOR} replicas' worth)")
        if desired > current:
            surge = Surge(now, surge.base if surge else current)
    elif recommendation < current:
        windowed = max(in_window(policy.scale_down_stabilization_s))
        # Only pods that were never Ready are starting; the rest of the count has served.
        starting = current - len(served)
        if blind:
            desired, reason = current, "hold: some serving pods could not be read or are unready"
        elif surge and surge.low_since is not None and now - surge.low_since >= SURGE_LULL * startup_s and not_rising:
            # The demand that called the surge has gone (a spike shorter than the window, or one
            # that ended before its pods were ready): the window protects the fleet from a noisy
            # signal, not pods added for load that is no longer there. Once the demand has been
            # back within the old size for SURGE_LULL of a pod start-up (a shorter lull keeps
            # them), and is falling: back to the size before it.
            desired, surge = surge.base, None
            reason = f"the surge is over: demand {forecast:.0f} tok/s is back within {desired} replicas"
        elif windowed < current:
            desired = windowed
            reason = f"scale down: highest recommendation in {policy.scale_down_stabilization_s:.0f}s is {windowed}"
        elif (starting > 0 and not_rising
              and (confirmed := max(r for _, r in new_history.recommendations[-CANCEL_CONFIRMATIONS:])) < current):
            # Capacity that came too late: cancel starting pods that the latest recommendation(s)
            # no longer need. They never served, so this cannot flap the serving fleet.
            desired = max(confirmed, current - starting)
            reason = f"cancel {current - desired} starting pod(s) no longer needed"
        else:
            desired, reason = current, f"hold: scale-down window ({policy.scale_down_stabilization_s:.0f}s)"
    else:
        desired, reason = current, "steady"
    desired = min(max(desired, policy.min_replicas), policy.max_replicas)
    return Decision(desired, reason, recommendation, capacity, demand, forecast, limited,
                    dataclasses.replace(new_history, surge=surge), sum(offered.values()), raw, tuple(saturated))


# What the ReplicaSet controller reads, only when it scales down, to choose which pods go: the
# lowest cost first, among pods otherwise alike (pods not Ready go before any Ready one, whatever
# their cost). An int32, as a string; absent is 0.
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# The pods a scale-down is to remove get int32's least cost, below whatever a pod template may set
# (spec.podAnnotations), and our mark; every other pod keeps its template's value. So an idle pod
# that stays is not confused with one that goes (a cost per pod's queue made idle pods equal to
# unannotated ones, and left a ranking on the pods that a later scale-down by someone else read).
REMOVAL_COST = str(-(2**31))
REMOVAL_MARK = "embedfleet.dev/scale-down"  # on the pods given REMOVAL_COST: ours to clear


def removal_marks(samples: list[PodSample], annotations: dict[str, dict], removed: int,
                  template_cost: str | None) -> dict[str, dict[str, str | None]]:
    """The annotations to merge into pods (None: removed) before `removed` pods go, so that the
    ReplicaSet removes the idlest: the Ready pods read with the least queued work (as many as go
    beyond the pods not Ready, which it takes first anyway) get REMOVAL_COST and REMOVAL_MARK; a
    pod marked before (a decision dropped after its marks were written) that is not to go gets
    its template's cost back (`template_cost`; None: none) and loses the mark. `annotations`: the
    pods' own, by name (those being deleted left out). Only what changes; `removed` 0: only the
    clearing."""
    unready = sum(1 for s in samples if not s.ready)
    ranked = sorted((s for s in samples if s.ready and s.scraped and s.name in annotations),
                    key=lambda s: (s.queued_tokens, s.name))
    going = {s.name for s in ranked[:max(0, removed - unready)]}
    out: dict[str, dict[str, str | None]] = {}
    for name, own in annotations.items():
        if name in going and (own.get(DELETION_COST), own.get(REMOVAL_MARK)) != (REMOVAL_COST, "true"):
            out[name] = {DELETION_COST: REMOVAL_COST, REMOVAL_MARK: "true"}
        elif name not in going and REMOVAL_MARK in own:
            out[name] = {DELETION_COST: template_cost, REMOVAL_MARK: None}
    return out
