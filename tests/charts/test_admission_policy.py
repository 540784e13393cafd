"""The chart's opt-in ValidatingAdmissionPolicy on EmbeddingServices: rendered where the API has
it (admissionregistration.k8s.io/v1, Kubernetes 1.30+), refused at install where it does not,
valid against the real schemas, and its CEL, evaluated with cel-python, allows and refuses the
services it should, saying why."""

from pathlib import Path

import celpy
import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "embedfleet"
SERVER = yaml.safe_load((CHART / "values.yaml").read_text())["serverImage"]["repository"]
ON = {"admissionPolicy": {"enabled": True, "imagePrefixes": ["registry.example.com/embedfleet/"],
                          "serviceAccounts": ["embedserve"], "priorityClasses": ["inference-high"]}}


def render(values) -> list[dict]:
    files = helm.Chart.load(str(CHART)).render(values, name="ef", namespace="embedfleet-system", is_install=True)
    return [d for p, t in files.items() if not p.endswith("NOTES.txt") for d in yaml.safe_load_all(t) if d]


def policy_of(values) -> tuple[dict, dict]:
    objects = render(values)
    (policy,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    return policy, binding


def test_off_by_default():
    assert not {o["kind"] for o in render({})} & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


@pytest.mark.parametrize("version", ["1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0"])
def test_it_validates_strictly_where_kubernetes_has_it(version):
    for obj in policy_of(ON):
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("kube, refused", [("v1.29.0", True), ("v1.30.0", False), ("v1.31.0", False)])
def test_enabled_on_a_cluster_without_it_fails_the_install_saying_so(kube, refused, capfd):
    """The chart allows 1.29, whose admissionregistration.k8s.io/v1 has no ValidatingAdmissionPolicy:
    a guard asked for and silently missing would be worse than a failed install. (Rendered for a
    Kubernetes version only by lint, which turns a template's `fail` into a log line on stderr and
    goes on: the line is the install's error.)"""
    result = helm.lint(str(CHART), ON, strict=True, kube_version=kube)
    said = capfd.readouterr().err
    assert ("fail message=" in said and "Kubernetes 1.30 or later" in said and kube in said) == refused, said
    assert result["errors"] == [] and [m for m in result["messages"] if m["severity"] >= 2] == [], result


def test_it_binds_the_namespaces_the_operator_watches():
    policy, binding = policy_of(ON)
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"] and "matchResources" not in binding["spec"]
    _, binding = policy_of({**ON, "watchNamespace": "search"})
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "search"}
    rule = policy["spec"]["matchConstraints"]["resourceRules"][0]
    # The services themselves, not their status or scale (the operator's writes, kubectl scale).
    assert rule["resources"] == ["embeddingservices"] and set(rule["operations"]) == {"CREATE", "UPDATE"}
    assert policy["spec"]["failurePolicy"] == "Fail"


def service(spec, **meta) -> dict:
    return {"apiVersion": "embedfleet.dev/v1alpha1", "kind": "EmbeddingService",
            "metadata": {"name": "svc", "namespace": "search", **meta}, "spec": spec}


def judge(values, spec, old: dict | None = None, **meta) -> list[str]:
    """What the API server's CEL would answer for an EmbeddingService with `spec` (and `meta`),
    created, or updated from the stored object `old`: the messages of the validations that fail
    (empty: admitted). As the API server does, a matchCondition that is false leaves the request
    unjudged."""
    policy, _ = policy_of(values)
    env = celpy.Environment()
    activation = {"object": celpy.json_to_cel(service(spec, **meta)),
                  "oldObject": celpy.json_to_cel(old),
                  "request": celpy.json_to_cel({"operation": "UPDATE" if old else "CREATE"})}

    def run(expression):
        return env.program(env.compile(expression)).evaluate(activation)

    if not all(run(c["expression"]) for c in policy["spec"].get("matchConditions", [])):
        return []
    return [str(run(v["messageExpression"])) for v in policy["spec"]["validations"] if not run(v["expression"])]


FULL = yaml.safe_load((ROOT / "crds" / "examples" / "full.yaml").read_text())["spec"]


@pytest.mark.parametrize("spec", [
    {"model": "m"},  # the operator's default image, the default account, no priority class
    FULL,  # registry.example.com/embedfleet/..., embedserve, inference-high: all listed
    {"model": "m", "image": f"{SERVER}:0.1.0"},  # the chart's server image, another version
    {"model": "m", "image": f"{SERVER}@sha256:{'a' * 64}"},
    {"model": "m", "serviceAccountName": "", "priorityClassName": ""},
])
def test_services_within_the_policy_are_admitted(spec):
    assert judge(ON, spec) == []


@pytest.mark.parametrize("spec, said", [
    ({"model": "m", "image": "docker.io/attacker/miner:latest"}, "spec.image docker.io/attacker/miner:latest is not allowed"),
    # A prefix is a prefix of the whole reference: the chart's repository name alone is not enough.
    ({"model": "m", "image": f"{SERVER}-evil:1"}, f"spec.image {SERVER}-evil:1 is not allowed"),
    ({"model": "m", "serviceAccountName": "cluster-admin-sa"}, "spec.serviceAccountName cluster-admin-sa is not allowed: one of embedserve"),
    ({"model": "m", "priorityClassName": "system-node-critical"}, "spec.priorityClassName system-node-critical is not allowed"),
])
def test_services_beyond_it_are_refused_naming_the_field(spec, said):
    (message,) = judge(ON, spec)
    assert said in message and "admissionPolicy" in message


def test_nothing_listed_allows_only_the_defaults():
    off_list = {"admissionPolicy": {"enabled": True}}
    assert judge(off_list, {"model": "m", "image": f"{SERVER}:9.9"}) == []
    assert len(judge(off_list, FULL)) == 3
    assert "leave it unset" in judge(off_list, {"model": "m", "serviceAccountName": "embedserve"})[0]


# A service the policy would refuse today: made before it was enabled, or before an allow-list
# was narrowed (here: none of the three is listed any more).
BEYOND = {"model": "m", "image": "docker.io/someone/embedserve:1", "serviceAccountName": "embedserve",
          "priorityClassName": "inference-high"}
NARROWED = {"admissionPolicy": {"enabled": True}}


def test_a_service_beyond_the_policy_can_still_be_deleted():
    """Deleting with foreground propagation (the chart's uninstall hook, kubectl delete
    --cascade=foreground) stamps deletionTimestamp and the foregroundDeletion finalizer; the
    garbage collector takes the finalizer off with an UPDATE of the whole object once the
    dependents are gone. Refused, the service would stay Terminating for good."""
    assert len(judge(NARROWED, BEYOND)) == 3  # as a create: refused
    terminating = service(BEYOND, deletionTimestamp="2026-12-01T00:00:00Z", finalizers=["foregroundDeletion"])
    assert judge(NARROWED, BEYOND, old=terminating, deletionTimestamp="2026-12-01T00:00:00Z", finalizers=[]) == []
    # Whatever such an update carries: the operator no longer acts on a service being deleted.
    assert judge(NARROWED, {**BEYOND, "image": "docker.io/attacker/miner:1"}, old=terminating,
                 deletionTimestamp="2026-12-01T00:00:00Z") == []


def test_an_update_that_leaves_the_judged_fields_alone_is_admitted():
    """kubectl label/annotate, a finalizer of someone else's, a spec edit elsewhere."""
    stored = service(BEYOND)
    assert judge(NARROWED, BEYOND, old=stored, labels={"team": "search"}) == []
    assert judge(NARROWED, {**BEYOND, "replicas": 3, "model": "other"}, old=stored) == []


def test_an_update_is_judged_on_each_field_it_changes():
    stored = service(BEYOND)
    (refused,) = judge(NARROWED, {**BEYOND, "image": "docker.io/attacker/miner:1"}, old=stored)
    assert "spec.image docker.io/attacker/miner:1 is not allowed" in refused
    assert judge(NARROWED, {**BEYOND, "image": f"{SERVER}:0.3.0"}, old=stored) == []  # into the policy: fine
    (refused,) = judge(NARROWED, {**BEYOND, "serviceAccountName": "cluster-admin-sa"}, old=stored)
    assert "spec.serviceAccountName cluster-admin-sa is not allowed" in refused
    # A field set where it was unset is a change too.
    (refused,) = judge(NARROWED, {"model": "m", "priorityClassName": "system-node-critical"},
                       old=service({"model": "m"}))
    assert "spec.priorityClassName system-node-critical is not allowed" in refused
