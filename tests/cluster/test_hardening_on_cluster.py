"""The hardening scenarios on a real API server, where the emulator only approximates: ownership
of objects someone else made, what the server stores (an empty env value dropped), label-selected
watches, server-side apply's ownership of spec.replicas when admission refuses the rest of the
Deployment (a ValidatingAdmissionPolicy, built into Kubernetes 1.30+, stands for Kyverno), and
leader election on a real Lease. Requests are counted from the operator's own log (its HTTP
client logs each one at INFO)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.cluster.conftest import operator_env
from tests.cluster.test_replicas_on_cluster import owners, watch_count
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path
from tests.operator.test_ownership import (  # noqa: F401 - collected by pytest
    test_someone_elses_hpa_is_not_applied_over_in_mode_hpa,
    test_someone_elses_object_of_the_same_name_is_not_taken_over,
    test_the_autoscalers_status_is_cleared_when_the_service_leaves_mode_operator,
)

SPEC = {"model": "m", "resources": {"gpu": 0, "cpu": "50m", "memory": "64Mi"}}
REQUEST = re.compile(r"HTTP Request: (\w+) (\S+)")


def requests(log: str) -> list[tuple[str, str]]:
    """(method, URL) of every API request the operator logged, watches aside."""
    return [(m, u) for m, u in REQUEST.findall(log) if "watch=true" not in u and "/leases/" not in u]


def test_watches_are_label_selected_and_a_settled_service_costs_no_request(emulator, operator, namespace):
    """Mode off, an empty env value (the API server drops it) and no excludeTokens: once settled,
    resyncs (every 2 s here) read the watches' copies and write nothing."""
    emulator.request("POST", service_path(namespace), new_service("quiet", {
        **SPEC, "autoscaling": {"mode": "off"}, "env": [{"name": "EMPTY", "value": ""}]}, namespace))
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/quiet"
    eventually(lambda: emulator.get(path), timeout=60)
    eventually(lambda: (cr := emulator.get(service_path(namespace, "quiet")))["status"].get("observedGeneration")
               == cr["metadata"]["generation"], timeout=60)
    watches = [u for u in REQUEST.findall(operator.log()) if "watch=true" in u[1]]
    for kind in ("deployments", "pods", "services", "poddisruptionbudgets", "horizontalpodautoscalers", "networkpolicies"):
        mine = [u for _, u in watches if f"/{kind}?" in u]
        assert mine and all("managed-by%3Dembedop" in u for u in mine), kind
    eventually(lambda: (d := emulator.get(path))["status"].get("observedGeneration") == d["metadata"]["generation"],
               timeout=60)
    mark = len(operator.log())
    eventually(lambda: operator.log()[mark:].count(f"{namespace}/quiet: periodic check done") >= 3, timeout=60)
    # Its pods' progress may still move the Deployment's status (and so the service's): no read,
    # no apply of what it owns.
    assert [(m, u) for m, u in requests(operator.log()[mark:]) if m == "GET" or "/embeddingservices/" not in u] == []


@pytest.fixture
def no_debug_logs(emulator, namespace):
    """A ValidatingAdmissionPolicy (as Kyverno would) refusing Deployments of this namespace that
    set LOG_LEVEL=DEBUG. Its resource rule names deployments, not deployments/scale."""
    name = f"no-debug-logs-{namespace}"
    base = "/apis/admissionregistration.k8s.io/v1"
    emulator.request("POST", f"{base}/validatingadmissionpolicies", {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy", "metadata": {"name": name},
        "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [{
            "apiGroups": ["apps"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["deployments"]}]},
            "validations": [{"message": "no-debug-logs: LOG_LEVEL=DEBUG is not allowed", "expression":
                             "!object.spec.template.spec.containers.exists(c, has(c.env) && c.env.exists(e, "
                             "e.name == 'LOG_LEVEL' && has(e.value) && e.value == 'DEBUG'))"}]}})
    emulator.request("POST", f"{base}/validatingadmissionpolicybindings", {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}}})

    def lift():
        emulator.request("DELETE", f"{base}/validatingadmissionpolicybindings/{name}")
        emulator.request("DELETE", f"{base}/validatingadmissionpolicies/{name}")

    yield lift
    lift()


def test_the_count_changes_while_admission_refuses_the_spec(emulator, operator, namespace, no_debug_logs):
    cr, path = service_path(namespace, "policed"), f"/apis/apps/v1/namespaces/{namespace}/deployments/policed"
    emulator.request("POST", service_path(namespace), new_service("policed", {
        **SPEC, "replicas": 1, "autoscaling": {"mode": "off"}}, namespace))
    eventually(lambda: emulator.get(path), timeout=60)
    emulator.merge_patch(cr, {"spec": {"env": [{"name": "LOG_LEVEL", "value": "DEBUG"}]}})
    eventually(lambda: next(c for c in emulator.get(cr)["status"]["conditions"] if c["type"] == "Degraded")
               .get("reason") == "RejectedByAPI", timeout=60)
    emulator.merge_patch(f"{cr}/scale", {"spec": {"replicas": 3}})  # kubectl scale embsvc
    eventually(lambda: emulator.get(path)["spec"]["replicas"] == 3, timeout=60)
    assert "LOG_LEVEL" not in {e["name"] for e in emulator.get(path)["spec"]["template"]["spec"]["containers"][0]["env"]}
    no_debug_logs()
    eventually(lambda: {"name": "LOG_LEVEL", "value": "DEBUG"} in
               emulator.get(path)["spec"]["template"]["spec"]["containers"][0]["env"], timeout=60)
    assert set(watch_count(emulator, path, 6)) == {3}
    eventually(lambda: "embedop" in owners(emulator.get(path)), timeout=60)  # the apply took the count back
    mark = len(operator.log())
    eventually(lambda: operator.log()[mark:].count(f"{namespace}/policed: periodic check done") >= 3, timeout=60)
    assert not [u for m, u in requests(operator.log()[mark:]) if m == "PATCH" and "/deployments/policed" in u]


def test_only_the_lease_holder_writes(emulator, namespace, tmp_path):
    ops = [OperatorProcess(Path(os.environ["KUBECONFIG"]), tmp_path / f"{who}.log", namespace=namespace,
                           env=operator_env(namespace, EMBEDOP_IDENTITY=who))
           for who in ("a", "b")]
    lease = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/embedop-leader"
    try:
        holder = eventually(lambda: (emulator.get(lease) or {}).get("spec", {}).get("holderIdentity"), timeout=60)
        leader, standby = (ops[0], ops[1]) if holder.startswith("a_") else (ops[1], ops[0])
        emulator.request("POST", service_path(namespace), new_service("led", {**SPEC, "autoscaling": {"mode": "off"}}, namespace))
        eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/led"), timeout=60)
        writes = [u for m, u in requests(standby.log()) if m in ("PATCH", "POST", "PUT", "DELETE") and "/events" not in u
                  and not re.search(r"/embeddingservices/[^/?]+\?", u)]  # kopf's own annotations aside
        assert writes == []
        leader.stop()
        eventually(lambda: emulator.get(lease)["spec"].get("holderIdentity", "").startswith(
            "b_" if leader is ops[0] else "a_"), timeout=30)
    finally:
        for op in ops:
            if op.proc.poll() is None:
                op.stop()
