"""The real operator process against kmock's Kubernetes emulator, driven only through the API.

The emulator has no controllers: where a real cluster's Deployment controller would write
Deployment status, the test writes it, as that controller would."""

import pytest

from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path



class Paths:
    def __init__(self, ns):
        self.ns = ns
        self.deploy = f"/apis/apps/v1/namespaces/{ns}/deployments"
        self.services = f"/api/v1/namespaces/{ns}/services"
        self.pdb = f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets"
        self.events = f"/api/v1/namespaces/{ns}/events"

    def cr(self, name=""):
        return service_path(self.ns, name)


@pytest.fixture(scope="module")
def p(namespace):
    return Paths(namespace)


def env_of(deployment):
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def condition(cr, type_):
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


@pytest.fixture(scope="module")
def svc(emulator, operator, p):
    body = new_service("alpha", {"model": "org/model-a", "replicas": 2, "autoscaling": {"mode": "off"},
                                 "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"}}, p.ns)
    return emulator.request("POST", p.cr(), body)


def test_create_makes_the_owned_objects(emulator, svc, p):
    uid = svc["metadata"]["uid"]
    d = eventually(lambda: emulator.get(f"{p.deploy}/alpha"))
    for path in (f"{p.services}/alpha", f"{p.services}/alpha-headless", f"{p.pdb}/alpha"):
        obj = eventually(lambda: emulator.get(path))
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    assert d["metadata"]["ownerReferences"][0] == {
        "apiVersion": "embedfleet.dev/v1alpha1", "kind": "EmbeddingService", "name": "alpha", "uid": uid,
        "controller": True, "blockOwnerDeletion": True}
    assert env_of(d)["MODEL_PATH"] == "org/model-a" and d["spec"]["replicas"] == 2
    assert d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "100m", "memory": "256Mi"}
    cr = eventually(lambda: emulator.get(p.cr("alpha")).get("status", {}).get("selector") and emulator.get(p.cr("alpha")))
    assert cr["status"]["selector"] == "app.kubernetes.io/name=embedserve,embedfleet.dev/service=alpha"
    # No finalizer of ours: deleting a service never waits for the operator (see fleet.py).
    assert not cr["metadata"].get("finalizers")


def test_deployment_status_flows_into_the_service_status(emulator, svc, p, controllers_are_emulated):
    if not controllers_are_emulated:
        pytest.skip("a real Deployment controller owns Deployment status")
    eventually(lambda: emulator.get(f"{p.deploy}/alpha"))
    emulator.merge_patch(f"{p.deploy}/alpha/status", {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}})
    cr = eventually(lambda: (c := emulator.get(p.cr("alpha"))) and c["status"].get("readyReplicas") == 2 and c)
    assert cr["status"]["replicas"] == 2
    assert condition(cr, "Ready")["status"] == "True" and condition(cr, "Degraded")["status"] == "False"
    emulator.merge_patch(f"{p.deploy}/alpha/status", {"status": {"readyReplicas": 1}})
    cr = eventually(lambda: (c := emulator.get(p.cr("alpha"))) and condition(c, "Ready").get("status") == "False" and c)
    assert condition(cr, "Ready")["message"] == "1/2 replicas ready"


def test_model_change_rolls_the_deployment(emulator, svc, p):
    eventually(lambda: emulator.get(f"{p.deploy}/alpha"))
    emulator.merge_patch(p.cr("alpha"), {"spec": {"model": "org/model-b"}})
    d = eventually(lambda: (d := emulator.get(f"{p.deploy}/alpha")) and env_of(d)["MODEL_PATH"] == "org/model-b" and d)
    assert env_of(d)["MODEL_PATH"] == "org/model-b"
    emulator.merge_patch(p.cr("alpha"), {"spec": {"batching": {"maxBatchSize": 64}}})
    eventually(lambda: env_of(emulator.get(f"{p.deploy}/alpha"))["MAX_BATCH_SIZE"] == "64")


def test_replicas_change_resizes_when_autoscaling_is_off(emulator, svc, p):
    eventually(lambda: emulator.get(f"{p.deploy}/alpha"))
    emulator.merge_patch(p.cr("alpha"), {"spec": {"replicas": 5}})
    eventually(lambda: emulator.get(f"{p.deploy}/alpha")["spec"]["replicas"] == 5)
    eventually(lambda: emulator.get(p.cr("alpha"))["status"].get("desiredReplicas") == 5)  # follows kubectl scale


PRODUCTION = {
    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
    "envFrom": [{"secretRef": {"name": "s3-credentials"}}],
    "imagePullSecrets": [{"name": "regcred"}],
    "serviceAccountName": "embed-s3-reader",
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": {
        "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"embedfleet.dev/service": "prod"}}}}]}},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                   "whenUnsatisfiable": "ScheduleAnyway",
                                   "labelSelector": {"matchLabels": {"embedfleet.dev/service": "prod"}}}],
    "priorityClassName": "inference-high", "runtimeClassName": "nvidia",
    "podAnnotations": {"example.com/team": "search"}, "podLabels": {"team": "search"},
    "rollout": {"maxSurge": 1, "maxUnavailable": 0},
}


def test_production_pod_fields_reach_the_deployment(emulator, svc, p):
    """Accepted by the emulator's strict validation of the Deployment against the Kubernetes schema."""
    emulator.request("POST", p.cr(), new_service("prod", {"model": "m", "resources": {"gpu": 0}, **PRODUCTION}, p.ns))
    d = eventually(lambda: emulator.get(f"{p.deploy}/prod"))
    pod = d["spec"]["template"]["spec"]
    for field in ("imagePullSecrets", "serviceAccountName", "affinity", "topologySpreadConstraints",
                  "priorityClassName", "runtimeClassName"):
        assert pod[field] == PRODUCTION[field], field
    c = pod["containers"][0]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in c["env"]
    assert c["envFrom"] == PRODUCTION["envFrom"]
    assert d["spec"]["template"]["metadata"]["labels"]["team"] == "search"
    assert d["spec"]["template"]["metadata"]["annotations"]["example.com/team"] == "search"
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    # The budget allows at least one eviction even when the rollout allows no pod down.
    eventually(lambda: emulator.get(f"{p.pdb}/prod")["spec"]["maxUnavailable"] == 1)


def test_a_misspelt_kubernetes_field_is_an_invalid_spec(emulator, svc, p):
    emulator.request("POST", p.cr(), new_service("typo", {"model": "m", "affinity": {"nodeAfinity": {}}}, p.ns))
    cr = eventually(lambda: (c := emulator.get(p.cr("typo"))) and condition(c, "Degraded").get("status") == "True" and c)
    assert condition(cr, "Degraded")["reason"] == "InvalidSpec"
    assert "affinity.nodeAfinity: unknown field" in condition(cr, "Degraded")["message"]
    assert emulator.get(f"{p.deploy}/typo") is None


def test_an_object_the_api_refuses_shows_as_degraded_with_the_apis_message(emulator, svc, p):
    from tests.operator import emulator as em

    message = 'Deployment.apps "refused" is invalid: spec.template.metadata.labels: Invalid value: "-bad-"'
    em.faults[("POST", "deployments")] = [(422, message)] * 3  # a Deployment that does not exist is created
    emulator.request("POST", p.cr(), new_service("refused", {"model": "m", "resources": {"gpu": 0}}, p.ns))
    cr = eventually(lambda: (c := emulator.get(p.cr("refused"))) and condition(c, "Degraded").get("reason") == "RejectedByAPI" and c)
    assert message in condition(cr, "Degraded")["message"]
    events = eventually(lambda: [e for e in emulator.get(p.events)["items"]
                                 if e.get("involvedObject", {}).get("name") == "refused" and e.get("reason") == "RejectedByAPI"])
    assert events[0]["type"] == "Warning"
    em.faults.pop(("POST", "deployments"), None)
    # Retried on the periodic check: once the API accepts it, Degraded clears.
    eventually(lambda: condition(emulator.get(p.cr("refused")), "Degraded").get("status") == "False", timeout=30)


def test_hand_edits_are_reverted(emulator, svc, p):
    eventually(lambda: emulator.get(f"{p.deploy}/alpha"))
    image = emulator.get(f"{p.deploy}/alpha")["spec"]["template"]["spec"]["containers"][0]["image"]
    d = emulator.get(f"{p.deploy}/alpha")
    d["spec"]["template"]["spec"]["containers"][0]["image"] = "evil/image:latest"
    emulator.merge_patch(f"{p.deploy}/alpha", {"spec": {"template": d["spec"]["template"]}})
    eventually(lambda: emulator.get(f"{p.deploy}/alpha")["spec"]["template"]["spec"]["containers"][0]["image"] == image)
    # Our ports come back (a real API server keeps the hand-added one beside them: its manager's).
    emulator.merge_patch(f"{p.services}/alpha", {"spec": {"ports": [{"name": "x", "port": 1}]}})
    eventually(lambda: {50051, 8001} <= {p["port"] for p in emulator.get(f"{p.services}/alpha")["spec"]["ports"]})
    emulator.request("DELETE", f"{p.pdb}/alpha")  # deleted by hand: recreated by the periodic check
    eventually(lambda: emulator.get(f"{p.pdb}/alpha"), timeout=20)


def test_an_entry_removed_from_the_spec_leaves_the_deployment(emulator, svc, p):
    """What we stop sending is removed by the next apply; a check of what we send against what is
    stored cannot see it missing: the digest of the last apply (an annotation) says so."""
    emulator.merge_patch(p.cr("alpha"), {"spec": {"env": [{"name": "KEEP", "value": "1"}, {"name": "DROP", "value": "2"}]}})
    eventually(lambda: {"DROP", "KEEP"} <= set(env_of(emulator.get(f"{p.deploy}/alpha"))))
    emulator.merge_patch(p.cr("alpha"), {"spec": {"env": [{"name": "KEEP", "value": "1"}]}})
    eventually(lambda: "DROP" not in env_of(emulator.get(f"{p.deploy}/alpha")))
    assert env_of(emulator.get(f"{p.deploy}/alpha"))["KEEP"] == "1"


def test_a_bad_service_is_degraded_with_an_event_and_others_carry_on(emulator, svc, p):
    bad = new_service("broken", {"model": "m", "batching": {"maxTokensPerBatch": 100}}, p.ns)
    emulator.request("POST", p.cr(), bad)
    cr = eventually(lambda: (c := emulator.get(p.cr("broken"))) and condition(c, "Degraded").get("status") == "True" and c)
    assert condition(cr, "Degraded")["reason"] == "InvalidSpec"
    assert "below the largest bucket" in condition(cr, "Degraded")["message"]
    assert emulator.get(f"{p.deploy}/broken") is None  # nothing rendered for it
    events = eventually(lambda: [e for e in emulator.get(p.events)["items"]
                                 if e.get("involvedObject", {}).get("name") == "broken" and e.get("reason") == "InvalidSpec"])
    assert events[0]["type"] == "Warning"
    good = new_service("gamma", {"model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"}}, p.ns)
    emulator.request("POST", p.cr(), good)
    eventually(lambda: emulator.get(f"{p.deploy}/gamma"))
    # fixing the spec heals it
    emulator.merge_patch(p.cr("broken"), {"spec": {"batching": {"maxTokensPerBatch": 4096}}})
    eventually(lambda: emulator.get(f"{p.deploy}/broken"))
    eventually(lambda: condition(emulator.get(p.cr("broken")), "Degraded").get("reason") != "InvalidSpec")


def test_delete_is_immediate(emulator, operator, svc, p):
    """No finalizer of ours: a service goes at once (its owned objects go by garbage collection,
    which only a real cluster has: tests/cluster)."""
    emulator.request("DELETE", p.cr("gamma"))
    assert emulator.get(p.cr("gamma")) is None
    # Nothing failed for good; temporary failures are retried by design.
    errors = [line for line in operator.log().splitlines()
              if (" ERROR " in line and "failed temporarily" not in line) or "failed permanently" in line]
    assert errors == []


def test_every_api_call_made_is_declared_for_rbac(emulator, operator, svc, p):
    """The calls recorded while the scenarios above ran are all in kube.CALLS, which the chart's
    RBAC is checked against (tests/charts)."""
    from embedop.kube import CALLS
    from tests.operator.emulator import recorded

    calls = recorded["operator"]
    assert calls, "nothing recorded"
    assert calls <= CALLS, calls - CALLS
    # blockOwnerDeletion on owned objects, as OpenShift's admission plugin authorizes it.
    assert ("embedfleet.dev", "embeddingservices/finalizers", "update") in calls
