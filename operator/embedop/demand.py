"""A pod's readings per model, and the busy seconds they stand for. Pure.

A pod that serves several models on its one device reports, per model (the `model` label of its
series), that model's service rate (real tokens per second of *its own* busy time), offered rate
and counter, queue and admission limit. Tokens of two models do not add; device time does. A
model's capacity is the median over the pods that have served it of its service rate (as one
model's always was), and its tokens divided by that capacity are busy seconds: device seconds
wanted per second, against a capacity of 1 per pod. autoscale.decide sums them over models and
pods: demand, backlog and the queue a pod holds, all in busy seconds per second. With one model
this is today's ratio, its tokens/s over its capacity, so replicas = demand ÷ target utilization
decides exactly as before. A server from before the label (one model, series unlabelled) reads as
one model named "". And the demand's trend: whether it ramps (looked ahead on) or falls.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Iterable

# Model-busy seconds after which a pod's service rate of a model is its own measurement, not its
# warm-up's (a new pod reports its warm-up's full-row rate, an upper bound).
SERVED_BUSY_S = 2.0
OLD_SERVER = ""  # the model of a server whose series carry no model label


@dataclasses.dataclass(frozen=True)
class ModelSample:
    """One model's readings on one pod (the shared signal's series with its `model` label)."""

    model: str
    service_rate: float = 0.0  # real tokens per second of this model's busy time
    arrival_rate: float = 0.0  # offered real tokens/s (an EMA)
    queued_tokens: float = 0.0
    offered_total: float | None = None  # its offered-tokens counter (None: not exported)
    busy_seconds: float | None = None  # its model-busy seconds (None: not exported)
    backlog_limit_s: float | None = None  # the queue its admission lets grow, s of device time (None: not exported)
    task: str | None = None  # the task label of its embedfleet_model_info (None: none)


def order(readings: Iterable[Iterable[ModelSample]]) -> list[str]:
    """The models in order of first appearance (a pod's exposition lists its models as configured)."""
    return list(dict.fromkeys(r.model for pod in readings for r in pod))


def capacities(readings: list[tuple[ModelSample, ...]], known: dict[str, float]) -> dict[str, float]:
    """Each model's capacity, tokens/s of its busy time per replica: the median of its measured
    service rates over the pods that have served it (SERVED_BUSY_S of its own busy time), else over
    those that report one, else the last `known`. Only the models read now (none read: `known`).
    `readings`: the scraped serving pods', one tuple per pod."""
    if not readings:
        return dict(known)
    out = {}
    for model in order(readings):
        measured = [r for pod in readings for r in pod if r.model == model and r.service_rate > 0]
        seasoned = [r for r in measured if r.busy_seconds is None or r.busy_seconds >= SERVED_BUSY_S]
        rates = [r.service_rate for r in seasoned or measured]
        if rates or model in known:
            out[model] = statistics.median(rates) if rates else known[model]
    return out


def busy(tokens: dict[str, float], caps: dict[str, float]) -> float:
    """Σ over models of tokens ÷ that model's capacity (a model of no known capacity counts nothing:
    it cannot be converted, and none has served it)."""
    return sum(v / caps[m] for m, v in tokens.items() if caps.get(m))


def point(value: float | tuple[tuple[str, float], ...]) -> dict[str, float]:
    """A demand point of the history: offered tokens/s by model (a bare number: one unlabelled model)."""
    return {OLD_SERVER: value} if isinstance(value, (int, float)) else dict(value)


def held(pod: tuple[ModelSample, ...], caps: dict[str, float], target_utilization: float, max_drain_s: float) -> float:
    """The queue a pod holds at target utilization, in busy seconds: admission lets the device time
    queued ahead of a model grow to that model's backlog limit (every model's work counted), so the
    pod's queue reaches the largest of its models' limits; a pod busy `target_utilization` of the
    time holds that share of it, coming and going. A limit is in the pod's own seconds: its own
    service rate over the fleet's capacity converts it (a pod slower than the median holds fewer
    tokens in the same time). `max_drain_s`: the limit of a model that does not export one."""
    limits = [(max_drain_s if r.backlog_limit_s is None else r.backlog_limit_s) * (r.service_rate or caps[r.model])
              / caps[r.model] for r in pod if caps.get(r.model)]
    return target_utilization * max(limits, default=0.0)


def drain_s(pod: tuple[ModelSample, ...]) -> float:
    """The pod's device time queued, by its own rates: Σ over its models of queued tokens ÷ service
    rate (a model with no rate yet left out: its queue cannot be timed)."""
    return sum(r.queued_tokens / r.service_rate for r in pod if r.service_rate > 0)


def tasks(pods: list[tuple[ModelSample, ...]]) -> dict[str, list[str | None]]:
    """The task each pod's reading of each model states, by model (None: a pod that states none)."""
    out: dict[str, list[str | None]] = {}
    for pod in pods:
        for r in pod:
            out.setdefault(r.model, []).append(r.task)
    return out


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
