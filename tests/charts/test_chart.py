"""The Helm chart, rendered and linted by the real Helm SDK; every object validated against real
Kubernetes schemas; its RBAC equal to the calls the operator makes; the images' Dockerfiles linted."""

import shutil
import subprocess
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

import embedop
import embedserve
from embedop import crd, kube, uninstall

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "embedfleet"
K8S_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0"]
CUSTOM_KINDS = {"ServiceMonitor", "EmbeddingService"}  # validated by their own CRDs, not here
HELM_DEFAULT_TIMEOUT_S = 300  # helm uninstall --timeout

MATRIX = {
    "defaults": {},
    "namespaced": {"watchNamespace": "search"},
    "hooks": {"uninstall": {"deleteServices": True}},
    "hooks-namespaced": {"watchNamespace": "search", "uninstall": {"deleteServices": True}},
    # What a namespace's admin can install: nothing cluster-scoped.
    "namespace-only": {"watchNamespace": "search", "crds": {"install": False}, "scopeCheck": {"enabled": False}},
    "all-on": {"serviceMonitor": {"enabled": True}, "networkPolicy": {"enabled": True, "healthFrom": [
                   {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
               "prometheusAdapter": {"enabled": True}, "grafanaDashboard": {"enabled": True},
               "nodeSelector": {"pool": "system"}, "imagePullSecrets": [{"name": "regcred"}],
               "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]},
}


def render(values, namespace="embedfleet-system"):
    chart = helm.Chart.load(str(CHART))
    files = chart.render(values, name="ef", namespace=namespace, is_install=True)
    objects = []
    for path, text in files.items():
        if path.endswith("NOTES.txt"):
            continue
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


@pytest.mark.parametrize("case", sorted(MATRIX))
def test_lint_is_clean(case):
    result = helm.lint(str(CHART), MATRIX[case], strict=True, kube_version="v1.31.0")
    # Helm's severities: 1 info, 2 warning, 3 error. (Info: "icon is recommended".)
    assert result["errors"] == [] and [m for m in result["messages"] if m["severity"] >= 2] == [], result


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case", sorted(MATRIX))
def test_rendered_objects_validate_strictly(case, version):
    objects = render(MATRIX[case])
    assert {o["kind"] for o in objects} >= {"Deployment", "ServiceAccount"}
    for obj in objects:
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_all_options_render_what_they_promise():
    kinds = {(o["kind"], o["metadata"]["name"]) for o in render(MATRIX["all-on"])}
    assert ("ServiceMonitor", "ef-operator-servers") in kinds
    assert ("ConfigMap", "ef-operator-adapter-rules") in kinds and ("ConfigMap", "ef-operator-dashboard") in kinds
    assert ("NetworkPolicy", "ef-operator") in kinds
    dashboard = next(o for o in render(MATRIX["all-on"]) if o["metadata"]["name"] == "ef-operator-dashboard")
    import json

    titles = [p["title"] for p in json.loads(dashboard["data"]["embedfleet.json"])["panels"]]
    for word in ("Service rate", "drain", "Queued", "Replicas", "Rejections", "latency", "Padding"):
        assert any(word.lower() in t.lower() for t in titles), word


def test_operator_pod_is_locked_down():
    d = next(o for o in render({}) if o["kind"] == "Deployment")
    pod = d["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"] and not c["securityContext"]["allowPrivilegeEscalation"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["resources"]["limits"]


@pytest.mark.parametrize("host, bound", [("0.0.0.0", "0.0.0.0"), ("[::]", "::")])
def test_the_operators_health_endpoint_binds_the_family_asked_for(host, bound):
    """kopf binds the --liveness URL's host (urlsplit's hostname): IPv6-only clusters need [::]."""
    import urllib.parse

    d = next(o for o in render({"probeHost": host}) if o["kind"] == "Deployment")
    liveness = next(a for a in d["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--liveness="))
    assert urllib.parse.urlsplit(liveness.partition("=")[2]).hostname == bound


def is_hook(o):
    return "helm.sh/hook" in (o["metadata"].get("annotations") or {})


def rbac_calls(objects):
    return set(rbac_call_list(objects))


def rbac_call_list(objects):
    """rbac_calls, each rule's calls as often as the rules grant them (sorted): a duplicate shows."""
    return sorted((g, r, v) for o in objects if o["kind"] in ("ClusterRole", "Role") for rule in o["rules"]
                  for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"])


def operator_env(objects) -> dict:
    d = next(o for o in objects if o["kind"] == "Deployment" and not is_hook(o))
    return {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}


def named(o: dict, suffix: str) -> bool:
    return o["metadata"]["name"].endswith(suffix)


@pytest.mark.parametrize("case", ["defaults", "namespaced"])
def test_rbac_is_exactly_what_the_operator_calls(case):
    objects = [o for o in render(MATRIX[case]) if not is_hook(o)]
    assert rbac_calls(objects) == kube.CALLS
    for role in (o for o in objects if o["kind"] in ("ClusterRole", "Role")):  # each grant once
        granted = rbac_call_list([role])
        assert len(granted) == len(set(granted)), [c for c in set(granted) if granted.count(c) > 1]
    assert len(kube.CALL_LIST) == len(set(kube.CALL_LIST))  # each call declared once
    assert ("embedfleet.dev", "embeddingservices/finalizers", "update") in kube.CALLS  # OpenShift: blockOwnerDeletion
    roles = {o["kind"] for o in objects if "Role" in o["kind"] and not named(o, "-leader") and not named(o, "-scaler")
             and not named(o, "-scope.embedfleet-system")}
    assert roles == ({"Role", "RoleBinding"} if case == "namespaced" else {"ClusterRole", "ClusterRoleBinding"})
    # KEDA's scaler (mode keda): the leader labels its own pod, and takes a former leader's label
    # off (listed by it), in its own namespace, nothing else.
    (own,) = [o for o in objects if o["kind"] == "Role" and named(o, "-scaler")]
    assert own["metadata"]["namespace"] == "embedfleet-system"
    assert rbac_calls([own]) == {("", "pods", "list"), ("", "pods", "patch")}
    # The Lease is the operator's own, in its own namespace, whatever it watches: created (RBAC
    # cannot name what a create makes), then read and renewed by its name only.
    (lease,) = [o for o in objects if o["kind"] == "Role" and named(o, "-leader")]
    assert lease["metadata"]["namespace"] == "embedfleet-system"
    by_verb = {v: rule.get("resourceNames") for rule in lease["rules"] for v in rule["verbs"]}
    assert by_verb == {"create": None, "get": [operator_env(objects)["EMBEDOP_LEASE_NAME"]],
                       "patch": [operator_env(objects)["EMBEDOP_LEASE_NAME"]]}
    # The other releases' scope claims: listed across the cluster, nothing else.
    (scope,) = [o for o in objects if o["kind"] == "ClusterRole" and named(o, "-scope.embedfleet-system")]
    assert rbac_calls([scope]) == {("coordination.k8s.io", "leases", "list")}
    assert rbac_calls([lease, scope]) == {c for c in kube.CALLS if c[1] == "leases"}
    assert not any("*" in str(rule) for o in objects if "Role" in o["kind"] for rule in o.get("rules", []))
    assert not any(r == "secrets" for _, r, _ in rbac_calls(objects))


def test_the_operator_never_writes_an_embedding_service_itself():
    """Its status and its scale (spec.replicas) only: the cluster-wide patch of every service,
    kept for the finalizer of operators before 0.1.1, is gone with it."""
    for calls in (kube.CALLS, rbac_calls(render({}))):
        assert {v for g, r, v in calls if r == "embeddingservices"} == {"get", "list", "watch"}
        assert {(r, v) for g, r, v in calls if r.startswith("embeddingservices/")} == {
            ("embeddingservices/status", "patch"), ("embeddingservices/scale", "patch"),
            ("embeddingservices/finalizers", "update")}


def test_pods_and_claims_are_granted_only_what_the_operator_does_with_them():
    """Pods: listed and watched (by label: RBAC cannot say so), patched (pod-deletion-cost), never
    read one by one, created or deleted; model-cache claims: read only."""
    calls = rbac_calls(render(MATRIX["namespaced"]))
    assert {v for g, r, v in calls if r == "pods"} == {"list", "watch", "patch"}
    assert {v for g, r, v in calls if r == "persistentvolumeclaims"} == {"get", "list", "watch"}


@pytest.mark.parametrize("case", ["hooks", "hooks-namespaced"])
def test_uninstall_hook_deletes_the_services_with_exactly_its_own_rights(case):
    hooks = [o for o in render(MATRIX[case]) if is_hook(o)]
    assert {o["metadata"]["annotations"]["helm.sh/hook"] for o in hooks} == {"pre-delete"}
    assert rbac_calls(hooks) == uninstall.CALLS
    (job,) = [o for o in hooks if o["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", "embedop.uninstall"] and "--timeout=240" in c["args"]
    assert ("--namespace=search" in c["args"]) == (case == "hooks-namespaced")
    assert pod["serviceAccountName"] in {o["metadata"]["name"] for o in hooks if o["kind"] == "ServiceAccount"}
    assert c["securityContext"]["readOnlyRootFilesystem"]
    # Its RBAC exists before the Job runs, and lasts until it has finished.
    weights = {o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for o in hooks}
    assert max(v for k, v in weights.items() if k != "Job") < weights["Job"]
    assert all("hook-succeeded" in o["metadata"]["annotations"]["helm.sh/hook-delete-policy"] for o in hooks)


def hook_job(values):
    values = {**values, "uninstall": {"deleteServices": True, **values.get("uninstall", {})}}
    return next(o for o in render(values) if is_hook(o) and o["kind"] == "Job")


@pytest.mark.parametrize("timeout", [None, 120])
def test_uninstall_hook_makes_one_attempt_within_helms_wait(timeout):
    """A second attempt, or a deadline past Helm's wait (--timeout, 5m by default), could never be
    waited for; the deadline leaves the pod room to start beyond the module's own timeout."""
    job = hook_job({"uninstall": {"timeoutSeconds": timeout}} if timeout else {})
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert job["spec"]["backoffLimit"] == 0
    assert f"--timeout={timeout or 240}" in args
    assert (timeout or 240) < job["spec"]["activeDeadlineSeconds"] < HELM_DEFAULT_TIMEOUT_S


@pytest.mark.parametrize("case", ["hooks", "hooks-namespaced"])
def test_uninstall_hook_pod_is_not_taken_for_the_operator(case):
    """Nothing that selects the operator's pods (its Deployment, kubectl logs -l) selects the hook's."""
    operator = next(o for o in render(MATRIX[case]) if o["kind"] == "Deployment" and not is_hook(o))
    hook_pod = hook_job(MATRIX[case])["spec"]["template"]["metadata"]["labels"]
    selector = operator["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= hook_pod.items(), hook_pod
    assert hook_pod["app.kubernetes.io/name"] != operator["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]


def test_uninstall_leaves_the_services_by_default():
    """One mistake (an uninstall to reinstall) must not delete every fleet and cost their warm-ups."""
    assert not any(is_hook(o) for o in render({}))
    assert "unmanaged" in notes({}) and "uninstall.deleteServices=true" in notes({})


def notes(values):
    files = helm.Chart.load(str(CHART)).render(values, name="ef", namespace="x", is_install=True)
    return next(v for k, v in files.items() if k.endswith("NOTES.txt"))


def test_notes_explain_rollouts_images_replicas_and_uninstall():
    for values, words in (({}, ("valueFrom", "maxSurge 0, maxUnavailable 1", "spec.image", "kubectl delete crd",
                                "spec.replicas", "use mode off", "/spec/replicas", "kubectl delete embsvc")),
                          (MATRIX["hooks"], ("pre-delete", "--timeout", "kubectl delete crd"))):
        text = notes(values)
        for w in words:
            assert w in text, w


def test_notes_warn_loudly_that_the_hook_deletes_every_service_in_the_cluster():
    """watchNamespace "": the hook deletes every EmbeddingService in the cluster, whoever made it."""
    assert "WARNING" in notes(MATRIX["hooks"]) and "EVERY EmbeddingService IN EVERY NAMESPACE" in notes(MATRIX["hooks"])
    assert "WARNING" not in notes(MATRIX["hooks-namespaced"]) and "in search" in notes(MATRIX["hooks-namespaced"])


def test_the_chart_works_as_a_dependency(tmp_path):
    """As a subchart, Helm passes it `global` (and the parent's values under its name): its
    values schema must accept them. Built with the real `helm dependency build`."""
    parent = tmp_path / "platform"
    (parent / "templates").mkdir(parents=True)
    (parent / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0",
        "dependencies": [{"name": "embedfleet", "version": yaml.safe_load((CHART / "Chart.yaml").read_text())["version"],
                          "repository": f"file://{CHART}"}]}))
    (parent / "values.yaml").write_text(yaml.safe_dump({"global": {"imageRegistry": "registry.example"},
                                                         "embedfleet": {"watchNamespace": "search"}}))
    helm.dependency_build(str(parent))
    files = helm.Chart.load(str(parent)).render({}, name="platform", namespace="infra", is_install=True)
    objects = [d for path, text in files.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]
    d = next(o for o in objects if o["kind"] == "Deployment")
    assert "--namespace=search" in d["spec"]["template"]["spec"]["containers"][0]["args"]
    assert any(path.startswith("platform/charts/embedfleet/") for path in files)
    with pytest.raises(helm.HelmError, match="unknownKey"):  # still strict about its own values
        helm.Chart.load(str(parent)).render({"embedfleet": {"unknownKey": 1}}, name="platform", namespace="infra")


def test_namespaced_install_watches_only_its_namespace():
    d = next(o for o in render(MATRIX["namespaced"]) if o["kind"] == "Deployment")
    assert "--namespace=search" in d["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("values, message", [
    ({"watchNamespace": "Not_A_Namespace"}, "watchNamespace"),
    ({"resyncSeconds": 0}, "resyncSeconds"),
    ({"image": {"repository": ""}}, "repository"),
    ({"unknownKey": 1}, "unknownKey"),
    ({"serviceMonitor": {"enabled": "yes"}}, "enabled"),
    ({"networkPolicy": {"enabled": True, "egress": []}}, "egress"),
    ({"networkPolicy": {"healthFrom": {"podSelector": {}}}}, "healthFrom"),
    ({"leaseName": "Not_A_Lease"}, "leaseName"),
    ({"admissionPolicy": {"enabled": True, "images": ["x/"]}}, "images"),
    ({"admissionPolicy": {"serviceAccounts": ["Not An Account"]}}, "serviceAccounts"),
    # A prefix that ends mid-name: registry.example/embedserve would admit registry.example/embedserve-evil.
    ({"admissionPolicy": {"imagePrefixes": ["registry.example/embedserve"]}}, "imagePrefixes"),
    ({"admissionPolicy": {"imagePrefixes": ["/"]}}, "imagePrefixes"),
    # 3 s would leave each API call of the operator 1 s (a third of the lease).
    ({"leaseSeconds": 9}, "leaseSeconds"),
    ({"scopeCheck": {"enabled": "no"}}, "enabled"),
])
def test_values_schema_rejects_bad_values(values, message):
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def test_values_schema_takes_prefixes_that_end_a_name_and_a_lease_of_ten_seconds():
    prefixes = ["registry.example/embedfleet/", "registry.example/embedserve:", "registry.example/embedserve@"]
    assert render({"admissionPolicy": {"imagePrefixes": prefixes}, "leaseSeconds": 10})


def test_a_namespace_only_install_needs_no_cluster_wide_rights():
    """watchNamespace with crds.install=false and scopeCheck.enabled=false: nothing cluster-scoped,
    so a namespace's admin can install it; the operator still makes every call but the claims'
    list (refused, it warns and runs: tests/operator/test_scope.py)."""
    objects = [o for o in render(MATRIX["namespace-only"]) if not is_hook(o)]
    assert not [(o["kind"], o["metadata"]["name"]) for o in objects if "namespace" not in o["metadata"]]
    assert rbac_calls(objects) == kube.CALLS - {("coordination.k8s.io", "leases", "list")}
    assert any(o["kind"] == "Lease" for o in objects)  # its own claim, for the releases after it


def test_chart_crd_is_the_operators_crd_byte_for_byte():
    assert (CHART / "templates" / "crd.yaml").read_text() == crd.render_chart_template()
    assert (ROOT / "crds" / "embeddingservice.yaml").read_text() == crd.render_yaml()


def test_an_upgrade_applies_the_crds_new_schema_and_uninstall_keeps_it():
    """Helm never upgrades what is under crds/: the CRD is a template, rendered by an upgrade as by
    an install, with the schema the operator defaults from, and kept at uninstall."""
    assert not (CHART / "crds").exists()
    chart = helm.Chart.load(str(CHART))
    files = chart.render({}, name="ef", namespace="x", is_upgrade=True)
    (rendered,) = [d for p, t in files.items() if not p.endswith("NOTES.txt") for d in yaml.safe_load_all(t)
                   if d and d["kind"] == "CustomResourceDefinition"]
    assert rendered["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert rendered["spec"] == crd.crd()["spec"]
    schema = rendered["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert "defaultImage" in schema["properties"]["status"]["properties"]  # a field added since 0.1.0
    assert not any(o["kind"] == "CustomResourceDefinition" for o in render({"crds": {"install": False}}))


def test_the_charts_crd_takes_the_reranker_example_and_refuses_an_unknown_task():
    """spec.task as the chart installs it: the reranker example valid, an unknown task refused,
    the served task a status field and a printer column."""
    import jsonschema

    (rendered,) = [o for o in render({}) if o["kind"] == "CustomResourceDefinition"]
    version = rendered["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    example = yaml.safe_load((ROOT / "crds" / "examples" / "reranker.yaml").read_text())
    assert example["spec"]["task"] == "rerank"
    jsonschema.validate(example, schema)
    with pytest.raises(jsonschema.ValidationError, match="'summarize' is not one of"):
        jsonschema.validate({**example, "spec": {**example["spec"], "task": "summarize"}}, schema)
    assert schema["properties"]["status"]["properties"]["task"]["type"] == "string"
    assert {"name": "Task", "type": "string", "jsonPath": ".status.task"} in version["additionalPrinterColumns"]


def test_values_of_a_release_from_before_the_crd_template_still_render():
    """helm upgrade --reuse-values: the old release's values have no `crds` (installed, as the
    default) and may have the removed `example` (ignored)."""
    for values in ({"crds": None, "example": {"enabled": True}}, {"crds": {}}):
        kinds = [o["kind"] for o in render(values)]
        assert "CustomResourceDefinition" in kinds and "EmbeddingService" not in kinds


def test_versions_agree():
    """One version names a release: the chart, its appVersion, both packages (and their
    pyprojects), the images the Dockerfiles say to build and the client image the docs run; and
    what the docs call an earlier release ("chart 0.2.0 or earlier") is older than it."""
    import re
    import tomllib

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == embedop.__version__ == embedserve.__version__
    version = chart["version"]
    for package in ("operator", "server"):
        assert tomllib.loads((ROOT / package / "pyproject.toml").read_text())["project"]["version"] == version
    for dockerfile, image in (("Dockerfile.operator", "embedop"), ("Dockerfile.server", "embedserve")):
        assert f"-t {image}:{version} ." in (ROOT / dockerfile).read_text(), dockerfile
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), CHART / "templates" / "NOTES.txt"]
    release = tuple(map(int, version.split(".")))
    for page in pages:
        text = page.read_text()
        for tag in re.findall(r"ghcr\.io/embedfleet/embed(?:serve|op):(\d+\.\d+\.\d+)", text):
            assert tag == version, (page.name, tag)
        for earlier in re.findall(r"(\d+\.\d+)\.(?:\d+|x)(?= or earlier| and earlier)", text):
            assert tuple(map(int, earlier.split("."))) < release[:2], (page.name, earlier)
    from embedop.config import OperatorSettings

    assert OperatorSettings().server_image.endswith(":" + chart["appVersion"])
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["serverImage"]["repository"] in OperatorSettings().server_image


@pytest.mark.parametrize("dockerfile", ["Dockerfile.server", "Dockerfile.operator"])
def test_hadolint_passes(dockerfile):
    hadolint = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    out = subprocess.run([hadolint, str(ROOT / dockerfile)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_images_run_as_non_root_and_the_operator_image_has_no_torch():
    server = (ROOT / "Dockerfile.server").read_text()
    operator = (ROOT / "Dockerfile.operator").read_text()
    assert "USER 10001" in server and "USER 10001" in operator
    import tomllib

    deps = tomllib.loads((ROOT / "operator" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(d.startswith(("torch", "transformers", "embedserve")) for d in deps)
    assert "./server" not in operator and "pip install -c constraints.txt ./operator" in operator
    assert 'ENTRYPOINT ["python", "-m", "embedserve"]' in server and "grpc_tools.protoc" in server
