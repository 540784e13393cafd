"""Every rendered object validates strictly against real Kubernetes schemas (1.29–1.34), and
carries what the spec says."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from embedop import crd, drift, render, spec as specs
from embedop.config import OperatorSettings
from embedserve.config import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0"]
OWNER = render.Owner("svc", "ns", "0b0c7e8e-0000-4000-8000-000000000001")
IMAGE = OperatorSettings().server_image


def example(name):
    return yaml.safe_load((ROOT / "crds" / "examples" / name).read_text())["spec"]


VARIATIONS = {
    "minimal": example("minimal.yaml"),
    "full": example("full.yaml"),
    "reranker": example("reranker.yaml"),
    "cpu-only": {"model": "m", "resources": {"gpu": 0, "cpu": "2", "memory": "4Gi"}},
    "hpa": {"model": "m", "autoscaling": {"mode": "hpa", "minReplicas": 2, "maxReplicas": 9}},
    "off": {"model": "m", "replicas": 5, "autoscaling": {"mode": "off"}},
    "stopped": {"model": "m", "replicas": 0, "autoscaling": {"mode": "off", "minReplicas": 0}},
    "cls-pooling": {"model": "m", "pooling": {"strategy": "cls", "normalize": False}},
    "big": {"model": "m", "resources": {"gpu": 1, "cpu": 32, "memory": "200Gi"}},
    "env-override": {"model": "m", "env": [{"name": "MAX_DRAIN_TIME_MS", "value": "900"}, {"name": "X", "value": "1"}]},
    "production": {
        "model": "s3://models/bge", "image": "registry.example/embedserve:1.2",
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "envFrom": [{"secretRef": {"name": "s3-credentials"}}, {"configMapRef": {"name": "tuning", "optional": True}}],
        "imagePullSecrets": [{"name": "regcred"}], "serviceAccountName": "embed-s3-reader",
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]}]}}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {"embedfleet.dev/service": "svc"}}}],
        "priorityClassName": "inference-high", "runtimeClassName": "nvidia",
        "podAnnotations": {"example.com/team": "search"}, "podLabels": {"team": "search"},
    },
    "surge": {"model": "m", "rollout": {"maxSurge": 1, "maxUnavailable": 0}},
    "percent": {"model": "m", "rollout": {"maxSurge": "25%", "maxUnavailable": "25%"}},
    "secured": example("secured.yaml"),
    "mtls-default-policy": {"model": "m", "tls": {"secretRef": {"name": "t"}, "clientAuth": True},
                            "networkPolicy": {"enabled": True}},
    # One guard each: every one moves the probes to the metrics port (test_health_port_*).
    "auth-only": {"model": "m", "auth": {"apiKeySecretRef": {"name": "k"}}},
    "tls-only": {"model": "m", "tls": {"secretRef": {"name": "t"}}},
    "policy-only": {"model": "m", "networkPolicy": {"enabled": True}},
}


def rendered(name):
    spec = specs.defaulted(VARIATIONS[name])
    assert specs.problems(spec) == []
    return spec, render.owned(OWNER, spec, spec.get("image", IMAGE), render.deployment_replicas(spec, None), 45)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(VARIATIONS))
def test_rendered_objects_validate_strictly(name, version):
    _, objects = rendered(name)
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_owned_objects_and_their_owner_reference():
    _, objects = rendered("minimal")
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Deployment", "svc"), ("Service", "svc"), ("Service", "svc-headless"), ("PodDisruptionBudget", "svc")]
    for o in objects:
        (ref,) = o["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "embedfleet.dev/v1alpha1", "kind": "EmbeddingService", "name": "svc",
                       "uid": OWNER.uid, "controller": True, "blockOwnerDeletion": True}
    assert objects[2]["spec"]["clusterIP"] == "None"
    hpa = [o for o in rendered("hpa")[1] if o["kind"] == "HorizontalPodAutoscaler"]
    assert len(hpa) == 1 and hpa[0]["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 120


def env_of(deployment):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_every_server_setting_from_the_spec_reaches_the_server_and_parses():
    spec, objects = rendered("full")
    env = env_of(objects[0])
    server = Settings.from_env(env)  # the server accepts what the operator renders
    assert server.model_path == "s3://models/bge-base-en-v1.5"
    assert server.buckets == (16, 32, 64, 128, 256, 512)
    assert (server.max_batch_size, server.max_tokens_per_batch, server.deadline_wait_ms) == (256, 65536, 20)
    assert server.backpressure_latency and server.max_drain_time_ms == 400
    assert (server.latency_soft_ms, server.latency_hard_ms) == (300, 1500)
    assert server.exclude_tokens == () and server.pooling == "" and server.normalize is None  # as declared
    assert "POOLING" not in env and "NORMALIZE" not in env
    assert server.device == "cuda" and env["LOG_LEVEL"] == "INFO"


def test_pooling_overrides_reach_the_server_only_when_set():
    spec = specs.defaulted({"model": "m", "pooling": {"strategy": "cls+mean", "normalize": False}})
    server = Settings.from_env(env_of(render.deployment(render.Owner("x", "ns", "uid"), spec, "img", 1, 45)))
    assert (server.pooling, server.normalize) == ("cls+mean", False)


@pytest.mark.parametrize("task", crd.TASKS)
def test_spec_task_is_the_servers_task(task):
    env = env_of(render.deployment(OWNER, specs.defaulted({"model": "m", "task": task}), "img", 1, 45))
    assert env["TASK"] == task
    assert Settings.from_env(env).task == task  # every task the CRD offers, the server takes


def test_no_task_lets_the_server_infer_it():
    env = env_of(render.deployment(OWNER, specs.defaulted({"model": "m"}), "img", 1, 45))
    assert "TASK" not in env and Settings.from_env(env).task == "auto"


def test_removing_spec_task_is_drift_that_removes_the_env():
    """The applied-render stamp changes with TASK gone, so the next apply (which no longer sends the
    entry) removes it, though every field still sent matches the live Deployment."""
    def stamped(spec):
        return drift.stamped(render.deployment(OWNER, specs.defaulted(spec), "img", 1, 45))
    live = stamped({"model": "m", "task": "rerank"})
    assert not drift.drifted(stamped({"model": "m", "task": "rerank"}), live)
    assert drift.drifted(stamped({"model": "m"}), live)
    assert drift.drifted(stamped({"model": "m", "task": "embed"}), live)


def test_spec_env_overrides_ours():
    env = env_of(rendered("env-override")[1][0])
    assert env["MAX_DRAIN_TIME_MS"] == "900" and env["X"] == "1"


@pytest.mark.parametrize("name, port", [("HTTP_HEALTH_PORT", render.HTTP_PORT), ("METRICS_PORT", render.METRICS_PORT),
                                        ("GRPC_PORT", render.GRPC_PORT)])
def test_spec_env_cannot_move_the_ports_the_probes_and_scrapes_use(name, port):
    spec = specs.defaulted({"model": "m", "env": [{"name": name, "value": "9000"}]})
    assert env_of(render.deployment(OWNER, spec, "img", 1, 45))[name] == str(port)
    assert any(name in p for p in specs.problems(spec))  # and the spec is refused, saying why


@pytest.mark.parametrize("name", sorted(VARIATIONS))
def test_no_empty_value_is_rendered(name):
    """The API server drops an empty string when it stores an object: a value it drops would read
    as drift at every check, and the Deployment would be applied again for ever."""
    def empties(obj, path=""):
        if isinstance(obj, dict):
            return [p for k, v in obj.items() for p in empties(v, f"{path}.{k}")]
        if isinstance(obj, list):
            return [p for i, v in enumerate(obj) for p in empties(v, f"{path}[{i}]")]
        return [path] if obj == "" and not path.startswith(".metadata.annotations") else []

    for obj in rendered(name)[1]:
        assert empties(obj) == [], obj["kind"]


def test_pdb_lets_unready_pods_be_evicted():
    """A Pending or crash-looping pod must not use up the budget and block every node drain."""
    pdb = next(o for o in rendered("minimal")[1] if o["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_a_model_cache_volume_is_not_re_owned_at_every_start():
    pod = rendered("minimal")[1][0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def test_gpu_probes_security_and_rollout():
    _, objects = rendered("full")
    d = objects[0]
    pod = d["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
    # No guard in the full example: every probe on the API port (render.health_port).
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": render.HTTP_PORT}, probe
    assert {"name": "metrics", "containerPort": render.METRICS_PORT, "protocol": "TCP"} in c["ports"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] and "lifecycle" in c
    assert pod["terminationGracePeriodSeconds"] == 45
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["volumes"][0] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}}
    assert d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8001"
    assert "nvidia.com/gpu" not in rendered("cpu-only")[1][0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_the_default_rollout_needs_no_spare_gpu_and_the_budget_matches_it():
    _, (d, *_, pdb) = rendered("minimal")
    # A surge pod needs a free GPU and never schedules on a full pool: replace one at a time.
    assert d["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert pdb["spec"]["maxUnavailable"] == 1
    # With a spare GPU, surge instead; the budget still lets a node drain evict one pod.
    _, (d, *_, pdb) = rendered("surge")
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert pdb["spec"]["maxUnavailable"] == 1
    _, (d, *_, pdb) = rendered("percent")
    assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == pdb["spec"]["maxUnavailable"] == "25%"


def test_a_slow_warm_up_is_not_a_failed_rollout():
    _, (d, *_) = rendered("minimal")
    probe = d["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    allowance = probe["periodSeconds"] * probe["failureThreshold"]
    assert allowance >= 900 and d["spec"]["progressDeadlineSeconds"] > allowance


def test_production_pod_fields_are_rendered():
    spec, (d, *_) = rendered("production")
    pod = d["spec"]["template"]["spec"]
    for field in ("imagePullSecrets", "serviceAccountName", "affinity", "topologySpreadConstraints",
                  "priorityClassName", "runtimeClassName"):
        assert pod[field] == spec[field], field
    c = pod["containers"][0]
    assert c["envFrom"] == spec["envFrom"] and c["image"] == "registry.example/embedserve:1.2"
    assert env_of(d)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    meta = d["spec"]["template"]["metadata"]
    assert meta["labels"]["team"] == "search" and meta["annotations"]["example.com/team"] == "search"
    assert meta["labels"]["embedfleet.dev/service"] == "svc"  # ours win: the selector needs them


@pytest.mark.parametrize("name", ["minimal", "production"])
def test_no_server_pod_and_no_fill_job_gets_the_default_accounts_api_token(name):
    """The servers never call the Kubernetes API: with the namespace's default account, its token
    is not mounted in them, nor in the fill Job's pod. A service that names its own account
    (production does) may need the token in the pod (Vault's agent injector logs in with it): the
    field is left out, and the account's own automountServiceAccountToken decides."""
    spec, (d, *_) = rendered(name)
    cached = specs.defaulted({**VARIATIONS[name], "modelCache": {"claimName": "models", "prefill": True}})
    job = render.fill_job(OWNER, cached, IMAGE, 45)
    for pod in (d["spec"]["template"]["spec"], job["spec"]["template"]["spec"]):
        assert pod.get("serviceAccountName") == spec.get("serviceAccountName")
        if spec.get("serviceAccountName"):
            assert "automountServiceAccountToken" not in pod
        else:
            assert pod["automountServiceAccountToken"] is False


def test_pod_labels_cannot_take_the_selector_labels():
    spec = specs.defaulted({"model": "m", "podLabels": {"embedfleet.dev/service": "other"}})
    d = render.deployment(OWNER, spec, IMAGE, 1, 45)
    assert d["spec"]["template"]["metadata"]["labels"]["embedfleet.dev/service"] == "svc"


@pytest.mark.parametrize("spec_image, pinned, default, image, notice", [
    (None, None, "img:2", "img:2", False),  # a new service: today's default
    (None, "img:1", "img:2", "img:1", True),  # created under img:1: kept, and said so
    (None, "img:2", "img:2", "img:2", False),
    ("mine:3", "img:1", "img:2", "mine:3", False),  # spec.image wins
    (None, "", "img:2", "img:2", False),  # spec.image was removed: today's default
])
def test_default_image_policy(spec_image, pinned, default, image, notice):
    spec = {"model": "m", **({"image": spec_image} if spec_image else {})}
    live = None if pinned is None else {"metadata": {"annotations": {render.DEFAULT_IMAGE: pinned}}}
    got, says = render.server_image(spec, live, default)
    assert got == image and bool(says) == notice
    if says:
        assert default in says and "spec.image" in says
    d = render.deployment(OWNER, specs.defaulted(spec), got, 1, 45)
    assert d["metadata"]["annotations"][render.DEFAULT_IMAGE] == ("" if spec_image else got)


def container(**fields):
    return {"spec": {"template": {"spec": {"containers": [{"name": "server", **fields}]}}}}


@pytest.mark.parametrize("desired, actual, same", [
    # Resource quantities: the API server writes them in its canonical form.
    (container(resources={"limits": {"cpu": "2.5", "memory": "1Gi"}}),
     container(resources={"limits": {"cpu": "2500m", "memory": "1024Mi"}}), True),
    (container(resources={"requests": {"cpu": 4}}), container(resources={"requests": {"cpu": "4"}}), True),
    (container(resources={"limits": {"cpu": "2"}}), container(resources={"limits": {"cpu": "3"}}), False),
    ({"volumes": [{"emptyDir": {"sizeLimit": "20Gi"}}]}, {"volumes": [{"emptyDir": {"sizeLimit": "20480Mi"}}]}, True),
    ({"volumes": [{"emptyDir": {"sizeLimit": "20Gi"}}]}, {"volumes": [{"emptyDir": {"sizeLimit": "20G"}}]}, False),
    # The HPA's target is a quantity too: "1000m" comes back as "1".
    ({"metrics": [{"pods": {"target": {"averageValue": "1000m"}}}]},
     {"metrics": [{"pods": {"target": {"averageValue": "1"}}}]}, True),
    # Everything else exactly: an env value is a string, not a quantity; false is not 0.
    (container(env=[{"name": "X", "value": "1k"}]), container(env=[{"name": "X", "value": "1000"}]), False),
    (container(env=[{"name": "CPU", "value": "2.5"}]), container(env=[{"name": "CPU", "value": "2500m"}]), False),
    ({"enableServiceLinks": False}, {"enableServiceLinks": 0}, False),
    ({"replicas": 1}, {"replicas": True}, False),
    ({"image": "a:1"}, {"image": "a:2"}, False),
    ({"labels": {"cpu": "2"}}, {"labels": {"cpu": "2.0"}}, False),
    # What the API server stores: an empty string is omitted (an env entry comes back without value).
    (container(env=[{"name": "X", "value": ""}]), container(env=[{"name": "X"}]), True),
    (container(env=[{"name": "X", "value": "a"}]), container(env=[{"name": "X"}]), False),
    # Entries of a keyed list that another manager added stay: ours are judged, not theirs.
    (container(env=[{"name": "X", "value": "a"}]),
     container(env=[{"name": "X", "value": "a"}, {"name": "INJECTED", "value": "1"}]), True),
    ({"containers": [{"name": "server", "image": "a"}]},
     {"containers": [{"name": "server", "image": "a"}, {"name": "istio-proxy", "image": "b"}]}, True),
    (container(env=[{"name": "X", "value": "a"}]), container(env=[{"name": "Y", "value": "a"}]), False),
    ({"args": ["--a"]}, {"args": ["--a", "--b"]}, False),  # a list without keys: exactly
    # Empty lists and maps are omitted too (a NetworkPolicy peer's matchExpressions: []).
    ({"podSelector": {"matchLabels": {"a": "b"}, "matchExpressions": []}}, {"podSelector": {"matchLabels": {"a": "b"}}}, True),
    ({"podSelector": {}}, {"podSelector": {}}, True),
    ({"podSelector": {"matchLabels": {"a": "b"}}}, {"podSelector": {}}, False),
])
def test_drift_compares_quantities_as_quantities_and_the_rest_exactly(desired, actual, same):
    assert drift.subset(desired, actual) is same


@pytest.mark.parametrize("name, live, decision, replicas", [
    ("off", None, None, 5), ("off", 2, 9, 5),  # autoscaling off: spec.replicas rules
    ("minimal", None, None, 1),  # operator, new service: spec.replicas (clamped)
    ("minimal", 3, None, 3),  # operator: the live count is kept ...
    ("minimal", 3, 2, 2),  # ... unless the autoscaler decides
    ("minimal", 99, None, 4), ("minimal", 0, None, 1),  # clamped to [min, max]
    ("hpa", 3, 4, None),  # the HPA owns the count
])
def test_deployment_replicas(name, live, decision, replicas):
    assert render.deployment_replicas(specs.defaulted(VARIATIONS[name]), live, decision) == replicas


@pytest.mark.parametrize("spec, start", [
    ({"replicas": 5}, 5),  # spec.replicas, not 1 until the HPA acts
    ({"replicas": 1, "autoscaling": {"minReplicas": 3}}, 3),  # at least minReplicas
    ({"replicas": 20}, 9),  # at most maxReplicas
])
def test_a_new_deployment_in_mode_hpa_starts_with_the_count(spec, start):
    autoscaling = {"mode": "hpa", "minReplicas": 1, "maxReplicas": 9, **spec.get("autoscaling", {})}
    s = specs.defaulted({"model": "m", **spec, "autoscaling": autoscaling})
    assert render.deployment_replicas(s, None, exists=False) == start
    assert render.deployment_replicas(s, start, exists=True) is None  # then the HPA owns it


@pytest.mark.parametrize("mode, replicas, live, mirrored", [
    ("operator", 1, 6, 6), ("hpa", 1, 6, 6),  # spec.replicas mirrors the live count ...
    ("operator", 6, 6, None), ("hpa", 3, None, None),  # ... when it differs and there is one
    ("off", 1, 6, None),  # mode off: spec.replicas is the count
])
def test_spec_replicas_mirrors_the_live_count_in_modes_operator_and_hpa(mode, replicas, live, mirrored):
    s = specs.defaulted({"model": "m", "replicas": replicas, "autoscaling": {"mode": mode}})
    assert render.mirrored_replicas(s, live) == mirrored


@pytest.mark.parametrize("resources, cpu, frontends", [
    ({"gpu": 1, "cpu": "4", "memory": "16Gi"}, "4", None),  # unset: the server sizes from its cores
    ({"gpu": 1, "cpu": "4", "memory": "16Gi", "frontends": 6}, "8", "6"),  # 6 front ends + 2
    ({"gpu": 1, "cpu": "16", "memory": "16Gi", "frontends": 6}, "16", "6"),  # already enough
    ({"gpu": 1, "cpu": "3500m", "memory": "16Gi", "frontends": 1}, "3500m", "1"),
    ({"gpu": 0, "cpu": "100m", "memory": "1Gi", "frontends": 1}, "100m", "1"),  # one process: CPU as given
])
def test_front_ends_get_the_cpu_they_need(resources, cpu, frontends):
    spec = specs.defaulted({"model": "m", "resources": resources})
    d = render.deployment(render.Owner("x", "ns", "uid"), spec, "img", 1, 45)
    container = d["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["cpu"] == container["resources"]["limits"]["cpu"] == cpu
    assert env_of(d).get("FRONTENDS") == frontends
    server = Settings.from_env({k: v for k, v in env_of(d).items() if isinstance(v, str)})
    assert server.frontends == int(frontends or 0)
