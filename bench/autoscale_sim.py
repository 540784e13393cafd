"""Discrete-event simulation of a fleet under load traces: our autoscaler vs the policies people
use today. Seconds of simulated time; runs in well under a minute.

Each replica is a FIFO device of fixed capacity (tokens/s) that becomes ready STARTUP_S after it
is created. Every request goes to a random ready replica, whose admission is the server's real
`embedserve.admission.policy.decide` (throughput strategy, MAX_DRAIN_TIME_MS budget); the replica's
offered-load rate is the server's real `DecayingRate`, beside its offered-tokens counter. Policies:
  ours       embedop.autoscale.decide (the operator's real function), every 5 s (the CRD default intervalSeconds)
  hpa-util   Kubernetes HPA on busy fraction, target 70%: 15 s sync, 10% tolerance, scale-up
             max(100%, 4 pods) per 15 s, 300 s scale-down stabilization
  ray-serve  target ongoing requests per replica, upscale delay 30 s, downscale delay 600 s
  knative    KPA concurrency: 60 s stable window, 6 s panic window (2x), target 70% of limit
  bound      an oracle of the present (not the future) load, deciding every second: the floor
             that pod start-up sets for any reactive policy (not a target)
Usage: python -m bench.autoscale_sim [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import sys
import time

import numpy as np

from embedop import autoscale
from embedserve.admission import policy as admission
from embedserve.batching.decisions import reorder_window
from embedserve.admission.estimator import DecayingRate, Snapshot

CAPACITY = 10_000.0  # tokens/s per replica
STARTUP_S = 60.0
MEAN_TOKENS = 500.0
MAX_DRAIN_S = 0.5
# 2.2 replicas' worth at 70%: off the rounding edge (at exactly 2, one noisy read decides
# between 2 and 3 replicas for the whole trace).
BASE = 2.2 * 0.7 * CAPACITY
INITIAL = math.ceil(BASE / (0.7 * CAPACITY))  # every policy starts with the base load's fleet
MIN_R, MAX_R = 1, 30
# As a GPU server admits: its batches run for milliseconds, so the reorder window held back from
# the budget is DEADLINE_WAIT_MS's 50 ms (embedserve.batching.decisions.reorder_window).
POLICY = admission.Policy(throughput=True, latency=False, max_drain_s=MAX_DRAIN_S, latency_soft_s=1, latency_hard_s=2,
                          reorder_s=reorder_window(0.05, MAX_DRAIN_S))


@dataclasses.dataclass
class Replica:
    created: float
    busy_until: float = 0.0
    work_added_s: float = 0.0  # seconds of work admitted so far
    completions: list = dataclasses.field(default_factory=list)  # heap of completion times
    arrival: DecayingRate = dataclasses.field(default_factory=lambda: DecayingRate(5.0))
    offered_total: float = 0.0  # the server's offered-tokens counter

    def ready(self, t: float) -> bool:
        return t >= self.created + STARTUP_S

    def queued(self, t: float) -> float:
        return max(0.0, self.busy_until - t) * CAPACITY

    def busy_seconds(self, t: float) -> float:
        return self.work_added_s - max(0.0, self.busy_until - t)

    def ongoing(self, t: float) -> int:
        while self.completions and self.completions[0] <= t:
            heapq.heappop(self.completions)
        return len(self.completions)


# -- load traces: tokens/s offered at time t ------------------------------------------------------
TRACES = {
    "step x4": (1500, lambda t: BASE * (4 if 300 <= t < 1200 else 1)),
    # A step with a quiet quarter-minute inside it: the surge must not be let go.
    "step+lull": (1500, lambda t: BASE * (4 if 300 <= t < 1200 and not 600 <= t < 615 else 1)),
    "ramp": (1800, lambda t: BASE * (1 + 3 * min(1.0, max(0.0, (t - 300) / 1200)))),
    # Spikes of 0.5x, 1x and 2x the pod start-up: pods called by the shorter ones are ready only
    # after the demand that called them has gone, and cost replica-seconds for nothing.
    **{f"spike {k}x": (900, lambda t, d=k * STARTUP_S: BASE * (5 if 300 <= t < 300 + d else 1)) for k in (0.5, 1, 2)},
    "diurnal": (3600, lambda t: BASE * (2.5 - 1.5 * math.cos(2 * math.pi * t / 3600))),
}


# -- policies: (fleet state) -> desired replicas ---------------------------------------------------
class Ours:
    interval = 5.0

    def __init__(self, policy: autoscale.Policy | None = None):
        self.history = autoscale.History(startup_s=STARTUP_S)
        self.policy = policy or autoscale.Policy(MIN_R, MAX_R, 0.7, 1.0, 0, 120, max_drain_s=MAX_DRAIN_S)

    def __call__(self, fleet, t):
        samples = [autoscale.PodSample(str(id(r)), r.ready(t), r.ready(t), CAPACITY if r.ready(t) else 0.0,
                                       r.arrival.read(t), r.queued(t), r.offered_total,
                                       startup_s=STARTUP_S if r.ready(t) else None,
                                       backlog_limit_s=POLICY.backlog_limit_s) for r in fleet]
        d = autoscale.decide(samples, len(fleet), self.policy, self.history, t)
        self.history = d.history
        return d.desired


class HpaUtilization:
    interval = 15.0

    def __init__(self, target=0.7, window=300.0):
        self.target, self.window, self.recs, self.last_busy = target, window, [], {}

    def __call__(self, fleet, t):
        ready = [r for r in fleet if r.ready(t)]
        utils = []
        for r in ready:
            busy = r.busy_seconds(t)
            prev_t, prev_busy = self.last_busy.get(id(r), (max(r.created + STARTUP_S, t - self.interval), busy))
            utils.append(min(1.0, (busy - prev_busy) / max(1e-9, t - prev_t)) if t > prev_t else 0.0)
            self.last_busy[id(r)] = (t, busy)
        current = len(fleet)
        if not ready:
            return current
        ratio = (sum(utils) / len(utils)) / self.target
        # HPA: unready pods count as 0% when scaling down and 100%... (simplified: ready pods only)
        rec = current if abs(ratio - 1) <= 0.1 else math.ceil(len(ready) * ratio)
        rec = min(max(rec, MIN_R), MAX_R)
        self.recs = [(tt, v) for tt, v in self.recs if tt > t - self.window] + [(t, rec)]
        if rec > current:
            return min(rec, max(2 * current, current + 4))
        return max(v for _, v in self.recs) if max(v for _, v in self.recs) < current else current


class RayServe:
    interval = 10.0

    def __init__(self, target_ongoing=2, up_delay=30.0, down_delay=600.0):  # Ray Serve's defaults
        self.target, self.up_delay, self.down_delay = target_ongoing, up_delay, down_delay
        self.want_since = None

    def __call__(self, fleet, t):
        ready = [r for r in fleet if r.ready(t)]
        ongoing = sum(r.ongoing(t) for r in ready)
        rec = min(max(math.ceil(ongoing / self.target), MIN_R), MAX_R)
        current = len(fleet)
        if rec == current:
            self.want_since = None
            return current
        direction = rec > current
        if self.want_since is None or self.want_since[0] != direction:
            self.want_since = (direction, t)
        delay = self.up_delay if direction else self.down_delay
        return rec if t - self.want_since[1] >= delay else current


class Knative:
    interval = 2.0

    def __init__(self, limit=4, utilization=0.7, stable=60.0, panic=6.0):
        self.target = limit * utilization
        self.stable, self.panic = stable, panic
        self.samples: list[tuple[float, float]] = []
        self.panic_until = -1.0

    def __call__(self, fleet, t):
        ready = [r for r in fleet if r.ready(t)]
        self.samples = [(tt, c) for tt, c in self.samples if tt > t - self.stable] + [(t, sum(r.ongoing(t) for r in ready))]
        stable_c = np.mean([c for _, c in self.samples])
        panic_c = np.mean([c for tt, c in self.samples if tt > t - self.panic])
        current = len(fleet)
        stable_rec = min(max(math.ceil(stable_c / self.target), MIN_R), MAX_R)
        panic_rec = min(max(math.ceil(panic_c / self.target), MIN_R), MAX_R)
        if panic_rec >= 2 * max(1, len(ready)):
            self.panic_until = t + self.stable
        if t < self.panic_until:
            return max(current, panic_rec)
        return stable_rec


class ReactiveBound:
    """Not a policy anyone can run: it knows the offered load of this very second and starts the
    pods it needs at once. What remains is what pod start-up alone costs any reactive policy."""

    interval = 1.0
    load = None  # set by simulate(): the trace itself

    def __call__(self, fleet, t):
        return min(max(math.ceil(self.load(t) / (CAPACITY * 0.7)), MIN_R), MAX_R)


POLICIES = {"ours": Ours, "hpa-util": HpaUtilization, "ray-serve": RayServe, "knative": Knative,
            "bound": ReactiveBound}


def simulate(trace, policy_name: str, seed: int = 0, rejections_at: list | None = None, *,
             replicas_at: list | None = None, policy=None, initial: int = INITIAL) -> dict:
    """`trace`: a name of TRACES, or (duration, load); `policy`: an instance to run instead of
    POLICIES[policy_name]'s default; `replicas_at` gets (time, replicas) after every decision."""
    duration, load = TRACES[trace] if isinstance(trace, str) else trace
    rng = np.random.default_rng(seed)
    policy = policy or POLICIES[policy_name]()
    if isinstance(policy, ReactiveBound):
        policy.load = load
    fleet = [Replica(created=-STARTUP_S) for _ in range(initial)]
    replica_seconds = 0.0
    sent = rejected = 0
    tokens_sent = tokens_rejected = 0.0
    rejection_seconds: set[int] = set()
    latencies = []
    next_decision = policy.interval
    t = 0.0
    while t < duration:
        step_end = min(duration, next_decision)
        # arrivals in [t, step_end): Poisson per second at the trace's rate
        while t < step_end:
            second_end = min(step_end, math.floor(t) + 1.0)
            rate = load(t) / MEAN_TOKENS
            n = rng.poisson(rate * (second_end - t))
            times = np.sort(rng.uniform(t, second_end, n))
            sizes = rng.lognormal(math.log(MEAN_TOKENS) - 0.18, 0.6, n)
            ready = [r for r in fleet if r.ready(t)]
            for at, size in zip(times, sizes):
                sent += 1
                tokens_sent += size
                if not ready:
                    rejected += 1
                    tokens_rejected += size
                    rejection_seconds.add(int(at))
                    continue
                r = ready[int(rng.integers(len(ready)))]
                r.arrival.add(size, at)
                r.offered_total += size
                snap = Snapshot(CAPACITY, 0.0, int(r.queued(at)), 0.0)
                if not admission.decide(snap, size, POLICY, 1.0).admit:
                    if rejections_at is not None:
                        rejections_at.append((at, len(ready), len(fleet)))
                    rejected += 1
                    tokens_rejected += size
                    rejection_seconds.add(int(at))
                    continue
                start = max(r.busy_until, at)
                r.busy_until = start + size / CAPACITY
                r.work_added_s += size / CAPACITY
                heapq.heappush(r.completions, r.busy_until)
                latencies.append(r.busy_until - at)
            replica_seconds += len(fleet) * (second_end - t)
            t = second_end
        if t >= next_decision:
            desired = policy(fleet, t)
            if desired > len(fleet):
                fleet += [Replica(created=t) for _ in range(desired - len(fleet))]
            elif desired < len(fleet):
                # like a ReplicaSet: unready (starting) pods go first, then the newest
                order = sorted(range(len(fleet)), key=lambda i: (fleet[i].ready(t), fleet[i].created))
                drop = set(order[: len(fleet) - desired])
                fleet = [r for i, r in enumerate(fleet) if i not in drop]
            if replicas_at is not None:
                replicas_at.append((t, len(fleet)))
            next_decision += policy.interval
    lat = np.array(latencies) if latencies else np.zeros(1)
    return {
        "rejected_requests": rejected / max(1, sent),
        "rejected_tokens": tokens_rejected / max(1.0, tokens_sent),
        "seconds_with_rejections": len(rejection_seconds),
        "p99_ms": float(np.percentile(lat, 99) * 1000),
        "replica_seconds": replica_seconds,
        "requests": sent,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = {trace: {name: simulate(trace, name) for name in POLICIES} for trace in TRACES}
    print(f"{'trace':<11}{'policy':<11}{'rej req %':>10}{'rej tok %':>10}{'rej s':>7}{'p99 ms':>8}{'replica-s':>11}{'vs hpa':>8}")
    for trace, by_policy in results.items():
        hpa = by_policy["hpa-util"]
        for name, r in by_policy.items():
            print(f"{trace:<11}{name:<11}{100 * r['rejected_requests']:>10.3f}{100 * r['rejected_tokens']:>10.3f}"
                  f"{r['seconds_with_rejections']:>7}{r['p99_ms']:>8.0f}{r['replica_seconds']:>11.0f}"
                  f"{r['replica_seconds'] / hpa['replica_seconds']:>8.2f}")
    print("\ntargets: rejected <= hpa-util's and <= 1.15x bound's; replica-seconds <= 1.1x hpa-util's")
    ok_all = True
    for trace, by_policy in results.items():
        ours, hpa, bound = by_policy["ours"], by_policy["hpa-util"], by_policy["bound"]
        rej_hpa = ours["rejected_requests"] <= hpa["rejected_requests"]
        rej_bound = ours["rejected_requests"] <= 1.15 * bound["rejected_requests"]
        cost = ours["replica_seconds"] <= 1.1 * hpa["replica_seconds"]
        ok_all &= rej_hpa and rej_bound and cost
        print(f"  {trace:<11} rejected {ours['rejected_requests'] / max(hpa['rejected_requests'], 1e-12):.2f}x hpa "
              f"{'met' if rej_hpa else 'MISSED'}, {ours['rejected_requests'] / max(bound['rejected_requests'], 1e-12):.2f}x "
              f"bound {'met' if rej_bound else 'MISSED'}; replica-seconds "
              f"{ours['replica_seconds'] / hpa['replica_seconds']:.2f}x hpa {'met' if cost else 'MISSED'}")
    print(f"\nsimulated in {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
