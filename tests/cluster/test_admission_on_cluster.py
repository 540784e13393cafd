"""The chart's ValidatingAdmissionPolicy on a real API server (Kubernetes 1.30+), which alone
type-checks its CEL against the CRD's schema and enforces it: services within it are created,
those beyond it refused with the policy's message; a service the policy would refuse today (its
allow-list narrowed since) is still labelled and deleted with foreground propagation, which the
garbage collector finishes with an UPDATE of it. tests/charts/test_admission_policy.py evaluates
the same CEL with cel-python."""

from __future__ import annotations

import helm_python as helm
import pytest
import yaml

from tests.cluster.conftest import ROOT
from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path

BASE = "/apis/admissionregistration.k8s.io/v1"
VALUES = {"admissionPolicy": {"enabled": True, "imagePrefixes": ["registry.example.com/embedfleet/"],
                              "serviceAccounts": ["embedserve"], "priorityClasses": []}}


def rendered(namespace, values) -> list[dict]:
    """The chart's policy and binding for a release watching `namespace`."""
    files = helm.Chart.load(str(ROOT / "charts" / "embedfleet")).render(
        {**values, "watchNamespace": namespace}, name="adm", namespace=namespace, is_install=True)
    return [o for o in yaml.safe_load_all(files["embedfleet/templates/admission-policy.yaml"]) if o]


@pytest.fixture(scope="module")
def policy(emulator, namespace):
    """The chart's policy and binding, rendered for a release watching the test's namespace."""
    if not emulator.get(f"{BASE}/validatingadmissionpolicies?limit=1"):
        pytest.skip("the cluster does not serve admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy (1.30+)")
    objects = rendered(namespace, VALUES)
    made = []
    for obj in objects:
        plural = "validatingadmissionpolicies" if obj["kind"] == "ValidatingAdmissionPolicy" else "validatingadmissionpolicybindings"
        emulator.request("POST", f"{BASE}/{plural}", obj)
        made.append(f"{BASE}/{plural}/{obj['metadata']['name']}")
    yield
    for path in reversed(made):
        emulator.request("DELETE", path)


def spec(**fields):
    return {"model": "m", "resources": {"gpu": 0, "cpu": "50m", "memory": "64Mi"}, "autoscaling": {"mode": "off"},
            "replicas": 0, **fields}


def test_the_policy_refuses_what_it_does_not_allow_and_admits_the_rest(emulator, namespace, policy):
    refused = new_service("miner", spec(image="docker.io/attacker/miner:latest"), namespace)

    def judged():
        """A new policy takes effect within seconds: until its refusal is seen, nothing else is judged."""
        code, text = emulator.attempt("POST", service_path(namespace), refused)
        if code == 201:  # not in force yet
            emulator.request("DELETE", service_path(namespace, "miner"))
            return None
        return code, text

    code, text = eventually(judged, timeout=60)
    assert code == 422 and "spec.image docker.io/attacker/miner:latest is not allowed" in text, text
    code, text = emulator.attempt("POST", service_path(namespace),
                                  new_service("admin", spec(serviceAccountName="default-admin"), namespace))
    assert code == 422 and "spec.serviceAccountName default-admin is not allowed" in text, text
    code, text = emulator.attempt("POST", service_path(namespace),
                                  new_service("urgent", spec(priorityClassName="system-node-critical"), namespace))
    assert code == 422 and "spec.priorityClassName system-node-critical is not allowed" in text, text
    for name, fields in (("plain", {}), ("listed", {"image": "registry.example.com/embedfleet/embedserve:1.2",
                                                    "serviceAccountName": "embedserve"})):
        code, text = emulator.attempt("POST", service_path(namespace), new_service(name, spec(**fields), namespace))
        assert code == 201, text
    # Its status and scale are not judged: kubectl scale (and the operator's mirror) go through.
    emulator.merge_patch(service_path(namespace, "plain") + "/scale", {"spec": {"replicas": 0}})


def test_a_service_the_policy_now_refuses_is_still_labelled_and_deleted_in_the_foreground(emulator, namespace, policy):
    """Admitted, then beyond the policy (its allow-list narrowed: as a service made before the
    policy was enabled). kubectl label is an UPDATE that leaves the judged fields alone; deleting
    with foreground propagation stamps the foregroundDeletion finalizer, which the garbage collector
    takes off with an UPDATE once the dependent is gone: refused, the service would stay
    Terminating for good (the chart's uninstall hook deletes this way)."""
    listed = {"image": "registry.example.com/embedfleet/embedserve:1.2", "serviceAccountName": "embedserve"}
    code, text = emulator.attempt("POST", service_path(namespace), new_service("narrowed", spec(**listed), namespace))
    assert code == 201, text
    owner = emulator.get(service_path(namespace, "narrowed"))
    emulator.request("POST", f"/api/v1/namespaces/{namespace}/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "narrowed-dependent", "ownerReferences": [{
            "apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": "narrowed",
            "uid": owner["metadata"]["uid"], "blockOwnerDeletion": True}]}})
    (narrowed, _) = rendered(namespace, {"admissionPolicy": {"enabled": True}})  # nothing listed any more
    path = f"{BASE}/validatingadmissionpolicies/{narrowed['metadata']['name']}"
    before = emulator.get(path)["spec"]["validations"]
    emulator.merge_patch(path, {"spec": {"validations": narrowed["spec"]["validations"]}})
    try:
        def narrowed_in_force():
            code, text = emulator.attempt("POST", service_path(namespace), new_service("probe", spec(**listed), namespace))
            if code == 201:
                emulator.request("DELETE", service_path(namespace, "probe"))
                return None
            return code == 422 and "is not allowed" in text

        eventually(narrowed_in_force, timeout=60)
        emulator.merge_patch(service_path(namespace, "narrowed"), {"metadata": {"labels": {"team": "search"}}})
        code, text = emulator.attempt("PUT", service_path(namespace, "narrowed"),
                                      {**emulator.get(service_path(namespace, "narrowed")),
                                       "spec": spec(**{**listed, "image": "docker.io/attacker/miner:1"})})
        assert code == 422 and "spec.image docker.io/attacker/miner:1 is not allowed" in text, text  # still judged
        emulator.request("DELETE", service_path(namespace, "narrowed") + "?propagationPolicy=Foreground")
        eventually(lambda: emulator.get(f"/api/v1/namespaces/{namespace}/configmaps/narrowed-dependent") is None,
                   timeout=60)
        eventually(lambda: emulator.get(service_path(namespace, "narrowed")) is None, timeout=60)
    finally:
        emulator.merge_patch(path, {"spec": {"validations": before}})
