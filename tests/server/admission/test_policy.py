"""Both admission strategies as pure decisions, and the health status they imply."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedserve.admission.policy import Policy, decide, status, still_sustained
from embedserve.admission.estimator import Snapshot

POLICY = Policy(throughput=True, latency=True, max_drain_s=0.5, latency_soft_s=0.2, latency_hard_s=1.0)


def snap(queued=0, rate=1000.0, p95=0.0):
    return Snapshot(service_rate=rate, arrival_rate=0.0, queued_tokens=queued, p95_latency_s=p95)


@pytest.mark.parametrize(
    "queued, cost, admit",
    [
        (0, 10_000, True),  # an empty queue admits even a request larger than the budget
        (400, 100, True),
        (499, 10_000, True),  # the work ahead is within 0.5 s: admitted whatever its own size
        (500, 1, False),  # no room ahead of it
        (700, 100, False),
    ],
)
def test_throughput_strategy_predicts_the_drain_time(queued, cost, admit):
    d = decide(snap(queued), cost, POLICY, draw=0.99)
    assert d.admit is admit
    if not admit:
        # Scheduled, not dropped: told the moment the queue ahead drains below the 0.5 s
        # budget, and its room is booked.
        assert d.reason == "drain_time" and d.book
        assert d.retry_after_ms == max(1, queued - 500)


@given(queued=st.floats(0, 2000), small=st.floats(1, 512), large=st.floats(1, 20_000),
       reserved=st.floats(0, 5000))
def test_admission_does_not_depend_on_the_requests_own_size(queued, small, large, reserved):
    # Under overload the queue hovers at its limit: a rule that asked a request's own tokens to
    # fit let every short request into the room a batch frees and refused long ones almost
    # always (the accepted mix had half the offered tokens per request).
    a = decide(snap(queued), small, POLICY, 0.99, reserved)
    b = decide(snap(queued), large, POLICY, 0.99, reserved)
    assert (a.admit, a.retry_after_ms, a.book) == (b.admit, b.retry_after_ms, b.book)


def test_booked_room_waits_ahead_of_a_new_request():
    d = decide(snap(500), 100, POLICY, 0.99, reserved_tokens=1000)
    assert not d.admit and d.book
    assert d.retry_after_ms == 1000  # 500 queued + 1000 booked ahead, past the budget's end, at 1000/s


def test_booked_room_does_not_refuse_what_the_present_queue_can_take():
    # Work-conserving: bookings whose owners never come back must not idle the device.
    assert decide(snap(100), 100, POLICY, 0.99, reserved_tokens=1_000_000).admit


def test_past_the_horizon_a_burst_is_told_when_booking_is_possible_again():
    policy = Policy(True, False, 0.5, 0.2, 1.0, horizon_s=10.0)
    d = decide(snap(500), 100, policy, 0.99, reserved_tokens=20_000, over_for_s=9.9)
    assert not d.admit and not d.book  # a flood cannot book the future
    assert (d.reason, d.retry_after_ms, d.final) == ("drain_time", 10_000, False)  # wait 20 s; back at 10
    assert decide(snap(500), 100, policy, 0.99, reserved_tokens=9_000, over_for_s=60).book


def test_past_the_horizon_after_a_horizon_of_excess_demand_the_overload_is_sustained():
    policy = Policy(True, False, 0.5, 0.2, 1.0, horizon_s=10.0)
    d = decide(snap(500), 100, policy, 0.99, reserved_tokens=20_000, over_for_s=10.0)
    assert (d.admit, d.book, d.reason, d.final) == (False, False, "sustained", True)
    assert d.retry_after_ms == 10_000  # a back-off for clients that retry anyway


def test_under_sustained_overload_a_request_that_would_fit_the_horizon_books_nothing():
    policy = Policy(True, False, 0.5, 0.2, 1.0, horizon_s=10.0)
    d = decide(snap(600), 100, policy, 0.99, sustained=True)
    assert (d.admit, d.book, d.reason, d.final) == (False, False, "sustained", True)
    assert decide(snap(100), 100, policy, 0.99, sustained=True).admit  # room now: work-conserving


def test_booking_off_says_when_there_will_be_room():
    policy = Policy(True, False, 0.5, 0.2, 1.0, horizon_s=0.0)
    d = decide(snap(700), 100, policy, 0.99, sustained=True, over_for_s=60)
    assert (d.admit, d.book, d.reason, d.retry_after_ms, d.final) == (False, False, "drain_time", 200, False)


@pytest.mark.parametrize(
    "was, arrival, still",
    [
        (False, 5000.0, False),  # it starts only from a decision (a full horizon, a horizon of excess)
        (True, 1000.0, True),  # arriving as fast as served: a lull between refusals changes nothing
        (True, 901.0, True),  # a dip of the averages is not the end
        (True, 899.0, False),  # demand clearly below capacity: booking again
    ],
)
def test_sustained_overload_lasts_until_demand_falls_clearly_below_capacity(was, arrival, still):
    assert still_sustained(arrival, 1000.0, was) is still


def test_the_reorder_window_is_held_back():
    policy = Policy(True, False, 0.5, 0.2, 1.0, reorder_s=0.1)  # 100 tokens at 1000/s
    assert decide(snap(399), 100, policy, 0.99).admit  # 399 ahead < 0.5 s - 0.1 s
    d = decide(snap(400), 100, policy, 0.99)
    assert not d.admit and d.retry_after_ms == 1


def test_throughput_strategy_can_be_disabled():
    off = Policy(False, False, 0.5, 0.2, 1.0)
    assert decide(snap(100_000), 100, off, 0.0).admit


def test_unknown_service_rate_with_a_backlog_refuses():
    d = decide(snap(queued=10, rate=0.0), 10, POLICY, 0.99)
    assert not d.admit and d.retry_after_ms >= 1


def test_latency_hard_rejects_everything_soft_sheds_a_quarter():
    assert decide(snap(p95=1.5), 1, POLICY, draw=0.99).reason == "latency_hard"
    rng = random.Random(42)
    draws = 20_000
    shed = sum(not decide(snap(p95=0.5), 1, POLICY, rng.random()).admit for _ in range(draws))
    assert shed / draws == pytest.approx(0.25, abs=0.01)
    assert decide(snap(p95=0.1), 1, POLICY, draw=0.0).admit


def test_latency_recovery_once_the_window_empties():
    # With nothing admitted, the time window empties and P95 reads 0: admission resumes.
    assert not decide(snap(p95=1.5), 1, POLICY, 0.5).admit
    assert decide(snap(p95=0.0), 1, POLICY, 0.5).admit


@pytest.mark.parametrize(
    "s, ready, rejecting, expected",
    [
        (snap(), False, False, "starting"),
        (snap(), True, False, "healthy"),
        (snap(queued=450), True, False, "degraded"),  # 0.45 s of 0.5 s
        (snap(p95=0.19), True, False, "degraded"),
        (snap(), True, True, "overloaded"),
    ],
)
def test_status(s, ready, rejecting, expected):
    assert status(s, POLICY, ready, rejecting) == expected


def test_degraded_is_near_the_queue_admitted_at_once():
    """The queue never exceeds the budget less the reorder window: "degraded" is near that."""
    windowed = Policy(True, False, 0.5, 0.2, 1.0, reorder_s=0.25)
    assert status(snap(queued=190), windowed, True, False) == "healthy"
    assert status(snap(queued=210), windowed, True, False) == "degraded"  # 0.21 s of 0.25 s

