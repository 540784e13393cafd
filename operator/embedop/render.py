"""EmbeddingService → the manifests of the objects it owns. Pure: dicts in, dicts out."""

from __future__ import annotations

import dataclasses

from embedop import crd

GRPC_PORT, HTTP_PORT = 50051, 8001
MANAGED_BY = {"app.kubernetes.io/managed-by": "embedop"}
SERVICE_LABEL = "embedfleet.dev/service"
METRICS_LABEL = "embedfleet.dev/metrics"
MODEL_CACHE = "/models"
# The metric an HPA scales on (served by prometheus-adapter from the servers' own gauges):
# offered tokens/s over capacity tokens/s, per pod. The target is spec.autoscaling.targetUtilization.
HPA_METRIC = "embedfleet_load_ratio"


@dataclasses.dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str


def selector(name: str) -> dict:
    return {"app.kubernetes.io/name": "embedserve", SERVICE_LABEL: name}


def labels(name: str) -> dict:
    return {**selector(name), "app.kubernetes.io/instance": name, **MANAGED_BY}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(name).items())


def _meta(owner: Owner, name: str | None = None) -> dict:
    return {
        "name": name or owner.name,
        "namespace": owner.namespace,
        "labels": labels(owner.name),
        "ownerReferences": [{
            "apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": owner.name, "uid": owner.uid,
            "controller": True, "blockOwnerDeletion": True,
        }],
    }


def server_env(spec: dict, grace_seconds: int, http_port: int = HTTP_PORT) -> list[dict]:
    """Every server setting the spec decides, as the server's environment variables."""
    b, a, p = spec["batching"], spec["admission"], spec["pooling"]
    values = {
        "MODEL_PATH": spec["model"],
        "MODEL_CACHE_DIR": MODEL_CACHE,
        "GRPC_PORT": GRPC_PORT,
        "HTTP_HEALTH_PORT": http_port,
        "DEVICE": "cuda" if spec["resources"]["gpu"] > 0 else "cpu",
        "BUCKETS": ",".join(map(str, b["buckets"])),
        "MAX_BATCH_SIZE": b["maxBatchSize"],
        "MAX_TOKENS_PER_BATCH": b["maxTokensPerBatch"],
        "DEADLINE_WAIT_MS": b["deadlineWaitMs"],
        "BACKPRESSURE_THROUGHPUT_ENABLED": a["throughput"],
        "BACKPRESSURE_LATENCY_ENABLED": a["latency"],
        "MAX_DRAIN_TIME_MS": a["maxDrainTimeMs"],
        "LATENCY_SOFT_MS": a["latencySoftMs"],
        "LATENCY_HARD_MS": a["latencyHardMs"],
        "POOLING": p["strategy"],
        "NORMALIZE": p["normalize"],
        "EXCLUDE_TOKENS": ",".join(p.get("excludeTokens", [])),
        # The server stops admitting at SIGTERM and finishes in-flight work within this.
        "SHUTDOWN_GRACE_S": max(1, grace_seconds - 10),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    env = [{"name": k, "value": str(v).lower() if isinstance(v, bool) else str(v)} for k, v in values.items()]
    extra = {e["name"]: e for e in spec.get("env", [])}
    env = [extra.pop(e["name"], e) for e in env]  # spec.env may override any of ours
    return env + list(extra.values())


def deployment(owner: Owner, spec: dict, image: str, replicas: int | None, grace_seconds: int,
               http_port: int = HTTP_PORT) -> dict:
    res = spec["resources"]
    limits = {"cpu": str(res["cpu"]), "memory": str(res["memory"])}
    if res["gpu"] > 0:
        limits["nvidia.com/gpu"] = str(res["gpu"])
    cache = spec["modelCache"]
    cache_volume = (
        {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache["claimName"]}}
        if cache.get("claimName")
        else {"name": "model-cache", "emptyDir": {"sizeLimit": str(cache["sizeLimit"])}}
    )
    http_get = {"path": "/health", "port": "http"}
    container = {
        "name": "server",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "http", "containerPort": http_port, "protocol": "TCP"},
        ],
        "env": server_env(spec, grace_seconds, http_port),
        "resources": {"requests": dict(limits), "limits": limits},
        # Warm-up compiles every batch shape: allow up to 15 minutes before liveness applies.
        "startupProbe": {"httpGet": http_get, "periodSeconds": 5, "failureThreshold": 180, "timeoutSeconds": 3},
        "readinessProbe": {"httpGet": http_get, "periodSeconds": 5, "failureThreshold": 2, "timeoutSeconds": 3},
        "livenessProbe": {"grpc": {"port": GRPC_PORT}, "periodSeconds": 10, "failureThreshold": 6, "timeoutSeconds": 5},
        # Endpoints are removed asynchronously: keep serving a few seconds before SIGTERM.
        "lifecycle": {"preStop": {"exec": {"command": ["python", "-c", "import time; time.sleep(5)"]}}},
        "volumeMounts": [{"name": "model-cache", "mountPath": MODEL_CACHE}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec = {
        "terminationGracePeriodSeconds": grace_seconds,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [cache_volume, {"name": "tmp", "emptyDir": {}}],
        "enableServiceLinks": False,
    }
    if spec.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(spec["nodeSelector"])
    if spec.get("tolerations"):
        pod_spec["tolerations"] = [dict(t) for t in spec["tolerations"]]
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner),
        "spec": {
            "selector": {"matchLabels": selector(owner.name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": labels(owner.name),
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(http_port),
                                    "prometheus.io/path": "/metrics"},
                },
                "spec": pod_spec,
            },
        },
    }
    if replicas is not None:  # None: another controller (HPA) owns the count
        body["spec"]["replicas"] = replicas
    return body


def _ports(http_port: int) -> list[dict]:
    return [
        {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"},
        {"name": "http", "port": http_port, "targetPort": "http", "protocol": "TCP"},
    ]


def service(owner: Owner, http_port: int = HTTP_PORT) -> dict:
    meta = _meta(owner)
    meta["labels"][METRICS_LABEL] = "true"  # the one Service a ServiceMonitor scrapes (not the headless)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"type": "ClusterIP", "selector": selector(owner.name), "ports": _ports(http_port)}}


def headless_service(owner: Owner, http_port: int = HTTP_PORT) -> dict:
    """For client-side balancing: `dns:///NAME-headless:50051` resolves every ready pod."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(owner, f"{owner.name}-headless"),
            "spec": {"clusterIP": "None", "selector": selector(owner.name), "ports": _ports(http_port)}}


def pod_disruption_budget(owner: Owner) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(owner),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(owner.name)}}}


def horizontal_pod_autoscaler(owner: Owner, spec: dict) -> dict:
    s = spec["autoscaling"]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(owner),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.name},
            "minReplicas": max(1, s["minReplicas"]),
            "maxReplicas": s["maxReplicas"],
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": HPA_METRIC},
                "target": {"type": "AverageValue", "averageValue": f"{round(s['targetUtilization'] * 1000)}m"},
            }}],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": s["scaleUpStabilizationSeconds"],
                            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}]},
                "scaleDown": {"stabilizationWindowSeconds": s["scaleDownStabilizationSeconds"]},
            },
        },
    }


def deployment_replicas(spec: dict, desired: int | None) -> int | None:
    """The Deployment's replica count: spec.replicas when autoscaling is off; the autoscaler's
    last decision (or the clamped spec value before its first) in operator mode; none in hpa mode."""
    s = spec["autoscaling"]
    if s["mode"] == "off":
        return spec["replicas"]
    if s["mode"] == "hpa":
        return None
    base = desired if desired is not None else spec["replicas"]
    return min(max(base, s["minReplicas"]), s["maxReplicas"])


def owned(owner: Owner, spec: dict, image: str, desired: int | None, grace_seconds: int,
          http_port: int = HTTP_PORT) -> list[dict]:
    """Everything the service owns, in apply order."""
    objects = [
        deployment(owner, spec, image, deployment_replicas(spec, desired), grace_seconds, http_port),
        service(owner, http_port),
        headless_service(owner, http_port),
        pod_disruption_budget(owner),
    ]
    if spec["autoscaling"]["mode"] == "hpa":
        objects.append(horizontal_pod_autoscaler(owner, spec))
    return objects
