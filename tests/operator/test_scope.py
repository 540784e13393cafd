"""One operator per namespace: an operator refuses to start where another release's older claim
covers a namespace it would watch (scope.py), as a table of the pure decision and with the real
`python -m embedop` against the emulated API server holding the claims the chart makes."""

import pytest

from embedop import scope
from tests.operator import emulator as em
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import Emulator

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{}/leases"


def claim(namespace, name, watched, created, release="r"):
    return scope.Claim(namespace, name, created, frozenset(watched), release)


ALL = {scope.ALL}
OLD, NEW = "2026-01-01T00:00:00Z", "2026-06-01T00:00:00Z"


@pytest.mark.parametrize("others, own, watched, refused", [
    # A namespaced release after a cluster-wide one: both would manage `search`.
    ([claim("platform", "cw-scope", ALL, OLD)], ("search", "ns-scope", NEW), {"search"}, True),
    # A cluster-wide release after a namespaced one: the same overlap, seen from the other side.
    ([claim("search", "ns-scope", {"search"}, OLD)], ("platform", "cw-scope", NEW), ALL, True),
    # Two releases for one namespace; two cluster-wide ones.
    ([claim("a", "one-scope", {"search"}, OLD)], ("b", "two-scope", NEW), {"search"}, True),
    ([claim("a", "one-scope", ALL, OLD)], ("b", "two-scope", NEW), ALL, True),
    # Disjoint namespaces: both run (the case a shared Lease name used to stop).
    ([claim("ops", "a-scope", {"team-a"}, OLD)], ("ops", "b-scope", NEW), {"team-b"}, False),
    # The older claim keeps its scope.
    ([claim("platform", "cw-scope", ALL, NEW)], ("search", "ns-scope", OLD), {"search"}, False),
    # Made in the same second: the names decide, the same way seen from both.
    ([claim("a", "x-scope", ALL, OLD)], ("a", "y-scope", OLD), ALL, True),
    ([claim("a", "y-scope", ALL, OLD)], ("a", "x-scope", OLD), ALL, False),
    # No claim of its own (run outside the chart, or not created yet): it yields to any overlap.
    ([claim("platform", "cw-scope", ALL, NEW)], None, {"search"}, True),
    ([], None, ALL, False),
])
def test_the_older_claim_keeps_its_scope(others, own, watched, refused):
    mine = [claim(own[0], own[1], watched, own[2])] if own else []
    key = own[:2] if own else None
    blocking = scope.decide([*others, *mine], key, frozenset(watched))
    assert bool(blocking) == refused
    assert all(c.key != key for c in blocking)  # never itself: a rollout's pods share their claim


def test_a_claim_reads_as_the_chart_writes_it():
    lease = {"metadata": {"namespace": "ops", "name": "ef-operator-scope", "creationTimestamp": OLD,
                          "labels": {scope.CLAIM_LABEL: "true", "app.kubernetes.io/instance": "ef"},
                          "annotations": {scope.WATCHED: "search"}}}
    c = scope.Claim.of(lease)
    assert (c.key, c.watched, c.release) == (("ops", "ef-operator-scope"), frozenset({"search"}), "ef")
    assert scope.Claim.of({"metadata": {"name": "x", "namespace": "y"}}).watched == frozenset(ALL)  # at its widest


@pytest.fixture(scope="module")
def cluster():
    with Emulator() as e:
        yield e


def post_claim(cluster, namespace, name, watched, created, release):
    cluster.request("POST", LEASES.format(namespace), {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        # The API server stamps creationTimestamp; the emulator keeps one given, so the order is set here.
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created,
                     "labels": {scope.CLAIM_LABEL: "true", "app.kubernetes.io/instance": release},
                     "annotations": {scope.WATCHED: watched}}})


@pytest.fixture
def claims(cluster):
    made = []

    def make(namespace, name, watched, created, release):
        post_claim(cluster, namespace, name, watched, created, release)
        made.append((namespace, name))
    yield make
    for namespace, name in made:
        cluster.request("DELETE", f"{LEASES.format(namespace)}/{name}")


def start(cluster, tmp_path, namespace=None, **env) -> OperatorProcess:
    return OperatorProcess(cluster.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator.log",
                           env={"POD_NAMESPACE": "search", **env}, namespace=namespace)


def test_an_operator_under_an_older_cluster_wide_claim_refuses_to_start(cluster, claims, tmp_path):
    claims("platform", "first-operator-scope", "*", OLD, "first")
    claims("search", "second-operator-scope", "search", NEW, "second")
    op = start(cluster, tmp_path, namespace="search", EMBEDOP_SCOPE_CLAIM="second-operator-scope")
    try:
        assert op.proc.wait(60) == 2
    finally:
        op.stop()
    log = op.log()
    assert "refusing to start" in log and "release first in namespace platform" in log and "all namespaces" in log
    assert "acquired leadership" not in log and "Several releases" in log


@pytest.mark.parametrize("case", ["own-claim-older", "disjoint"])
def test_an_operator_whose_scope_nobody_claimed_first_runs(cluster, claims, tmp_path, case):
    if case == "own-claim-older":
        claims("platform", "late-operator-scope", "*", NEW, "late")
        claims("search", "early-operator-scope", "search", OLD, "early")
        env = {"EMBEDOP_SCOPE_CLAIM": "early-operator-scope"}
    else:
        claims("search", "team-b-operator-scope", "team-b", OLD, "team-b")
        env = {}  # no claim of its own: yields to overlaps only
    op = start(cluster, tmp_path, namespace="search", **env)
    try:
        eventually(lambda: "no other operator's claim overlaps it" in op.log(), timeout=60)
        eventually(lambda: "acquired leadership" in op.log(), timeout=60)
    finally:
        op.stop()


def lease_lists(who: str) -> list[dict]:
    return [c for c in em.calls if c["who"] == who and c["resource"] == "leases" and c["verb"] == "list"]


def test_a_claim_made_while_it_runs_stops_it_when_it_next_becomes_the_leader(cluster, claims, tmp_path):
    """An operator run outside the chart (no claim of its own) started where nobody claimed; a
    cluster-wide release installed after it finds no claim of its, and runs too. The overlap
    shows at this operator's next term: another pod took the lease (here: the test, as a holder
    that then goes silent), this one takes it back, checks the claims again before it writes,
    and stops, exiting as it would at start-up. Each look reads the watch cache (resourceVersion=0),
    selected by the claims' label."""
    lease = f"{LEASES.format('search')}/rechecked-leader"
    op = OperatorProcess(cluster.kubeconfig(tmp_path / "kubeconfig", token="rechecked"), tmp_path / "operator.log",
                         env={"POD_NAMESPACE": "search", "EMBEDOP_LEASE_NAME": "rechecked-leader"}, namespace="search")
    try:
        eventually(lambda: "acquired leadership" in op.log(), timeout=60)
        claims("platform", "later-operator-scope", "*", NEW, "later")
        spec = cluster.get(lease)["spec"]
        cluster.merge_patch(lease, {"spec": {"holderIdentity": "later-operator-7d9f8-x2x4z_0a1b2c3d",
                                             "renewTime": spec["renewTime"]}})
        assert op.proc.wait(60) == 2
    finally:
        op.stop()
    assert not cluster.get(lease)["spec"].get("holderIdentity")  # a clean stop: released
    log = op.log()
    assert "lost leadership" in log and log.count("acquired leadership") == 2
    refused = log.rindex("refusing to start")
    assert refused > log.rindex("acquired leadership") and "release later in namespace platform" in log[refused:]
    looks = lease_lists("rechecked")
    assert len(looks) == 3  # at start-up, and at the start of each term
    assert all(c["params"].get("resourceVersion") == "0" and c["selector"] == f"{scope.CLAIM_LABEL}=true"
               for c in looks), looks


def test_a_claims_list_it_may_not_make_is_a_warning(cluster, claims, tmp_path, monkeypatch, caplog):
    """scopeCheck.enabled=false: no ClusterRole to list the claims (403). The operator warns and
    runs unchecked, at start-up and at each term."""
    import asyncio

    from embedop.kube import Kube

    claims("platform", "cw-operator-scope", "*", OLD, "cw")
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig", token="unlisted")))
    em.faults[("GET", "leases", "unlisted")] = [(403, 'leases.coordination.k8s.io is forbidden: User '
                                                      '"system:serviceaccount:search:ns-operator" cannot list')]

    async def look():
        kube = Kube.connect(5)
        try:
            return await scope.check(kube, ("search", "ns-operator-scope"), ["search"])
        finally:
            await kube.close()

    try:
        assert asyncio.run(look()) is None
    finally:
        em.faults.pop(("GET", "leases", "unlisted"), None)
    assert [c["fault"] for c in em.calls if c.get("fault") and c["resource"] == "leases"][-1][0] == 403
    assert "not checking for overlapping operators" in caplog.text and "scopeCheck.enabled=false" in caplog.text
