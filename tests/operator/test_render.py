"""Every rendered object validates strictly against real Kubernetes schemas (1.29–1.34), and
carries what the spec says."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from embedop import render, spec as specs
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
    "cpu-only": {"model": "m", "resources": {"gpu": 0, "cpu": "2", "memory": "4Gi"}},
    "hpa": {"model": "m", "autoscaling": {"mode": "hpa", "minReplicas": 2, "maxReplicas": 9}},
    "off": {"model": "m", "replicas": 5, "autoscaling": {"mode": "off"}},
    "scale-to-zero-min": {"model": "m", "autoscaling": {"minReplicas": 0}},
    "cls-pooling": {"model": "m", "pooling": {"strategy": "cls", "normalize": False}},
    "many-gpus": {"model": "m", "resources": {"gpu": 8, "cpu": 32, "memory": "200Gi"}},
    "env-override": {"model": "m", "env": [{"name": "MAX_DRAIN_TIME_MS", "value": "900"}, {"name": "X", "value": "1"}]},
}


def rendered(name):
    spec = specs.defaulted(VARIATIONS[name])
    return spec, render.owned(OWNER, spec, spec.get("image", IMAGE), None, 45)


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
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_every_server_setting_from_the_spec_reaches_the_server_and_parses():
    spec, objects = rendered("full")
    env = env_of(objects[0])
    server = Settings.from_env(env)  # the server accepts what the operator renders
    assert server.model_path == "s3://models/bge-base-en-v1.5"
    assert server.buckets == (16, 32, 64, 128, 256, 512)
    assert (server.max_batch_size, server.max_tokens_per_batch, server.deadline_wait_ms) == (256, 65536, 20)
    assert server.backpressure_latency and server.max_drain_time_ms == 400
    assert (server.latency_soft_ms, server.latency_hard_ms) == (300, 1500)
    assert server.exclude_tokens == ("[product]", "[query]") and server.pooling == "mean"
    assert server.device == "cuda" and env["LOG_LEVEL"] == "INFO"


def test_spec_env_overrides_ours():
    env = env_of(rendered("env-override")[1][0])
    assert env["MAX_DRAIN_TIME_MS"] == "900" and env["X"] == "1"


def test_gpu_probes_security_and_rollout():
    _, objects = rendered("full")
    d = objects[0]
    pod = d["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and c["livenessProbe"]["grpc"]["port"] == 50051
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] and "lifecycle" in c
    assert pod["terminationGracePeriodSeconds"] == 45
    assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["volumes"][0] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}}
    assert d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8001"
    assert "nvidia.com/gpu" not in rendered("cpu-only")[1][0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


@pytest.mark.parametrize("name, desired, replicas", [
    ("off", None, 5), ("off", 9, 5),  # autoscaling off: spec.replicas rules
    ("minimal", None, 1), ("minimal", 3, 3), ("minimal", 99, 4),  # operator: its decision, clamped
    ("hpa", 3, None),  # the HPA owns the count
])
def test_deployment_replicas(name, desired, replicas):
    assert render.deployment_replicas(specs.defaulted(VARIATIONS[name]), desired) == replicas
