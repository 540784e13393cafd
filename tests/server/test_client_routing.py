"""The Client's routing decisions (embedserve.client_routing) and how it reads targets
(embedserve.client_pods.parse_target): pure functions, checked on their own."""

import random
from collections import Counter

import pytest

from embedserve.client_pods import Target, parse_target
from embedserve.client_routing import (
    AGE_HALF_LIFE_S, FORGET_S, HEDGE_BURST, HEDGE_MARGIN_S, PodView, aged_drain_ms, better, drain_ms, hedge_delay_s,
    hedge_tokens, may_hedge, pick,
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
    assert hedge_delay_s(None, 0.0, 30.0) == pytest.approx(HEDGE_MARGIN_S)
    assert hedge_delay_s(500.0, 0.0, 30.0) == pytest.approx(1.0 + HEDGE_MARGIN_S)
    assert hedge_delay_s(500.0, 0.0, 1.2) is None  # no deadline left for a second try
    assert hedge_delay_s(500.0, 0.0, None) is not None  # no deadline: any time is in time
    assert hedge_delay_s(1e9, 0.0, 30.0) is None  # the pod knows no rate: its estimate says nothing


def test_hedges_are_a_tenth_of_calls_after_a_burst():
    tokens, hedges = HEDGE_BURST, 0
    for _ in range(1000):
        tokens = hedge_tokens(tokens)
        if may_hedge(tokens):
            tokens -= 1
            hedges += 1
    assert HEDGE_BURST + 90 <= hedges <= HEDGE_BURST + 101


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
