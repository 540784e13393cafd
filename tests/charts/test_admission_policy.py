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


def judge(values, spec) -> list[str]:
    """What the API server's CEL would answer for an EmbeddingService with `spec`: the messages
    of the validations that fail (empty: admitted)."""
    policy, _ = policy_of(values)
    env = celpy.Environment()
    obj = celpy.json_to_cel({"apiVersion": "embedfleet.dev/v1alpha1", "kind": "EmbeddingService",
                             "metadata": {"name": "svc", "namespace": "search"}, "spec": spec})
    refused = []
    for v in policy["spec"]["validations"]:
        if not env.program(env.compile(v["expression"])).evaluate({"object": obj}):
            refused.append(str(env.program(env.compile(v["messageExpression"])).evaluate({"object": obj})))
    return refused


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
