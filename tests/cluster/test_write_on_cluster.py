"""How the operator writes, judged by a real API server (tests/operator/test_write.py plays it
against the emulator): a create of a taken name is refused (409 AlreadyExists) where a forced
server-side apply would take the object over, which is why a missing object is created and only
what is ours is applied; a create's fields, recorded as an Update of `embedop`, become its
apply's (else a field the operator stops sending stays, kubernetes/kubernetes#99003); and an
InferencePool CRD of v1.0.0 (no appProtocol) prunes the field, stored and in managedFields,
while the pool the operator renders is written once and left alone."""

from __future__ import annotations

import pytest
import yaml

from tests.cluster.test_hardening_on_cluster import requests
from tests.operator import inference_pool_schema as schema
from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path

SPEC = {"model": "m", "resources": {"gpu": 0, "cpu": "50m", "memory": "64Mi"}, "autoscaling": {"mode": "off"},
        "replicas": 0}
APPLY = "application/apply-patch+yaml"


def test_a_create_of_a_taken_name_is_refused_where_a_forced_apply_takes_the_object_over(emulator, namespace):
    services = f"/api/v1/namespaces/{namespace}/services"
    theirs = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "taken", "labels": {"app": "theirs"}},
              "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}}
    emulator.request("POST", services, theirs)
    ours = {**theirs, "metadata": {"name": "taken", "labels": {"app": "ours"}}, "spec": {"selector": {"app": "ours"},
                                                                                          "ports": [{"port": 80}]}}
    code, text = emulator.attempt("POST", f"{services}?fieldManager=embedop", ours)
    assert code == 409 and "AlreadyExists" in text
    assert emulator.get(f"{services}/taken")["spec"]["selector"] == {"app": "theirs"}
    emulator.request("PATCH", f"{services}/taken?fieldManager=embedop&force=true", ours, APPLY)
    assert emulator.get(f"{services}/taken")["spec"]["selector"] == {"app": "ours"}  # taken over


def managers(obj: dict) -> dict[str, list[str]]:
    """Manager → the operations of its entries on the main resource (subresources left out)."""
    out: dict[str, list[str]] = {}
    for m in obj["metadata"].get("managedFields") or []:
        if not m.get("subresource"):
            out.setdefault(m["manager"], []).append(m["operation"])
    return out


def test_what_the_operator_created_it_owns_by_apply_and_a_field_it_stops_sending_goes(emulator, namespace, operator):
    name = "adopted"
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}"
    env = [{"name": "KEPT", "value": "1"}, {"name": "DROPPED", "value": "2"}]
    emulator.request("POST", service_path(namespace), new_service(name, {**SPEC, "env": env}, namespace))
    eventually(lambda: managers(emulator.get(path)).get("embedop") == ["Apply"], timeout=60)
    headless = f"/api/v1/namespaces/{namespace}/services/{name}-headless"
    assert managers(emulator.get(headless)).get("embedop") == ["Apply"]
    emulator.merge_patch(service_path(namespace, name), {"spec": {"env": env[:1]}})

    def names():
        return {e["name"] for e in emulator.get(path)["spec"]["template"]["spec"]["containers"][0]["env"]}
    eventually(lambda: "DROPPED" not in names(), timeout=60)
    assert "KEPT" in names()


def test_a_v1_0_0_inference_pool_crd_prunes_app_protocol_and_the_pool_is_written_once(emulator, namespace, operator):
    crd_path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{schema.CRD_V1_0_0['metadata']['name']}"
    if emulator.get(crd_path) is not None:
        pytest.skip("the cluster has an InferencePool CRD of its own: left as it is")
    pools = f"/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools"
    emulator.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                     yaml.safe_load(schema.CRD_FILE_V1_0_0.read_text()))
    try:
        eventually(lambda: any(c["type"] == "Established" and c["status"] == "True"
                               for c in (emulator.get(crd_path).get("status") or {}).get("conditions", [])), timeout=60)
        # The premise: a field the schema lacks is pruned, from the object and from managedFields.
        probe = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "probe"},
                 "spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8001}],
                          "appProtocol": "http", "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}
        stored = emulator.request("PATCH", f"{pools}/probe?fieldManager=embedfleet-tests&force=true", probe, APPLY)
        assert "appProtocol" not in stored["spec"]
        assert "f:appProtocol" not in str(stored["metadata"]["managedFields"])
        emulator.request("DELETE", f"{pools}/probe")
        # The operator's pool: made once (it lists the kind again within a minute), then left alone.
        spec = {**SPEC, "routing": "gateway"}
        emulator.request("POST", service_path(namespace), new_service("old-crd", spec, namespace))
        eventually(lambda: emulator.get(f"{pools}/old-crd"), timeout=180)
        mark = len(operator.log())
        eventually(lambda: operator.log()[mark:].count(f"{namespace}/old-crd: periodic check done") >= 4, timeout=60)
        assert not [u for m, u in requests(operator.log()[mark:]) if m == "PATCH" and "/inferencepools/old-crd" in u]
        said = [c for c in emulator.get(service_path(namespace, "old-crd"))["status"]["conditions"]
                if c["type"] in ("Degraded", "FieldNotPersisted")]
        assert len(said) == 2 and all(c["status"] == "False" for c in said), said
    finally:
        if emulator.get(service_path(namespace, "old-crd")):
            emulator.request("DELETE", service_path(namespace, "old-crd"))
        emulator.request("DELETE", crd_path)


def test_an_adoption_admission_refuses_is_tried_once_not_at_every_check(emulator, namespace, operator):
    """A ValidatingAdmissionPolicy (Kubernetes 1.30+) refusing UPDATEs of one Service refuses the
    JSON patch that makes its create's fields the operator's apply's, with 422 as a failed `test`
    would: after one attempt and one read the operator leaves it for an hour (write.adopted)."""
    name, base = "frozen", "/apis/admissionregistration.k8s.io/v1"
    target, policy = f"{name}-headless", f"frozen-{namespace}"
    emulator.request("POST", f"{base}/validatingadmissionpolicies", {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy", "metadata": {"name": policy},
        "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [{
            "apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["services"]}]},
            "validations": [{"expression": f"object.metadata.name != '{target}'", "message": f"{target} is frozen"}]}})
    emulator.request("POST", f"{base}/validatingadmissionpolicybindings", {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy}, "spec": {"policyName": policy, "validationActions": ["Deny"], "matchResources": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}}})
    try:
        probe = f"/api/v1/namespaces/{namespace}/services/{target}"
        emulator.request("POST", f"/api/v1/namespaces/{namespace}/services", {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": target}, "spec": {"ports": [{"port": 80}]}})
        # The premise (the policy may take a moment to be enforced): its refusal is a 422.
        patch = [{"op": "add", "path": "/metadata/labels", "value": {"probe": "1"}}]
        refused = lambda: emulator._send("PATCH", probe, patch, "application/json-patch+json").status_code == 422  # noqa: E731
        eventually(refused, timeout=60)
        emulator.request("DELETE", probe)
        emulator.request("POST", service_path(namespace), new_service(name, SPEC, namespace))
        eventually(lambda: emulator.get(probe) and f"Service {namespace}/{target}: the fields of its create could not"
                   in operator.log(), timeout=60)
        mark = len(operator.log())
        eventually(lambda: operator.log()[mark:].count(f"{namespace}/{name}: periodic check done") >= 3, timeout=60)
        assert not [u for m, u in requests(operator.log()[mark:]) if f"/services/{target}" in u]
    finally:
        emulator.request("DELETE", f"{base}/validatingadmissionpolicybindings/{policy}")
        emulator.request("DELETE", f"{base}/validatingadmissionpolicies/{policy}")
        if emulator.get(service_path(namespace, name)):
            emulator.request("DELETE", service_path(namespace, name))
