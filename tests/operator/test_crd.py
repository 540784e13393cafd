"""The CRD: generated file up to date, valid for Kubernetes, examples valid against its schema,
bad resources rejected — by the OpenAPI schema (jsonschema) and its CEL rules (cel-python)."""

import copy
from pathlib import Path

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from embedop import crd, spec as specs

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0"]


def load(name):
    return yaml.safe_load((ROOT / "crds" / "examples" / name).read_text())


def schema():
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def strict(s):
    """kubectl's strict field validation: unknown fields are errors."""
    s = copy.deepcopy(s)
    if s.get("type") == "object" and "properties" in s and "additionalProperties" not in s:
        s["additionalProperties"] = False
        s["properties"]["metadata"] = s["properties"].get("metadata", {"type": "object"})
    for key in ("properties",):
        for name, sub in s.get(key, {}).items():
            s[key][name] = strict(sub) if name != "metadata" else sub
    if "items" in s:
        s["items"] = strict(s["items"])
    return s


def cel_errors(obj: dict, s: dict) -> list[str]:
    """Evaluate every x-kubernetes-validations rule on the (defaulted) object, as the API server does."""
    errors = []
    env = celpy.Environment()
    for rule in s.get("x-kubernetes-validations", []):
        if not env.program(env.compile(rule["rule"])).evaluate({"self": celpy.json_to_cel(obj)}):
            errors.append(rule["message"])
    if s.get("type") == "object" and isinstance(obj, dict):
        for name, sub in s.get("properties", {}).items():
            if name in obj:
                errors += cel_errors(obj[name], sub)
    if s.get("type") == "array" and isinstance(obj, list) and "items" in s:
        for item in obj:
            errors += cel_errors(item, s["items"])
    return errors


def test_generated_file_is_up_to_date():
    assert (ROOT / "crds" / "embeddingservice.yaml").read_text() == crd.render_yaml(), \
        "run: python -m embedop.crd > crds/embeddingservice.yaml"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_validates_strictly(version):
    kubernetes_validate.validate(crd.crd(), version, strict=True)


def test_every_schema_field_is_described():
    missing = []

    def walk(s, path):
        if path and "description" not in s and not path.endswith((".metadata", ".apiVersion", ".kind")):
            missing.append(path)
        for name, sub in s.get("properties", {}).items():
            walk(sub, f"{path}.{name}")
        if "items" in s and s["items"].get("type") == "object":
            walk(s["items"], f"{path}[]")

    walk(schema()["properties"]["spec"], "spec")
    walk(schema()["properties"]["status"], "status")
    assert missing == []


def test_scale_subresource_and_printer_columns():
    version = crd.crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Model", "Task", "Ready", "Desired", "Service-Rate", "Drain-Ms", "Age"]
    (task,) = [c for c in version["additionalPrinterColumns"] if c["name"] == "Task"]
    assert task == {"name": "Task", "type": "string", "jsonPath": ".status.task"}
    assert schema()["properties"]["status"]["properties"]["task"]["type"] == "string"


@pytest.mark.parametrize("name", ["minimal.yaml", "full.yaml", "reranker.yaml", "secured.yaml", "retrieval-stack.yaml"])
def test_examples_are_valid(name):
    obj = load(name)
    jsonschema.validate(obj, strict(schema()))
    defaulted = specs.defaulted(obj["spec"])
    assert cel_errors(defaulted, schema()["properties"]["spec"]) == []
    assert specs.problems(defaulted) == []


BAD = [
    ("unknown pooling", lambda s: s.update(pooling={"strategy": "maxi"}), "'maxi' does not match"),
    ("unknown second pooling", lambda s: s.update(pooling={"strategy": "mean+last"}), r"'mean\+last' does not match"),
    ("negative replicas", lambda s: s.update(replicas=-1), "-1 is less than the minimum"),
    ("unknown field", lambda s: s.update(modle="x"), "Additional properties"),
    ("bad mode", lambda s: s.update(autoscaling={"mode": "knative"}), "'knative' is not one of"),
    ("bad quantity", lambda s: s.update(resources={"memory": "lots"}), "does not match"),
    ("utilization > 1", lambda s: s.update(autoscaling={"targetUtilization": 1.5}), "greater than the maximum"),
    ("unknown task", lambda s: s.update(task="summarize"), "'summarize' is not one of"),
    ("task in capitals", lambda s: s.update(task="Rerank"), "'Rerank' is not one of"),
    ("auth without a Secret", lambda s: s.update(auth={}), "'apiKeySecretRef' is a required property"),
    ("auth Secret without a name", lambda s: s.update(auth={"apiKeySecretRef": {"key": "k"}}), "'name' is a required property"),
    ("auth Secret not a DNS name", lambda s: s.update(auth={"apiKeySecretRef": {"name": "My_Keys"}}), "'My_Keys' does not match"),
    ("auth key a path", lambda s: s.update(auth={"apiKeySecretRef": {"name": "k", "key": "../etc/passwd"}}), "does not match"),
    ("tls without a Secret", lambda s: s.update(tls={"clientAuth": True}), "'secretRef' is a required property"),
    ("tls Secret not a DNS name", lambda s: s.update(tls={"secretRef": {"name": "-tls"}}), "'-tls' does not match"),
    ("tls clientAuth not a boolean", lambda s: s.update(tls={"secretRef": {"name": "t"}, "clientAuth": "yes"}), "'yes' is not of type 'boolean'"),
    ("networkPolicy enabled not a boolean", lambda s: s.update(networkPolicy={"enabled": "true"}), "'true' is not of type 'boolean'"),
    ("networkPolicy from not a list", lambda s: s.update(networkPolicy={"from": {"podSelector": {}}}), "is not of type 'array'"),
    ("networkPolicy unknown field", lambda s: s.update(networkPolicy={"enabled": True, "egress": []}), "Additional properties"),
]


@pytest.mark.parametrize("task", crd.TASKS)
def test_every_task_is_accepted(task):
    obj = load("minimal.yaml")
    obj["spec"]["task"] = task
    jsonschema.validate(obj, strict(schema()))
    # What a server may be told (its TASK, auto aside): one list for both images.
    from embedserve.model_list import TASKS as SERVED

    assert schema()["properties"]["spec"]["properties"]["task"]["enum"] == [t for t in SERVED if t != "auto"] != []


@pytest.mark.parametrize("label, mutate, message", BAD, ids=[b[0] for b in BAD])
def test_bad_resources_are_rejected_by_the_schema(label, mutate, message):
    obj = load("minimal.yaml")
    mutate(obj["spec"])
    with pytest.raises(jsonschema.ValidationError, match=message):
        jsonschema.validate(obj, strict(schema()))


CROSS_FIELD = [  # field, value, the CEL rule's message, the operator's problem
    ("autoscaling", {"minReplicas": 5, "maxReplicas": 2}, "minReplicas must not exceed maxReplicas", "exceeds maxReplicas"),
    ("admission", {"latencySoftMs": 900, "latencyHardMs": 100}, "latencySoftMs must not exceed latencyHardMs", "latencySoftMs"),
    # Demand is read from running pods: a fleet of 0 in mode operator would never scale up.
    ("autoscaling", {"minReplicas": 0}, "minReplicas must be at least 1 in modes operator and hpa", "to stop a service"),
    ("autoscaling", {"mode": "hpa", "minReplicas": 0}, "minReplicas must be at least 1 in modes operator and hpa",
     "to stop a service"),
    ("rollout", {"maxSurge": 0, "maxUnavailable": 0}, "cannot both be 0", "cannot both be 0"),
    ("rollout", {"maxSurge": "0%", "maxUnavailable": 0}, "cannot both be 0", "cannot both be 0"),
    ("env", [{"name": "A", "value": "x", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
     "value and valueFrom are exclusive", "value and valueFrom are exclusive"),
    # The probes, Services and scrapes use these ports: spec.env cannot move them.
    ("env", [{"name": "HTTP_HEALTH_PORT", "value": "9000"}], "spec.env cannot override them", "HTTP_HEALTH_PORT"),
    ("env", [{"name": "GRPC_PORT", "value": "9001"}], "spec.env cannot override them", "GRPC_PORT"),
    ("env", [{"name": "METRICS_PORT", "value": "9002"}], "spec.env cannot override them", "METRICS_PORT"),
    ("modelCache", {"image": {"reference": "r/m:1"}, "claimName": "c"}, "image and claimName are exclusive",
     "image and claimName are exclusive"),
    ("modelCache", {"prefill": True}, "prefill needs claimName", "prefill needs claimName"),
    # Exactly one of model and models (no model at all, and the rest: test_models.py's MODEL_CASES).
    ("models", [{"name": "a", "model": "m"}], crd.MODEL_RULE, crd.MODEL_RULE),
]


@pytest.mark.parametrize("field, value, message, problem", CROSS_FIELD)
def test_cross_field_rules_reject(field, value, message, problem):
    obj = load("minimal.yaml")
    obj["spec"][field] = value
    jsonschema.validate(obj, strict(schema()))  # each field alone is fine
    defaulted = specs.defaulted(obj["spec"])
    assert any(message in e for e in cel_errors(defaulted, schema()["properties"]["spec"]))
    assert any(problem in p for p in specs.problems(defaulted))  # the operator agrees


def test_zero_replicas_are_mode_keda_s_to_scale_to():
    """Mode keda may go to 0 pods (KEDA and its HTTP add-on wake it); operator and hpa may not."""
    spec = {"model": "m", "autoscaling": {"mode": "keda", "minReplicas": 0, "idleSeconds": 600}}
    jsonschema.validate({"apiVersion": "embedfleet.dev/v1alpha1", "kind": "EmbeddingService",
                         "metadata": {"name": "x"}, "spec": spec}, strict(schema()))
    defaulted = specs.defaulted(spec)
    assert cel_errors(defaulted, schema()["properties"]["spec"]) == [] and specs.problems(defaulted) == []
    assert specs.defaulted({"model": "m"})["autoscaling"]["idleSeconds"] == 300


def test_a_stopped_service_is_mode_off_with_zero_replicas():
    spec = {"model": "m", "replicas": 0, "autoscaling": {"mode": "off", "minReplicas": 0}}
    jsonschema.validate({"apiVersion": "embedfleet.dev/v1alpha1", "kind": "EmbeddingService",
                         "metadata": {"name": "x"}, "spec": spec}, strict(schema()))
    defaulted = specs.defaulted(spec)
    assert cel_errors(defaulted, schema()["properties"]["spec"]) == [] and specs.problems(defaulted) == []


@pytest.mark.parametrize("field, value, problem", [
    ("affinity", {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {
        "matchExpressions": [{"key": "a", "operator": "In", "value": ["x"]}]}}]}},
     "preferredDuringSchedulingIgnoredDuringExecution[0].preference.matchExpressions[0].value: unknown field"),
    ("affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerm": []}}},
     "missing required field `nodeSelectorTerms`"),
    ("topologySpreadConstraints", [{"maxSkew": "one", "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
     "Expected `int`, got `str`"),
    ("envFrom", [{"secretRef": {"name": "s"}, "prefx": "S3_"}], "envFrom[0].prefx: unknown field"),
    ("env", [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k", "optinal": True}}}],
     "env[0].valueFrom.secretKeyRef.optinal: unknown field"),
])
def test_kubernetes_typed_fields_are_checked_against_the_kubernetes_models(field, value, problem):
    """The CRD leaves them open (preserve-unknown-fields); the API server would drop a misspelt
    field without a word, so the operator refuses the spec with the field's path."""
    spec = specs.defaulted({"model": "m", field: value})
    assert any(problem in p for p in specs.problems(spec)), specs.problems(spec)


def test_defaults_fill_nested_objects():
    s = specs.defaulted({"model": "m", "batching": {"maxBatchSize": 64}})
    assert s["batching"] == {"maxBatchSize": 64, "buckets": [16, 32, 64, 128, 256, 512],
                             "maxTokensPerBatch": 32768, "deadlineWaitMs": 50}
    assert s["autoscaling"]["mode"] == "operator" and s["pooling"] == {}  # pooling: as the model declares
    assert s["resources"] == {"gpu": 1, "cpu": "4", "memory": "16Gi"}


@pytest.mark.parametrize("spec, problem", [
    # Ours would be overridden: a server pointed at files that are not mounted.
    ({"auth": {"apiKeySecretRef": {"name": "k"}}, "env": [{"name": "API_KEYS_FILE", "value": "/x"}]}, "API_KEYS_FILE"),
    ({"tls": {"secretRef": {"name": "t"}}, "env": [{"name": "TLS_CLIENT_CA_FILE", "value": "/x"}]}, "TLS_CLIENT_CA_FILE"),
    # Each peer as the API server requires it (the CRD leaves peers open).
    ({"networkPolicy": {"enabled": True, "from": [{}]}}, "networkPolicy.from[0]: a peer is"),
    ({"networkPolicy": {"enabled": True, "metricsFrom": [{"podSelector": {}}, {"ipBlock": {"cidr": "10.0.0.0/8"},
                                                                                 "podSelector": {}}]}},
     "networkPolicy.metricsFrom[1]: a peer is"),
    ({"networkPolicy": {"enabled": True, "from": [{"podSelectr": {}}]}}, "networkPolicy.from[0].podSelectr: unknown field"),
    ({"networkPolicy": {"enabled": True, "from": [{"ipBlock": {"cidr": 10}}]}}, "networkPolicy.from: Expected `str`"),
    ({"batching": {"buckets": [64, 32]}}, "ascending"),
    ({"batching": {"maxTokensPerBatch": 100}}, "below the largest bucket"),
    ({"pooling": {"strategy": "cls", "excludeTokens": ["[x]"]}}, "mean pooling only"),
])
def test_schema_valid_specs_that_cannot_work(spec, problem):
    problems = specs.problems(specs.defaulted({"model": "m", **spec}))
    assert any(problem in p for p in problems)


def test_a_name_whose_headless_service_would_not_fit_a_dns_label_is_refused():
    """NAME-headless must fit 63 characters: a longer name would create a Deployment and a Service
    and fail only on the third object."""
    root = schema()
    ok, long = "a" * crd.MAX_NAME, "a" * (crd.MAX_NAME + 1)
    for name, errors in ((ok, []), (long, [crd.NAME_RULE])):
        obj = {"metadata": {"name": name}, "spec": {"model": "m"}}
        assert cel_errors(obj, {k: v for k, v in root.items() if k != "properties"}) == errors
    assert len(f"{ok}-headless") == 63
    assert any("metadata.name" in p for p in specs.problems(specs.defaulted({"model": "m"}), long))
    assert specs.problems(specs.defaulted({"model": "m"}), ok) == []


def test_more_than_one_gpu_is_refused_by_the_operator_too():
    assert any("resources.gpu" in p for p in specs.problems(specs.defaulted({"model": "m", "resources": {"gpu": 4}})))
