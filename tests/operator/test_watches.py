"""The operator reads its own objects from label-selected watches and nothing else, and a settled
fleet costs the API nothing: the real operator process against the emulator, which (like a real
API server) applies label selectors server-side and drops empty env values when it stores a
Deployment. The cluster also holds Deployments and Pods of others, which the operator must never
be sent. `python -m bench.operator_load` measures the same at 24 services for a minute."""

from __future__ import annotations

import time

import pytest

from bench.operator_load import others, requests_between, settled
from tests.operator import emulator as em
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path

NS = "default"
OURS = "app.kubernetes.io/managed-by=embedop"


@pytest.fixture(scope="module")
def fleet(emulator, tmp_path_factory):
    others(emulator, 10)
    d = tmp_path_factory.mktemp("watches")
    started = time.monotonic()
    op = OperatorProcess(emulator.kubeconfig(d / "kubeconfig"), d / "operator.log", env={"EMBEDOP_SCRAPE_TIMEOUT_S": "1"})
    op.started = started
    # Mode off, with an empty env value (stored without it) and no excludeTokens (once rendered
    # as EXCLUDE_TOKENS="": the drift check never matched, and every resync applied again).
    emulator.request("POST", service_path(NS), new_service("fixed", {
        "model": "m", "replicas": 1, "autoscaling": {"mode": "off"}, "resources": {"gpu": 0},
        "env": [{"name": "EMPTY", "value": ""}]}))
    # The same answer at every scrape: not even the once-a-minute refresh of the measured rates.
    servers = settled(emulator, ["busy-a", "busy-b"], interval_s=1, live=False)
    eventually(lambda: emulator.get(service_path(NS, "fixed")).get("status", {}).get("observedGeneration"))
    yield op
    op.stop()
    for s in servers:
        s.shutdown()


def test_the_operator_is_only_ever_sent_its_own_objects(emulator, fleet):
    watched = {"deployments", "pods", "services", "poddisruptionbudgets", "horizontalpodautoscalers", "networkpolicies"}
    # This operator's calls: the record is the test session's, and an earlier module's operator
    # (a KEDA leader listing its release's pods by the scaler's label) is not this one.
    reads = [c for c in em.calls if c["subject"] == "operator" and c["verb"] in ("list", "watch")
             and c["resource"] in watched and c["t"] >= fleet.started]
    assert {c["resource"] for c in reads if c["verb"] == "watch"} == watched
    assert all(OURS in (c["selector"] or "") for c in reads), [c for c in reads if OURS not in (c["selector"] or "")]
    # As client-go's reflector: lists from the API server's watch cache, not etcd, and watches
    # kept fresh by bookmarks (a quiet watch otherwise resumes from a compacted version: a 410).
    first = {}
    for c in reads:
        if c["verb"] == "list":
            first.setdefault(c["resource"], c)
    assert all(c["params"].get("resourceVersion") == "0" for c in first.values())
    assert all(c["params"].get("allowWatchBookmarks") == "true" for c in reads if c["verb"] == "watch")
    # Nor does it read another's object by name.
    assert not [c for c in em.calls if c["subject"] == "operator" and c["namespace"] == "others" and c["t"] >= fleet.started]


def test_claims_are_not_listed_while_no_service_mounts_one(emulator, fleet):
    """PersistentVolumeClaims carry no label of ours: their informer lists and watches every claim
    of the namespaces, so it starts at the first read of one (a service with modelCache.claimName;
    tests/operator/test_model_cache_fill.py), not at start-up, where a list refused by an older
    chart's RBAC also held the start up for 30 s."""
    mark = len(fleet.log())
    eventually(lambda: fleet.log()[mark:].count(f"{NS}/fixed: periodic check done") >= 2, timeout=30)
    assert not [c for c in em.calls if c["t"] >= fleet.started and c["resource"] == "persistentvolumeclaims"]


def test_a_settled_fleet_costs_no_api_request(emulator, fleet):
    """Several resyncs and autoscaler steps of every service, and not one request (watches and the
    leader's lease renewals aside): no GET (the copies are read), no apply (the drift check
    compares what the API stores), no status write (nothing changed; the measured rates are
    refreshed at most once a minute)."""
    start, mark = time.monotonic(), len(fleet.log())

    def resyncs(name):
        return fleet.log()[mark:].count(f"{NS}/{name}: periodic check done")

    eventually(lambda: min(resyncs(n) for n in ("fixed", "busy-a", "busy-b")) >= 3, timeout=30)
    assert fleet.log()[mark:].count("autoscale busy-a:") >= 3
    calls = [c for c in requests_between(start, float("inf")) if c["resource"] != "leases"]
    assert calls == [], calls


def test_a_watch_whose_version_expired_is_listed_again_at_once(emulator, fleet):
    """A real API server ends such a watch with a 410 Status inside the stream (HTTP 200): it is
    listed again, at once and without a warning, and changes after it are followed."""
    mark, start = len(fleet.log()), time.monotonic()
    emulator.expire_watches("deployments")
    (again,) = eventually(lambda: [c for c in em.calls if c["t"] >= start and c["verb"] == "list"
                                   and c["resource"] == "deployments"])
    assert "watching Deployment" not in fleet.log()[mark:]
    assert "resourceVersion" not in again["params"]  # consistent: not back before what it had seen
    # Followed as before: a hand edit of an owned Deployment is reverted on its watch event.
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/fixed"
    emulator.merge_patch(path, {"spec": {"template": {"spec": {"terminationGracePeriodSeconds": 1}}}})
    eventually(lambda: emulator.get(path)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] != 1)
