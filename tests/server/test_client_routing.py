"""The Client's routing decisions (embedserve.client_routing) and how it reads targets
(embedserve.client_pods.parse_target): pure functions, checked on their own."""

import gc
import os
import random
import signal
import threading
import time
from collections import Counter

import pytest

from embedserve import client_routing
from embedserve.client_pods import Target, parse_target
from embedserve.client_routing import (
    AGE_HALF_LIFE_S, FORGET_S, HEDGE_MARGIN_S, MAX_TOKENS, PodView, RetryBudget, aged_drain_ms, better,
    budget_for, drain_ms, hedge_delay_s, latency_after, load_ms, pick,
)


def test_an_estimate_halves_each_half_life_and_is_forgotten_after_a_few_seconds():
    assert aged_drain_ms(800.0, 0.0) == 800.0
    assert aged_drain_ms(800.0, AGE_HALF_LIFE_S) == pytest.approx(400.0)
    assert aged_drain_ms(800.0, FORGET_S) is None
    assert aged_drain_ms(None, 0.0) is None


def test_the_lower_drain_wins_and_near_equal_drains_go_to_fewer_calls_in_flight():
    assert better(PodView(900.0, 0.0, 0), PodView(10.0, 0.0, 5)) == 1
    assert better(PodView(10.0, 0.0, 0), PodView(900.0, 0.0, 0)) == 0
    assert better(PodView(2.0, 0.0, 4), PodView(4.0, 0.0, 1)) == 1  # within the tie: in flight decides
    assert better(PodView(100.0, 0.0, 3), PodView(110.0, 0.0, 0)) == 1  # 10 % apart is noise
    assert better(PodView(None, 0.0, 0), PodView(50.0, 0.0, 0)) == 0  # unknown counts as idle: tried


def test_a_slow_pod_left_alone_is_tried_again_once_its_estimate_has_aged():
    slow, fast = 2000.0, 20.0
    assert better(PodView(slow, 0.5, 0), PodView(fast, 0.0, 0)) == 1
    assert better(PodView(slow, FORGET_S, 0), PodView(fast, 0.0, 0)) == 0


def test_round_robin_while_nothing_is_known_then_the_better_of_two():
    rng = random.Random(1)
    unknown = [PodView(None, 0.0, 0)] * 3
    assert [pick(unknown, turn, rng) for turn in range(6)] == [0, 1, 2, 0, 1, 2]
    pods = [PodView(500.0, 0.0, 0), PodView(0.0, 0.0, 0), PodView(500.0, 0.0, 0)]
    picks = Counter(pick(pods, turn, rng) for turn in range(3000))
    # Pod 1 wins whenever it is one of the two drawn: 2 of the 3 pairs.
    assert picks[1] / 3000 == pytest.approx(2 / 3, abs=0.04)
    assert pick([PodView(9e8, 0.0, 9)], 0, rng) == 0
    with pytest.raises(ValueError):
        pick([], 0, rng)


def test_a_try_is_hedged_after_its_pods_estimate_and_a_margin_within_the_deadline():
    idle, busy = PodView(None, 0.0, 0), PodView(500.0, 0.0, 0)
    assert hedge_delay_s(idle, None, 30.0) == pytest.approx(HEDGE_MARGIN_S)
    assert hedge_delay_s(busy, None, 30.0) == pytest.approx(1.0 + HEDGE_MARGIN_S)
    assert hedge_delay_s(busy, None, 1.2) is None  # no deadline left for a second try
    assert hedge_delay_s(busy, None, None) is not None  # no deadline: any time is in time
    assert hedge_delay_s(PodView(1e9, 0.0, 0), None, 30.0) is None  # the pod knows no rate: its estimate says nothing


def test_a_request_that_usually_takes_long_is_not_late_for_taking_long():
    """Calls of 0.6 s on an idle pod (big requests): hedged only well past what they take, not
    after a fixed quarter second; calls of a few ms: not before the margin (below it a hedge
    mostly duplicates a call about to answer)."""
    big = None
    for sample in (0.6, 0.62, 0.58, 0.61, 0.6, 0.59):
        big = latency_after(big, sample)
    assert 0.6 < hedge_delay_s(PodView(0.0, 0.0, 0), big, 30.0) < 1.0
    small = None
    for _ in range(20):
        small = latency_after(small, 0.004)
    assert hedge_delay_s(PodView(0.0, 0.0, 0), small, 30.0) == pytest.approx(HEDGE_MARGIN_S)
    assert latency_after(None, 0.2) == (0.2, 0.1)  # RFC 6298's first sample
    mean, deviation = latency_after((0.2, 0.1), 0.6)
    assert mean == pytest.approx(0.25) and deviation == pytest.approx(0.175)


def test_a_pod_keeping_our_calls_unanswered_counts_as_that_far_behind_and_does_not_fade():
    """A frozen pod said "idle" before it froze: its estimate must not stay 0, nor fade to
    "unknown" while our calls there wait, else it keeps getting calls."""
    frozen = PodView(0.0, 2.0, 1, 1.5)
    assert load_ms(frozen) == pytest.approx(1500.0)
    assert better(frozen, PodView(80.0, 0.0, 3, 0.05)) == 1
    assert load_ms(PodView(800.0, 3.0, 1, 0.01)) == 800.0  # not halved thrice: news is on its way
    assert load_ms(PodView(800.0, 3.0, 0)) == pytest.approx(100.0)  # none there: it fades
    assert load_ms(PodView(None, 0.0, 1, 0.2)) == pytest.approx(200.0)  # never heard, but waited on
    assert load_ms(PodView(0.0, 0.0, 1, 0.015, 0.02)) == 0.0  # a call within its usual time says nothing
    assert load_ms(PodView(0.0, 0.0, 1, 1.02, 0.02)) == pytest.approx(1000.0)  # one overdue by a second does
    rng = random.Random(2)
    assert all(pick([PodView(None, 0.0, 0), PodView(None, 9.0, 1, 2.0)], t, rng) == 0 for t in range(20))


def test_retries_and_hedges_are_a_tenth_of_successful_calls_after_a_burst_of_half_the_tokens():
    """gRPC's retry throttling: full at start, 1 spent per retry or hedge while above half."""
    budget = RetryBudget()
    burst = 0
    while budget.spend():
        burst += 1
    assert burst == MAX_TOKENS / 2 == 10
    assert not budget.allows() and budget.tokens == MAX_TOKENS / 2  # a refused spend takes nothing
    spent = 0
    for _ in range(1000):  # every call succeeds and asks for a hedge
        budget.succeeded()
        spent += budget.spend()
    assert 90 <= spent <= 101


def test_failures_alone_earn_nothing():
    """Calls that keep failing are not a reason to retry more: only successes refill the budget
    (a Client that refilled on every try let each retry pay for the next)."""
    budget = RetryBudget()
    spent = sum(budget.spend() for _ in range(1000))
    assert spent == 10
    for _ in range(10):
        budget.succeeded()
    assert budget.spend() and not budget.spend()


def test_the_budget_is_one_per_target_for_the_whole_process():
    assert budget_for("dns:///a.test:50051") is budget_for("dns:///a.test:50051")
    assert budget_for("dns:///a.test:50051") is not budget_for("dns:///b.test:50051")


async def test_one_target_spelled_two_ways_is_one_budget():
    from embedserve.client import Client

    clients = [Client(t) for t in ("pods.test:50051", "dns:///pods.test:50051")]
    clients += [Client(t, routing="round-robin") for t in ("127.0.0.1:50051", "ipv4:127.0.0.1:50051")]
    try:
        assert clients[0].retry_budget is clients[1].retry_budget
        assert clients[2].retry_budget is clients[3].retry_budget is not clients[0].retry_budget
    finally:
        for client in clients:
            await client.close()


def test_budgets_of_targets_no_client_uses_are_kept_only_while_spent():
    """A process that talks to ever new targets does not keep a budget per target it ever saw:
    a full budget no Client holds equals a new one and is dropped; a spent one is kept (the next
    Client of that target must find it spent) until successes have refilled it."""
    for i in range(1000):
        budget_for(f"dns:///pod-{i}.test:50051")
    gc.collect()
    assert len(client_routing._budgets) == 0
    spent = budget_for("dns:///spent.test:50051")
    assert spent.spend()
    spent_id = id(spent)
    del spent
    gc.collect()
    again = budget_for("dns:///spent.test:50051")
    assert id(again) == spent_id and again.tokens == MAX_TOKENS - 1
    for _ in range(10):
        again.succeeded()
    del again
    gc.collect()
    assert len(client_routing._budgets) == 0


def test_a_child_process_after_fork_gets_budgets_of_its_own_even_with_the_lock_held():
    """A thread of the parent holding the registry's lock at the fork: the child's copy of the
    lock stays held forever, and its first Client hung making its budget."""
    holding, release = threading.Event(), threading.Event()

    def hold():
        with client_routing._budgets_lock:
            holding.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        holding.wait()
        pid = os.fork()
        if pid == 0:  # the child: its budget, or SIGALRM's default action ends it
            signal.alarm(5)
            budget_for("dns:///child.test:50051")
            os._exit(0)
        deadline = time.monotonic() + 10
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if status[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert status[0] == pid and os.waitstatus_to_exitcode(status[1]) == 0, status
    finally:
        release.set()
        holder.join()


@pytest.mark.parametrize("max_tokens, ratio", [(0, 0.1), (1001, 0.1), (10, 0), (10, 1.5)])
def test_a_budget_outside_grpcs_bounds_is_refused(max_tokens, ratio):
    with pytest.raises(ValueError, match="retryThrottling"):
        RetryBudget(max_tokens, ratio)


@pytest.mark.parametrize("metadata, ms", [
    ((("embedfleet-drain-ms", "12.5"),), 12.5), ((), None), ((("embedfleet-drain-ms", "x"),), None),
    ((("embedfleet-drain-ms", "nan"),), None), ((("embedfleet-drain-ms", "-1"),), None), (None, None),
])
def test_the_estimate_is_read_from_trailing_metadata(metadata, ms):
    assert drain_ms(metadata) == ms


@pytest.mark.parametrize("target, parsed", [
    ("dns:///pods.ns:50051", Target("pods.ns", 50051, (), None)),
    ("dns://127.0.0.1:5353/pods.test:50051", Target("pods.test", 50051, (), ("127.0.0.1", 5353))),
    ("dns://10.0.0.10/pods:50051", Target("pods", 50051, (), ("10.0.0.10", 53))),
    ("embedfleet:50051", Target("embedfleet", 50051, (), None)),
    ("localhost", Target("localhost", 443, (), None)),
    ("127.0.0.1:50051", Target("", 50051, ("127.0.0.1",), None)),
    ("[::1]:50051", Target("", 50051, ("::1",), None)),
    ("ipv4:127.0.0.1:7,127.0.0.2:7", Target("", 7, ("127.0.0.1", "127.0.0.2"), None)),
    ("ipv6:[::1]:7,[::2]:7", Target("", 7, ("::1", "::2"), None)),
    ("ipv4:127.0.0.1:7,127.0.0.2:8", None),  # two ports: left to gRPC's own channel
    ("unix:/tmp/socket", None),
])
def test_targets_are_read_as_grpc_reads_them(target, parsed):
    assert parse_target(target) == parsed


def test_the_authority_is_the_targets_name():
    assert parse_target("dns:///pods.ns:50051").authority == "pods.ns:50051"
    assert parse_target("[::1]:7").authority == "[::1]:7"
