"""decide() table tests: plain numbers, an injected clock."""

import dataclasses

import pytest

from embedop.autoscale import History, PodSample, Policy, Seen, decide, trend

POLICY = Policy(min_replicas=1, max_replicas=20, target_utilization=0.5, target_drain_s=1.0,
                scale_up_stabilization_s=0, scale_down_stabilization_s=60)
CAP = 1000.0  # tokens/s per replica


def pods(n, arrival_each, ready=None, rate=CAP, queued=0.0, scraped=True):
    ready = n if ready is None else ready
    return [PodSample(f"p{i}", i < ready, scraped, rate if i < ready else 0.0,
                      arrival_each if i < ready else 0.0, queued) for i in range(n)]


def run(samples, current, history=History(capacity=CAP), now=1000.0, policy=POLICY):
    return decide(samples, current, policy, history, now)


def test_steady_load_keeps_the_size():
    d = run(pods(4, 500), 4)  # 2000 tok/s offered / (1000 × 0.5) = 4
    assert (d.desired, d.recommendation, d.reason) == (4, 4, "steady")


def test_step_up_x4_reaches_the_right_size_in_one_decision():
    d = run(pods(2, 2000), 2)  # 4000 tok/s → 8 replicas
    assert d.desired == 8 and d.reason.startswith("scale up")


def test_scale_up_is_bounded_per_decision():
    d = run(pods(1, 20_000), 1, policy=Policy(1, 100, 0.5, 1.0, 0, 60))  # needs 40
    assert d.desired == 5  # max(1 × 4, 1 + 4)


def test_backlog_counts_as_demand_to_clear_within_the_target_drain_time():
    # A pod at 50% utilization with a 0.5 s admission budget holds 0.5 × 0.5 s × 1000 = 250
    # tokens of queue in the ordinary way; the rest, 2 × 1750 tokens within 1 s, is 3500 tok/s
    # of demand → 7
    first = run(pods(2, 0, queued=2000), 2)
    assert first.desired == 2  # a first read has nothing to compare with: no backlog yet
    d = run(pods(2, 0, queued=2000), 2, first.history, now=1015.0)
    assert d.desired == 7
    calm = run(pods(2, 500, queued=240), 2, run(pods(2, 500, queued=240), 2).history, now=1015.0)
    assert calm.desired == 2  # an ordinary queue is not demand


def test_the_queue_held_at_target_utilization_scales_with_the_admission_budget():
    """A pod serving its target load with a 1.5 s budget holds a bigger queue, which is no
    reason to grow (the end-to-end fleet trimmed 6 → 4 → 5 on it)."""
    policy = Policy(1, 20, 0.8, 1.0, 0, 60, max_drain_s=1.5)

    def twice(samples):
        return run(samples, 4, run(samples, 4, policy=policy).history, now=1015.0, policy=policy)

    assert twice(pods(4, 750, queued=1000)).desired == 4  # 0.8 × 1.5 × 1000 = 1200
    assert twice(pods(4, 750, queued=2200)).desired == 9  # + 4 × 1000 tok/s


def test_the_queue_held_is_the_share_of_what_each_pod_admits():
    """A pod exports the queue its admission lets grow (the budget less its batcher's reorder
    window); the operator counts backlog beyond its share at target utilization, per pod."""
    policy = Policy(1, 20, 0.8, 1.0, 0, 60, max_drain_s=1.5)

    def twice(queued, limit):
        samples = [dataclasses.replace(s, backlog_limit_s=limit) for s in pods(4, 750, queued=queued)]
        return run(samples, 4, run(samples, 4, policy=policy).history, now=1015.0, policy=policy)

    assert twice(1000, 1.5).desired == 4  # 0.8 × 1.5 × 1000 = 1200 held
    assert twice(1000, 0.75).desired == 6  # 0.8 × 0.75 × 1000 = 600 held: 4 × 400 tok/s more
    assert twice(1000, None).desired == 4  # not exported: the whole budget


def test_a_restarted_operator_does_not_take_one_queue_for_a_backlog():
    """Empty history, five pods at their target with a busy moment's queue: no scale-up."""
    assert run(pods(5, 350, queued=500), 5, History(capacity=CAP), policy=Policy(1, 20, 0.7, 1.0, 0, 60)).desired == 5


def test_capacity_comes_from_pods_that_have_served():
    """New pods report their warm-up's full-row rate until they have served: after a scale-up
    they would be the median and overstate capacity."""
    served = [PodSample(f"old{i}", True, True, 1000.0, 500, busy_seconds=300.0) for i in range(2)]
    fresh = [PodSample(f"new{i}", True, True, 2800.0, 0, busy_seconds=0.1) for i in range(3)]
    d = run(served + fresh, 5, History())
    assert d.capacity == 1000.0


def test_policy_from_spec_reads_the_admission_budget():
    autoscaling = {"minReplicas": 1, "maxReplicas": 4, "targetUtilization": 0.7, "targetDrainTimeMs": 1000,
                   "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 120}
    assert Policy.from_spec(autoscaling, {"maxDrainTimeMs": 1500}).max_drain_s == 1.5
    assert Policy.from_spec(autoscaling).max_drain_s == 0.5


def test_after_a_restart_the_window_holds_the_current_size():
    """An operator restart empties the history: the first decision must not go 4 → 2 at once."""
    fresh = run(pods(4, 250), 4, History(capacity=CAP), policy=Policy(1, 20, 0.5, 1.0, 0, 60))
    assert fresh.recommendation == 2 and fresh.desired == 4 and "window" in fresh.reason
    later = run(pods(4, 250), 4, fresh.history, now=1061.0, policy=Policy(1, 20, 0.5, 1.0, 0, 60))
    assert later.desired == 2  # the window has passed


def test_rejected_demand_counts():
    # arrival_rate is offered load: a shedding fleet of 2 offered 6000 tok/s needs 12
    assert run(pods(2, 3000), 2).desired == 8  # bounded step first ...
    assert run(pods(8, 750), 8).desired == 12  # ... then the rest


def test_capacity_is_robust_to_an_outlier_and_to_a_pod_without_samples():
    samples = pods(4, 500)
    samples[0] = PodSample("slow", True, True, 10.0, 500)  # one pod reports nonsense
    samples[1] = PodSample("new", True, True, 0.0, 500)  # no rate yet
    d = run(samples, 4, History())
    assert d.capacity == CAP and d.desired == 4


def test_noisy_metrics_do_not_flap():
    history, now, sizes = History(capacity=CAP), 0.0, []
    current = 4
    for i in range(60):  # ±20% noise around 2000 tok/s
        noise = 1.2 if i % 2 else 0.8
        d = decide(pods(current, 500 * noise * 4 / current), current, POLICY, history, now)
        history, current, now = d.history, d.desired, now + 15
        sizes.append(current)
    assert len(set(sizes[4:])) == 1  # settles on one size (the window keeps the high one)


def test_scale_down_waits_out_the_window():
    history, now = History(capacity=CAP), 0.0
    d = decide(pods(8, 500), 8, POLICY, history, now)  # 4000 → 8
    history = d.history
    for t in (15, 30, 45):  # load falls to 1000 tok/s: recommendation 2, but the window holds 8
        d = decide(pods(8, 125), 8, POLICY, history, now + t)
        history = d.history
        assert d.desired == 8 and "window" in d.reason
    d = decide(pods(8, 125), 8, POLICY, history, now + 75)  # the 8 has left the 60 s window
    assert d.desired == 2 and d.reason.startswith("scale down")


def test_warming_pods_count_as_capacity_on_its_way():
    # 8 replicas, 2 ready: demand still needs 8 → no further scale-up for pods already coming
    d = run(pods(8, 2000, ready=2), 8)
    assert d.desired == 8


def test_starting_pods_no_longer_needed_are_cancelled_without_waiting_for_the_window():
    history = run(pods(2, 2000), 2).history  # the spike recommended 8
    # pods are starting; the spike is over: 2 ready pods see 400 tok/s each → 2 needed
    d = run(pods(8, 400, ready=2), 8, history, now=1015.0)
    assert d.desired == 2 and d.reason.startswith("cancel 6 starting")
    # but not while demand is still rising: the look-ahead's pods will be needed
    rising = History(capacity=CAP, recommendations=((1000.0, 8),),
                     demand=((970.0, 400.0), (985.0, 600.0), (1000.0, 700.0)))
    d = run(pods(8, 400, ready=2), 8, rising, now=1015.0)  # 800 tok/s now, still up
    assert d.desired == 8 and "window" in d.reason
    # while ready pods are never cut inside the window
    d = run(pods(8, 400), 8, history, now=1015.0)
    assert d.desired == 8 and "window" in d.reason


def test_a_queue_counts_as_demand_only_when_it_persists_between_two_reads():
    calm = run(pods(2, 500, queued=0.0), 2, now=1000.0)
    burst = run(pods(2, 500, queued=2000), 2, calm.history, now=1015.0)
    assert burst.demand == pytest.approx(1000) and burst.desired == 2  # came and went: a busy pod's queue
    stuck = run(pods(2, 500, queued=2000), 2, burst.history, now=1030.0)
    assert stuck.demand == pytest.approx(1000 + 2 * 1750) and stuck.desired == 8  # still there: clear it (×4 step)


def counted(n, totals, rate_gauge=0.0):
    return [PodSample(f"p{i}", True, True, CAP, rate_gauge, 0.0, offered_total=t) for i, t in zip(range(n), totals)]


def test_offered_rate_is_the_counter_increase_over_the_interval_not_the_gauge():
    # The gauge (an EMA read at one instant) says 5000 tok/s per pod; the counters say 15 s at 500.
    first = run(counted(2, [0.0, 0.0], rate_gauge=5000), 2, now=1000.0)
    assert first.offered == 10_000  # nothing to difference yet: the gauge
    d = run(counted(2, [7500.0, 7500.0], rate_gauge=5000), 2, first.history, now=1015.0)
    assert d.offered == pytest.approx(1000) and d.desired == 2  # 1000 / (1000 × 0.5) = 2


def test_a_restarted_or_unscraped_pod_never_yields_a_negative_or_stale_rate():
    h = run(counted(2, [9000.0, 9000.0], rate_gauge=100), 2, now=1000.0).history
    restarted = counted(2, [9000.0 + 3000, 50.0], rate_gauge=100)  # p1's counter started again
    d = run(restarted, 2, h, now=1015.0)
    assert d.offered == pytest.approx(200 + 100)  # p0: 3000 over 15 s; p1: its gauge
    # p1 not scraped at 1030: its counter from 1015 is kept, so at 1045 the rate spans 30 s
    missing = [counted(1, [15_000.0])[0], PodSample("p1", True, False)]
    h2 = run(missing, 2, d.history, now=1030.0).history
    d = run(counted(2, [18_000.0, 50.0 + 30 * 40]), 2, h2, now=1045.0)
    assert d.offered == pytest.approx(200 + 40)


def test_failed_scrapes_hold_and_never_scale_down():
    samples = pods(4, 100)
    samples[3] = PodSample("unreachable", True, False)
    d = run(samples, 4, History(capacity=CAP, recommendations=((0.0, 4),)), now=1000.0)
    assert d.desired == 4 and "could not be read" in d.reason
    # but a blind spot does not stop a scale-up the visible pods already justify
    samples = pods(4, 1000)
    samples[3] = PodSample("unreachable", True, False)
    assert run(samples, 4).desired == 6


@pytest.mark.parametrize("arrival, current, desired", [(0, 3, 3), (10_000, 20, 20)])
def test_clamps(arrival, current, desired):
    policy = Policy(3, 20, 0.5, 1.0, 0, 0)
    assert run(pods(current, arrival), current, policy=policy).desired == desired


def test_zero_traffic_goes_to_min_after_the_window():
    policy = Policy(1, 10, 0.5, 1.0, 0, 0)
    d = run(pods(5, 0), 5, policy=policy)
    assert d.desired == 1


def test_scaling_limited_when_demand_exceeds_max():
    d = run(pods(20, 2000), 20)  # needs 80
    assert d.desired == 20 and d.limited and d.needed == 80


def test_nothing_measured_yet_holds():
    d = run(pods(2, 500, rate=0.0), 2, History())
    assert d.desired == 2 and d.capacity is None


def test_upward_trend_is_forecast_one_startup_ahead():
    history = History(capacity=CAP, startup_s=60.0, demand=((940.0, 1000.0), (955.0, 1500.0), (970.0, 2000.0), (985.0, 2500.0)))
    d = run(pods(6, 500), 6, history)  # demand 3000 now, rising 33 tok/s per s → 5000 in 60 s,
    assert d.forecast == pytest.approx(3750, rel=0.01)  # but look-ahead adds at most 25%
    assert d.desired == 8
    gentle = History(capacity=CAP, startup_s=60.0, demand=((940.0, 2850.0), (955.0, 2900.0), (970.0, 2950.0)))
    assert run(pods(6, 500), 6, gentle).forecast == pytest.approx(3000 + 60 * 50 / 15, rel=0.01)
    falling = History(capacity=CAP, demand=((940.0, 5000.0), (955.0, 4500.0), (970.0, 4000.0)))
    assert run(pods(6, 500), 6, falling).forecast == pytest.approx(3000)  # upward only


def test_trend():
    assert trend(((0, 0), (1, 2), (2, 4))) == pytest.approx(2)
    assert trend(((0, 5), (1, 5))) == 0
    assert trend(((0, 100), (1, 140), (2, 90), (3, 150), (4, 100))) == 0  # jitter is not a trend


def test_a_surge_whose_demand_has_gone_is_released_without_waiting_for_the_window():
    """A spike calls 8 pods; it is over when they are ready (or soon after): two low decisions
    in a row take the fleet back to its size before the surge, not 60 s later."""
    d = run(pods(2, 2000), 2, now=1000.0)  # the spike: 2 → 8
    assert d.desired == 8
    low = run(pods(8, 125), 8, d.history, now=1015.0)  # all ready, the spike gone: 1000 tok/s
    assert low.desired == 8 and "window" in low.reason  # one low read is not enough
    gone = run(pods(8, 125), 8, low.history, now=1030.0)
    assert gone.desired == 2 and "surge is over" in gone.reason
    # A partial drop is not the end of the surge: the window applies.
    partial = run(pods(8, 400), 8, low.history, now=1030.0)  # 3200 tok/s: 7 needed, more than 2
    assert partial.desired == 8 and "window" in partial.reason


def test_capacity_that_has_served_out_the_window_is_no_surge():
    d = run(pods(2, 2000), 2, now=1000.0)
    steady = run(pods(8, 500), 8, d.history, now=1070.0)  # 61+ s later: the 8 are established
    low = run(pods(8, 125), 8, steady.history, now=1085.0)
    low = run(pods(8, 125), 8, low.history, now=1100.0)
    assert low.desired == 8 and "window" in low.reason


def test_a_lull_inside_a_step_keeps_the_surge():
    """A quiet ten seconds within a step is not the end of the demand that called the pods (with
    90 s start-ups, letting them go would cost a start-up each when the load comes back)."""
    h = History(capacity=CAP, startup_s=90.0)
    d = run(pods(2, 2000), 2, h, now=1000.0)  # the step: 2 → 8
    steady = run(pods(8, 500), 8, d.history, now=1005.0)
    lull = run(pods(8, 125), 8, steady.history, now=1010.0)
    lull = run(pods(8, 125), 8, lull.history, now=1015.0)
    assert lull.desired == 8  # 10 s < a quarter of the 90 s start-up
    back = run(pods(8, 500), 8, lull.history, now=1020.0)
    assert back.desired == 8 and back.history.surge.low_since is None


def test_serving_pods_that_turn_unready_hold_the_fleet():
    """The death spiral: 8 pods at 93% of target, 3 turn unready under load (readiness timeouts)
    while their connections still carry load, and nothing can be read from them. They served:
    they are blind, not starting; the fleet holds (it used to go 8 → 5, the ReplicaSet deleting
    exactly those pods)."""
    policy = Policy(1, 20, 0.7, 1.0, 0, 60)
    history, now = History(capacity=CAP), 1000.0
    for _ in range(6):  # settled at 8: 8 × 650 = 5200 tok/s needs ceil(5200 / 700) = 8
        d = decide(pods(8, 650), 8, policy, history, now)
        history, now = d.history, now + 5
    assert d.desired == 8
    for _ in range(6):
        samples = pods(8, 650)
        samples[5:] = [PodSample(f"p{i}", False, False, served=True) for i in range(5, 8)]
        d = decide(samples, 8, policy, history, now)
        history, now = d.history, now + 5
        assert d.desired == 8 and "unready" in d.reason, d.reason


def test_an_unready_pod_that_still_answers_counts_its_demand():
    samples = pods(4, 1000)  # 4000 tok/s at 0.5 → 8
    samples[3] = dataclasses.replace(samples[3], ready=False, served=True)
    assert run(samples, 4).desired == 8


def test_after_an_operator_restart_starting_pods_are_not_cancelled_on_one_read():
    """No trend yet is not a falling one: the pods a scale-up ordered before the restart stay."""
    d = run(pods(8, 400, ready=2), 8, History(capacity=CAP))
    assert d.desired == 8


def test_a_step_in_demand_is_not_extrapolated():
    """3,500 tok/s after a step on 1,000 tok/s pods at 0.7: ceil(3500 / 700) = 5, and it stays 5
    (the trend fitted over a window holding the step used to add a start-up's worth: 7)."""
    policy = Policy(1, 20, 0.7, 1.0, 0, 120)
    history, now, current = History(capacity=CAP, startup_s=60.0), 1000.0, 1
    for _ in range(4):
        d = decide(pods(current, 400 / current), current, policy, history, now)
        history, current, now = d.history, d.desired, now + 15
    sizes = []
    for _ in range(12):  # three minutes of a flat 3,500 tok/s, new pods ready at once
        d = decide(pods(current, 3500 / current), current, policy, history, now)
        history, current, now = d.history, d.desired, now + 15
        sizes.append(current)
    assert set(sizes) == {5}, sizes


def test_a_pod_start_up_is_measured_once():
    """A pod whose readiness flapped reports its last flap as its Ready time: its start-up stays
    as first measured."""
    first = [dataclasses.replace(s, startup_s=40.0) for s in pods(2, 500)]
    d = run(first, 2, History(capacity=CAP))
    assert d.history.startup_s == 40.0
    flapped = [dataclasses.replace(s, startup_s=3600.0) for s in pods(2, 500)]
    assert run(flapped, 2, d.history, now=1015.0).history.startup_s == 40.0


def test_a_pod_seen_ready_that_restarts_is_not_cancelled_as_starting():
    """A container that crashes (CUDA OOM) and restarts shows neither Ready nor started: the pods a
    decision has seen Ready stay served, and the fleet holds rather than cancel them."""
    policy = Policy(1, 20, 0.7, 1.0, 0, 60)
    d = decide(pods(8, 650), 8, policy, History(capacity=CAP), 1000.0)
    samples = pods(8, 650)
    samples[5:] = [PodSample(f"p{i}", False, False) for i in range(5, 8)]  # nothing shows they served
    for now in (1005.0, 1010.0, 1015.0):
        d = decide(samples, 8, policy, d.history, now)
        assert d.desired == 8, d.reason


def test_a_step_inside_an_interval_is_not_extrapolated():
    """Demand is each interval's mean: a step that lands inside one reads old → partial → full,
    two rises. 400 → 3,500 tok/s on 1,000 tok/s pods at 0.7 still goes to 5, not 7."""
    policy = Policy(1, 20, 0.7, 1.0, 0, 120)
    history, now, current = History(capacity=CAP, startup_s=60.0), 1000.0, 1
    for load in (400, 400, 400, 1950, 3500, 3500, 3500, 3500):
        d = decide(pods(current, load / current), current, policy, history, now)
        history, current, now = d.history, d.desired, now + 15
    assert current == 5 and d.forecast == pytest.approx(3500)


def test_a_saturating_step_is_not_extrapolated_either():
    """A step past one pod's capacity leaves a backlog, counted from its second read: a third rise
    after old → partial → full. The latest reads then rise far faster than the window's fit."""
    policy = Policy(1, 20, 0.7, 1.0, 0, 120)
    history = History(capacity=CAP, startup_s=60.0)
    for t, v in ((940.0, 400.0), (955.0, 400.0), (970.0, 1950.0), (985.0, 3500.0)):
        history = dataclasses.replace(history, demand=history.demand + ((t, v),))
    history = dataclasses.replace(history, pods=(Seen("p0", 985.0, None, 3000.0),))  # its queue, read before
    d = decide(pods(1, 3500, queued=3000), 1, policy, history, 1000.0)
    assert d.demand > 3500  # the backlog counts, to be cleared ...
    assert d.forecast == pytest.approx(d.demand)  # ... but is no trend: 400 → 1950 → 3500 → 3500 + backlog


def test_a_long_interval_still_looks_ahead_on_a_ramp():
    """intervalSeconds 30: the trend's window stretches to hold four reads."""
    history = History(capacity=CAP, startup_s=60.0, demand=((910.0, 1000.0), (940.0, 1500.0), (970.0, 2000.0)))
    d = run(pods(6, 2500 / 6), 6, history)
    assert d.forecast > d.demand


def started_pod(name: str, startup_s: float) -> dict:
    """A Pod as the API keeps it: created, started, and Ready `startup_s` after its creation."""
    t = lambda s: f"2026-01-01T00:{int(s) // 60:02d}:{int(s) % 60:02d}Z"
    return {"metadata": {"name": name, "creationTimestamp": t(0)},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "startTime": t(1),
                       "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": t(startup_s)}],
                       "containerStatuses": [{"name": "server", "started": True, "restartCount": 0,
                                              "state": {"running": {"startedAt": t(2)}}}]}}


def test_a_fleet_that_starts_warm_looks_less_far_ahead():
    """The same sustained ramp (3% per 15 s read) on two fleets of 6 pods, one whose pods were
    Ready 8 s after creation (a warm start: cached model, reused warm-up), one 40 s (cold): the
    start-up each decision uses is the one measured from the pods' timestamps, and the warm fleet's
    forecast adds a start-up's worth of trend that much smaller, so it starts fewer pods ahead."""
    from embedop.scrape import pod_view

    def fleet(startup_s):
        views = [pod_view(started_pod(f"p{i}", startup_s)) for i in range(6)]
        assert {v.startup_s for v in views} == {startup_s}
        return lambda demand: [PodSample(v.name, True, True, CAP, demand / 6, startup_s=v.startup_s) for v in views]

    decided = {}
    for startup_s in (8.0, 40.0):
        pods_at, history, now, demand = fleet(startup_s), History(capacity=CAP), 1000.0, 2650.0
        for _ in range(6):
            d = decide(pods_at(demand), 6, POLICY, history, now)
            history, now, demand = d.history, now + 15, demand * 1.03
        assert d.history.startup_s == startup_s  # measured, not DEFAULT_STARTUP_S
        decided[startup_s] = d
    warm, cold = decided[8.0], decided[40.0]
    assert warm.demand == pytest.approx(cold.demand)
    slope = (cold.forecast - cold.demand) / (40.0 + 15)  # the trend, looked ahead over start-up + interval
    assert slope > 0 and warm.forecast - warm.demand == pytest.approx(slope * (8.0 + 15), rel=1e-6)
    assert warm.desired < cold.desired, (warm.desired, cold.desired)


def hot_fleet(n: int, policy: Policy, now: float = 1000.0):
    """n pods read at 700 tok/s each on 1,000 tok/s pods: at a 0.7 target, each at it."""
    d = decide(pods(n, 700), n, policy, History(capacity=CAP), now)
    assert d.desired == n
    return d.history


def timing_out(names, timed_out=True):
    return [PodSample(name, True, False, timed_out=timed_out) for name in names]


def test_a_fleet_too_busy_to_answer_grows_by_the_step_until_readings_return():
    """Every scrape of 8 pods at their target times out on connections they took: the overload
    that starves their /metrics. Held, they stayed 8 for as long as it lasted; saturated, each
    counts as 4 replicas' worth: the usual step (×4), then no more while those pods start (they
    are capacity on its way), and once they are ready and the 8 still cannot answer, the step again."""
    policy = Policy(1, 200, 0.7, 1.0, 0, 60)
    history = hot_fleet(8, policy)
    names = [f"p{i}" for i in range(8)]
    d = decide(timing_out(names), 8, policy, history, 1005.0)
    assert d.desired == 32 and "8 pod(s) saturated" in d.reason, d.reason
    starting = [PodSample(f"new{i}", False, False) for i in range(24)]
    d = decide(timing_out(names) + starting, 32, policy, d.history, 1010.0)
    assert d.desired == 32, d.reason
    # Ready, and busy themselves: read at target. The 8 still do not answer.
    ready = [PodSample(f"new{i}", True, True, CAP, 700) for i in range(24)]
    d = decide(timing_out(names) + ready, 32, policy, d.history, 1015.0)
    assert d.desired == 24 + 32, d.reason
    # Readings return: the count follows them (a scale-down waits out its window, as always).
    back = [PodSample(name, True, True, CAP, 300) for name in names] + [PodSample(f"new{i}", True, True, CAP, 300) for i in range(24)]
    d = decide(back, 56, policy, d.history, 1020.0)
    assert d.desired == 56 and "window" in d.reason, d.reason


@pytest.mark.parametrize("case", ["refused", "cool", "never read", "gone"])
def test_a_pod_that_cannot_be_read_otherwise_stays_blind(case):
    """A refused scrape (nothing binds the port: a restart, an old image), a timeout on a pod last
    read below its target, on a pod never read, or a pod gone: the count holds, as before."""
    policy = Policy(1, 200, 0.7, 1.0, 0, 60)
    history = hot_fleet(8, policy) if case != "cool" else decide(pods(8, 300), 8, policy, History(capacity=CAP), 1000.0).history
    names = [f"p{i}" for i in range(8)]
    samples = {
        "refused": timing_out(names, timed_out=False),
        "cool": timing_out(names),
        "never read": timing_out([f"q{i}" for i in range(8)]),
        "gone": pods(7, 100) + [],  # p7 is gone; the others read low
    }[case]
    current = 7 if case == "gone" else 8
    d = decide(samples, current, policy, history, 1005.0)
    assert d.desired <= current and "saturated" not in d.reason, d.reason
    if case != "gone":
        assert d.desired == 8 and "could not be read" in d.reason


def test_only_the_pods_to_remove_are_marked_and_stale_marks_are_cleared():
    """The Ready pods read with the least queued work, as many as go beyond the pods not Ready
    (which the ReplicaSet takes first), get int32's least cost and our mark; every other pod keeps
    its template's cost, so an idle pod that stays is not one that goes; a mark left by a dropped
    decision goes from a pod that stays; nothing is written where nothing changes."""
    from embedop.autoscale import DELETION_COST, REMOVAL_COST, REMOVAL_MARK, removal_marks

    go = {DELETION_COST: REMOVAL_COST, REMOVAL_MARK: "true"}
    samples = [PodSample(f"p{i}", True, True, CAP, 100, queued) for i, queued in enumerate((0, 100.4, 300, 9e12))]
    plain = {s.name: {} for s in samples}
    assert removal_marks(samples, plain, 2, None) == {"p0": go, "p1": go}
    assert removal_marks(samples, {**plain, "p0": dict(go)}, 2, None) == {"p1": go}  # p0 is marked already
    # A dropped decision's marks: cleared where the pod stays, to the template's cost (or none).
    stale = {**plain, "p2": {**go, "other": "x"}}
    assert removal_marks(samples, stale, 1, None) == {"p0": go, "p2": {DELETION_COST: None, REMOVAL_MARK: None}}
    assert removal_marks(samples, stale, 0, "5") == {"p2": {DELETION_COST: "5", REMOVAL_MARK: None}}
    assert removal_marks(samples, plain, 0, None) == {}  # at rest: nothing
    # Two starting pods: the ReplicaSet removes those first, whatever the costs.
    starting = [PodSample(f"s{i}", False, False) for i in range(2)]
    both = {**plain, "s0": {}, "s1": {}}
    assert removal_marks(samples + starting, both, 2, None) == {}
    assert removal_marks(samples + starting, both, 3, None) == {"p0": go}
    # Pods not read (their load unknown) and pods being deleted (left out of `annotations`) are not marked.
    blind = [PodSample("b", True, False)] + samples[1:]
    assert removal_marks(blind, {"b": {}, "p1": {}, "p2": {}}, 1, None) == {"p1": go}
