"""The autoscaling decision: replicas from the servers' own signal. Pure — samples, policy and
history in; a decision and the next history out.

Each pod reports each model it serves (one, or several on one device) in real tokens; each model's
tokens over its capacity are busy seconds (demand.py), and the decision works in those, summed
over models and pods, against a capacity of 1 per pod. With one model that is its tokens/s over its
capacity: the same replicas as a decision in tokens.
capacity of a model = median of its service rate over the serving pods (robust to an outlier
  and to a fresh pod with no samples yet; the last known value when none reports one)
demand = Σ offered rate (rejected demand included: while shedding, the accepted rate understates
  need), each pod's measured as its offered-tokens counter's increase over the interval (the
  interval's exact mean; the arrival-rate gauge, an EMA seen at one instant, only for a pod
  seen for the first time) + the backlog, present at two reads in a row, beyond the queue a pod
  holds at target utilization, to be cleared within targetDrainTime; all of it per model over the
  model's capacity, in busy seconds per second
forecast = demand + upward trend × pod start-up time (a new pod helps only once it is ready), on a
  sustained ramp only (a step is already in demand: extrapolating its jump would overshoot)
recommendation = ceil(forecast / targetUtilization), clamped to [min, max]
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
Rates and backlogs are read in the servers' one unit, real tokens (capacity is real tokens per
second of model-busy time, so padding shows as lower capacity). The Decision reports demand and
forecast in tokens/s of the fleet's model (with several, the first's: its capacity × the busy
seconds) and in busy seconds per second (`load`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from embedop import demand as loads
from embedop.demand import SERVED_BUSY_S, ModelSample, falling, ramp, trend  # noqa: F401 - this module's interface

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
    # Its readings per model (scrape.py; the fields above are the one model's when it serves one).
    # Empty: the fields above are its one model's, named "" (a server without the model label).
    models: tuple[ModelSample, ...] = ()

    def readings(self) -> tuple[ModelSample, ...]:
        """Its readings, one per model it serves."""
        return self.models or (ModelSample(loads.OLD_SERVER, self.service_rate, self.arrival_rate, self.queued_tokens,
                                           self.offered_total, self.busy_seconds, self.backlog_limit_s, self.task),)

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
    # (time, offered tokens/s by model: ((model, tokens/s), ...); a bare number: one model, ""): the
    # trend's points, turned into busy seconds with the capacities of each decision
    demand: tuple[tuple[float, float | tuple[tuple[str, float], ...]], ...] = ()
    capacity: float | None = None  # last known tokens/s per replica of the first model (one model: its own)
    startup_s: float = DEFAULT_STARTUP_S  # measured time from pod creation to ready
    pods: tuple["Seen", ...] = ()  # each pod as last scraped
    surge: "Surge | None" = None  # the scale-up under way
    startups: tuple[tuple[str, float], ...] = ()  # (pod, creation → its first Ready), as first measured
    served: frozenset[str] = frozenset()  # present pods seen Ready (or served) by a decision
    capacities: tuple[tuple[str, float], ...] = ()  # last known tokens/s per replica, by model


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
    models: tuple[ModelSample, ...] = ()  # per model: its counter and queue (empty: the two above, model "")

    def readings(self) -> dict[str, ModelSample]:
        return {r.model: r for r in self.models} or {
            loads.OLD_SERVER: ModelSample(loads.OLD_SERVER, queued_tokens=self.queued_tokens, offered_total=self.offered_total)}


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
    offered: float = 0.0  # Σ offered tokens/s of the scraped pods (every model's tokens)
    needed: int = 0  # replicas demand needs, before the bounds (what ScalingLimited reports)
    saturated: tuple[str, ...] = ()  # pods read as saturated (saturated_pod)
    load: float = 0.0  # demand in busy seconds per second (what `demand` is in tokens/s of the first model)
    capacities: tuple[tuple[str, float], ...] = ()  # each model's tokens/s per replica, in the order read
    offered_by_model: tuple[tuple[str, float], ...] = ()  # each model's offered tokens/s over the scraped pods


def offered_rate(reading: ModelSample, previous: ModelSample | None, since: float | None, now: float) -> float:
    """A pod's offered tokens/s of one model: its counter's increase since the last decision
    (`since`) when there is one (a restarted server's counter starts again from 0: then, and for a
    new pod, the gauge)."""
    if (reading.offered_total is None or previous is None or previous.offered_total is None or since is None
            or now <= since or reading.offered_total < previous.offered_total):
        return reading.arrival_rate
    return (reading.offered_total - previous.offered_total) / (now - since)


def persistent_backlog(reading: ModelSample, previous: ModelSample | None) -> float:
    """Queued tokens of one model that were there at the last decision too: a busy pod's queue
    comes and goes between two reads; a backlog that needs more capacity stays. A first read (a
    new pod, a restarted operator) has nothing to compare with: no backlog yet."""
    return min(reading.queued_tokens, previous.queued_tokens) if previous else 0.0


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
    readings = {s.name: s.readings() for s in scraped}
    # Each model's capacity: the median of its service rates over the pods that have served it
    # (a pod that has served little still reports its warm-up's full-row rate, an upper bound).
    known = dict(history.capacities) or ({} if history.capacity is None else {loads.OLD_SERVER: history.capacity})
    caps = loads.capacities(list(readings.values()), known)
    models = list(caps)
    capacity = caps[models[0]] if caps else None  # the first model's: what tokens/s are reported in
    measured_startups = startups(samples, history.startups)
    startup_s = statistics.median(v for _, v in measured_startups) if measured_startups else history.startup_s
    seen = {p.name: p for p in history.pods}

    def pod_demand(name: str) -> tuple[dict[str, float], float]:
        """A pod's offered tokens/s by model, and its demand in busy seconds per second: offered
        plus the backlog, present at two reads in a row, beyond the queue it holds at target
        utilization (loads.held: a share of its admission's backlog limit, coming and going),
        to be cleared within targetDrainTime."""
        last = seen.get(name)
        before = last.readings() if last else {}
        offered = {r.model: offered_rate(r, before.get(r.model), last and last.at, now) for r in readings[name]}
        backlog = {r.model: persistent_backlog(r, before.get(r.model)) for r in readings[name]}
        excess = loads.busy(backlog, caps) - loads.held(readings[name], caps, policy.target_utilization, policy.max_drain_s)
        return offered, loads.busy(offered, caps) + max(0.0, excess) / policy.target_drain_s

    per_pod = {s.name: pod_demand(s.name) for s in scraped}
    own = {name: load for name, (_, load) in per_pod.items()}  # each pod's demand, busy s/s
    offered_by_model: dict[str, float] = {}
    for offered, _ in per_pod.values():
        for model, rate in offered.items():
            offered_by_model[model] = offered_by_model.get(model, 0.0) + rate
    offered_total = sum(sum(offered.values()) for offered, _ in per_pod.values())
    demand = sum(own.values())
    # A pod not scraped this time keeps its last reading, so the next rate spans both intervals
    # (and a saturated pod stays saturated until it answers again).
    pods = tuple(Seen(s.name, now, s.offered_total, s.queued_tokens, own[s.name] if caps else None, s.models)
                 for s in scraped) + tuple(
        p for p in history.pods if p.name not in own and any(s.name == p.name for s in samples))
    saturated = [s.name for s in samples if saturated_pod(s, seen.get(s.name), served, policy)]
    # The trend is the offered load's: a backlog is cleared once, not a rate that goes on growing
    # (counted in it, a step that saturates a pod read as a third rise). The window holds at least
    # four reads, whatever the interval (ramp() needs them). Its points keep tokens by model, each
    # turned into busy seconds with the capacities of now (one model: its tokens over one capacity).
    interval = now - history.demand[-1][0] if history.demand else 0.0
    window_s = max(TREND_WINDOW_S, 4 * interval)
    kept = tuple(p for p in history.demand if p[0] > now - window_s) + ((now, tuple(offered_by_model.items())),)
    # A model no longer read (renamed in a rollout, or an old server's unlabelled one) keeps its
    # last capacity while its points are in the window: converted to 0, its fall and the new
    # model's rise read as a ramp.
    trend_caps = {m: c for m, c in {**known, **caps}.items()
                  if m in caps or any(m in loads.point(v) for _, v in kept)}
    demand_points = tuple((t, loads.busy(loads.point(v), trend_caps)) for t, v in kept)
    # Look-ahead is for sustained ramps (a few % per start-up, see ramp()), and capped.
    # Capacity decided now is ready in startup_s; capacity decided at the next step, an interval
    # later: until then, what we decide now has to carry the load.
    forecast = demand + min(ramp(demand_points) * (startup_s + interval), LOOKAHEAD_CAP * demand)
    # A saturated pod's demand is past what it can say: MAX_STEP_FACTOR replicas' worth (not in
    # the trend, which is the offered load read).
    if saturated and caps:
        extra = len(saturated) * MAX_STEP_FACTOR * policy.target_utilization
        demand, forecast = demand + extra, forecast + extra
    # Pods that served and could not be read, or serve no more (unready): demand is a floor.
    blind = any(s.name in served and not (s.ready and s.scraped) for s in samples)
    # Reported in tokens/s of the first model (one model: its own), as the reasons say it.
    tokens = (lambda busy_s: busy_s * capacity) if capacity else (lambda busy_s: busy_s)
    said = ((lambda busy_s: f"{tokens(busy_s):.0f} tok/s") if len(models) <= 1 else
            (lambda busy_s: f"{busy_s:.2f} busy s/s of {len(models)} models"))
    measured = dict(offered_by_model=tuple(offered_by_model.items()), capacities=tuple(caps.items()))

    def keep(recommendation: int) -> History:
        horizon = now - max(policy.scale_down_stabilization_s, policy.scale_up_stabilization_s)
        # No history (a new service, or the operator restarted): the window starts out holding the
        # current size, as the HPA's does, so the first decision cannot drop 4 pods to 2 at once.
        past = history.recommendations or (((now, current),) if policy.scale_down_stabilization_s else ())
        recs = tuple(r for r in past if r[0] >= horizon) + ((now, recommendation),)
        return History(recs, kept, capacity, startup_s, pods, startups=measured_startups,
                       served=frozenset(served), capacities=tuple(trend_caps.items()))

    if capacity is None:  # nothing measured yet: hold (within bounds)
        desired = min(max(current, policy.min_replicas), policy.max_replicas)
        return Decision(desired, "no service rate measured yet", desired, None, offered_total, offered_total, False,
                        keep(desired), offered_total, **measured)

    exact = forecast / policy.target_utilization
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
        reason = (f"scale up: demand {said(forecast)} needs {raw} × {capacity:.0f} tok/s at {policy.target_utilization:.0%}"
                  if len(models) <= 1 else
                  f"scale up: demand {said(forecast)} needs {raw} replicas at {policy.target_utilization:.0%}")
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
            reason = f"the surge is over: demand {said(forecast)} is back within {desired} replicas"
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
    return Decision(desired, reason, recommendation, capacity, tokens(demand), tokens(forecast), limited,
                    dataclasses.replace(new_history, surge=surge), offered_total, raw, tuple(saturated), demand,
                    **measured)


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
    beyond the pods not Ready, which it takes first anyway; the least device time queued, every
    model's) get REMOVAL_COST and REMOVAL_MARK; a
    pod marked before (a decision dropped after its marks were written) that is not to go gets
    its template's cost back (`template_cost`; None: none) and loses the mark. `annotations`: the
    pods' own, by name (those being deleted left out). Only what changes; `removed` 0: only the
    clearing."""
    unready = sum(1 for s in samples if not s.ready)
    ranked = sorted((s for s in samples if s.ready and s.scraped and s.name in annotations),
                    # a queue of a model with no rate yet cannot be timed: not the idlest
                    key=lambda s: (any(r.queued_tokens > 0 and r.service_rate <= 0 for r in s.readings()),
                                   loads.drain_s(s.readings()), sum(r.queued_tokens for r in s.readings()), s.name))
    going = {s.name for s in ranked[:max(0, removed - unready)]}
    out: dict[str, dict[str, str | None]] = {}
    for name, own in annotations.items():
        if name in going and (own.get(DELETION_COST), own.get(REMOVAL_MARK)) != (REMOVAL_COST, "true"):
            out[name] = {DELETION_COST: REMOVAL_COST, REMOVAL_MARK: "true"}
        elif name not in going and REMOVAL_MARK in own:
            out[name] = {DELETION_COST: template_cost, REMOVAL_MARK: None}
    return out
