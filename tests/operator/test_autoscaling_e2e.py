"""Autoscaling end to end on this machine: kmock as the API server, a small test kubelet that turns
the Deployment's replicas into real server processes (simulated accelerator, each on its own
loopback address, with the ports the operator renders) and posts their Pods, Ready once the
rendered readiness probe passes (on the API port: the service has no guard), the real operator
process scraping them (on the metrics port, scrape.ports), and a load generator offering ~3x one
replica's capacity through all ready pods. The scenario is bench/autoscale_live.py's.

Pass or fail on behaviour only: the count follows the load up, then trims once it is gone. How
much the fleet refuses while it catches up, and whether it settles without a blip, depend on
this VM's speed from one minute to the next (3.9% refused late in the load, and a trim followed
by a rise, each failed a run on a busy VM): the first is measured by `python -m bench.autoscale_live`,
the second is checked on a clock the test controls (test_autoscale_sim.py), and its cause, a held
queue read as backlog, by decide()'s table tests (test_autoscale.py)."""

from __future__ import annotations

import pytest

from bench.autoscale_live import (DEPLOY, HTTP_PORT, LOAD_S, METRICS_PORT, NAME, NS, SIM_RATE, offer_load, start,
                                  texts_and_tokens, timeline)
from tests.operator.conftest import eventually
from tests.operator.emulator import service_path


@pytest.fixture(scope="module")
def fleet(emulator, tmp_path_factory):
    kubelet, op = start(emulator, tmp_path_factory.mktemp("autoscale"))
    yield kubelet, op
    kubelet.halt.set()
    kubelet.join(60)
    op.stop()


def replicas(emulator) -> int:
    return int(emulator.get(DEPLOY)["spec"]["replicas"])


async def test_replicas_follow_offered_load(emulator, fleet, reference):
    kubelet, operator = fleet
    eventually(lambda: kubelet.ready_targets() or kubelet.errors, timeout=60)
    assert kubelet.errors == []
    # No guard: probed (and so made Ready by the test kubelet) on the API port.
    container = emulator.get(DEPLOY)["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["port"] == HTTP_PORT != METRICS_PORT
    assert replicas(emulator) == 1
    texts, counts = texts_and_tokens(reference.tokens)
    outcomes = await offer_load(kubelet, 3 * SIM_RATE, LOAD_S, texts, counts)
    seen = timeline(kubelet, outcomes, LOAD_S)  # said when an assertion fails, not asserted on

    assert {c for _, c in outcomes} <= {"OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}, seen
    # Up: 3x capacity at 80% utilization needs ceil(3.75) = 4.
    assert max(n for _, n in kubelet.replica_history) >= 4, seen
    cr = emulator.get(service_path(NS, NAME))
    assert cr["status"]["desiredReplicas"] >= 4 and cr["status"]["lastScaleTime"], seen
    assert cr["status"]["serviceRateTokensPerSecond"] > 0.5 * SIM_RATE  # real tokens: padding costs < 2x here
    events = [e for e in emulator.get(f"/api/v1/namespaces/{NS}/events")["items"] if e.get("reason") == "Scaled"]
    assert events

    # Load gone: back to min once the 15 s window has passed (and the arrival EMA has decayed).
    eventually(lambda: replicas(emulator) == 1, timeout=60, interval=0.5)
    # Its status is written after the count (on a busy VM, a moment after).
    eventually(lambda: "scale down" in emulator.get(service_path(NS, NAME))["status"]["lastScaleReason"], timeout=15)
