"""EmbeddingService → the manifests of the objects it owns. Pure: dicts in, dicts out."""

from __future__ import annotations

import copy
import dataclasses

from lightkube.utils.quantity import parse_quantity

from embedop import crd, render_cache, render_gateway, render_keda, render_models, render_network, render_security

# gRPC; the HTTP API (behind the keys and TLS when those are on; it answers /health and /metrics
# too, for clients and gateways that check the port they use); the plain-text /health and /metrics
# (EMBEDOP_METRICS_PORT may move it). Which of the last two the probes read: health_port; the
# autoscaler: scrape.ports.
GRPC_PORT, HTTP_PORT, METRICS_PORT = 50051, 8001, 8002
MANAGED_BY = {"app.kubernetes.io/managed-by": "embedop"}
SERVICE_LABEL = "embedfleet.dev/service"
METRICS_LABEL = "embedfleet.dev/metrics"
MODEL_CACHE = render_cache.MODEL_CACHE
# The metric an HPA scales on (served by prometheus-adapter from the servers' own gauges):
# offered tokens/s over capacity tokens/s, per pod. The target is spec.autoscaling.targetUtilization.
HPA_METRIC = "embedfleet_load_ratio"


@dataclasses.dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str

    def owns(self, obj: dict) -> bool:
        """Whether `obj` is this service's: its controller reference names this very service (its
        uid: a service deleted and created again under the same name owns nothing of the old one's)."""
        return any(r.get("kind") == crd.KIND and r.get("apiVersion", "").startswith(f"{crd.GROUP}/")
                   and r.get("name") == self.name and (not self.uid or r.get("uid") == self.uid)
                   for r in (obj.get("metadata") or {}).get("ownerReferences") or [])


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


def cpu_for(resources: dict) -> str:
    """The pod's CPU: as given, and with several front ends at least a core per front end plus two
    for the model process (its event loop and its worker thread). One front end is one process
    doing everything: the CPU stays as given."""
    cpu = str(resources["cpu"])
    frontends = resources.get("frontends") or 0
    if frontends > 1 and parse_quantity(cpu) < frontends + 2:
        return str(frontends + 2)
    return cpu


RESERVED_ENV = crd.RESERVED_ENV


def guarded(spec: dict) -> bool:
    """Whether something stands between the API port and the kubelet or Prometheus: API keys and
    TLS (neither can present a key or verify a pod's certificate), or a NetworkPolicy (which opens
    only the metrics port to the operator and Prometheus)."""
    return bool(spec.get("auth") or spec.get("tls") or (spec.get("networkPolicy") or {}).get("enabled"))


def health_port(spec: dict, metrics_port: int = METRICS_PORT) -> int:
    """The port a service's health and metrics are READ on: the three probes, the
    prometheus.io/port annotation and the target of the Services' `metrics` port (so the chart's
    ServiceMonitor and the HPA's adapter follow). The autoscaler reads the pods where scrape.ports
    says: the metrics port first, then, for an unguarded service's pod that refuses it, this one.

    The plain metrics port when the spec guards the API port (`guarded`: spec.auth, spec.tls,
    spec.networkPolicy.enabled); otherwise the API port, HTTP_PORT.

    Why not the metrics port always: upgrade safety of pinned images. A service without spec.image
    keeps the server image it was created with (server_image), and one with spec.image may name an
    older version; servers from before the metrics port serve /health and /metrics on the API port
    only, without a key. The operator's upgrade changes the pod template (METRICS_PORT, the
    `metrics` container port) and so rolls every fleet: probed on a port its server never binds, the
    new pod would never pass its startup probe (maxUnavailable 1: a 1-replica fleet is down) and
    every scrape would fail (MetricsUnavailable, scaling stops). Every server version answers the
    API port, so an unguarded fleet is read there whatever image it runs. A guarded one needs a
    server image that has the metrics port; an older one could not honour keys or TLS anyway."""
    return metrics_port if guarded(spec) else HTTP_PORT


def server_env(spec: dict, grace_seconds: int, metrics_port: int = METRICS_PORT) -> list[dict]:
    """Every server setting the spec decides, as the server's environment variables."""
    b, a, p = spec["batching"], spec["admission"], spec["pooling"]
    values = {
        **render_models.env(spec),  # MODELS, with spec.models (instead of MODEL_PATH and the rest of spec.model's)
        **render_cache.env(spec),  # MODEL_PATH, MODEL_CACHE_DIR, and what the cache's kind adds
        # Unset: the server infers the task from the model's files (TASK=auto, its default).
        **({"TASK": spec["task"]} if spec.get("task") else {}),
        "GRPC_PORT": GRPC_PORT,
        "HTTP_HEALTH_PORT": HTTP_PORT,
        "METRICS_PORT": metrics_port,
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
        # Unset: the server pools as the model declares.
        **({"POOLING": p["strategy"]} if p.get("strategy") else {}),
        **({"NORMALIZE": p["normalize"]} if p.get("normalize") is not None else {}),
        # Only when set: the API server drops an empty value, and a value it drops is drift for ever.
        **({"EXCLUDE_TOKENS": ",".join(p["excludeTokens"])} if p.get("excludeTokens") else {}),
        # The server stops admitting at SIGTERM and finishes in-flight work within this.
        "SHUTDOWN_GRACE_S": max(1, grace_seconds - 10),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        **({"FRONTENDS": spec["resources"]["frontends"]} if spec["resources"].get("frontends") else {}),
        **render_security.env(spec),
    }
    env = [{"name": k, "value": str(v).lower() if isinstance(v, bool) else str(v)} for k, v in values.items()]
    # spec.env may override any of ours but the ports (RESERVED_ENV: spec.problems refuses them).
    extra = {e["name"]: e for e in spec.get("env", []) if e["name"] not in RESERVED_ENV}
    env = [extra.pop(e["name"], e) for e in env]
    return env + list(extra.values())


# Warm-up compiles every batch shape: the startup probe allows this long before liveness applies.
STARTUP_PERIOD_S, STARTUP_FAILURES = 5, 180
STARTUP_ALLOWANCE_S = STARTUP_PERIOD_S * STARTUP_FAILURES
# A rollout counts as failed only after the whole start-up allowance plus room for scheduling and
# a large image pull: a slow warm-up is not a failure (Kubernetes' default, 600 s, would say so).
PROGRESS_DEADLINE_S = STARTUP_ALLOWANCE_S + 900
# Annotation on the Deployment: the default server image the service got ("" with spec.image).
DEFAULT_IMAGE = "embedfleet.dev/default-server-image"


def pinned_image(deployment: dict | None) -> str | None:
    """The default image a Deployment was given ("" when it runs spec.image; None: no record)."""
    return (((deployment or {}).get("metadata") or {}).get("annotations") or {}).get(DEFAULT_IMAGE)


def server_image(spec: dict, live: dict | None, default: str, kept: str | None = None) -> tuple[str, str | None]:
    """→ (image, notice). spec.image wins. Without it a service keeps the default image it was
    created with: an operator upgrade that changes the default does not roll existing fleets (a new
    server version may change the vectors an index was built with; restarts cost GPU warm-ups).
    The live Deployment's annotation says which; without a Deployment (deleted by hand, or by a
    backup restore), the copy `kept` in the service's status.defaultImage. The notice, when there
    is one, says that a newer default exists and how to move to it."""
    if spec.get("image"):
        return spec["image"], None
    pinned = pinned_image(live) if live is not None else kept
    if pinned and pinned != default:
        return pinned, (f"keeping server image {pinned}; this operator's default is now {default}: "
                        f"set spec.image to move to it")
    return default, None


# Modes whose count a HorizontalPodAutoscaler sets (ours in hpa, KEDA's in keda): the operator
# hands spec.replicas over (reconcile.hand_over_replicas) and stops sending it.
HANDED_OVER = ("hpa", "keda")


def deployment_replicas(spec: dict, live: int | None, decision: int | None = None, exists: bool = True) -> int | None:
    """The Deployment's replica count, sent with every apply (under server-side apply, a count that
    its only manager stops sending is removed, and the Deployment defaults to 1).
    off: spec.replicas. operator: the autoscaler's decision when it makes one, else the live count
    (before the Deployment `exists`: spec.replicas), clamped to [minReplicas, maxReplicas].
    hpa and keda: None, the HorizontalPodAutoscaler (ours, or KEDA's) owns the count; but a Deployment
    that does not exist yet is created with the count, as in mode operator within the HPA's bounds
    (else it would start at 1 until the HPA acts), and the next apply hands it over as a switch to
    hpa does."""
    s = spec["autoscaling"]
    if s["mode"] == "off":
        return spec["replicas"]
    if s["mode"] in HANDED_OVER and exists:
        return None
    base = next(v for v in (decision, live, spec["replicas"]) if v is not None)
    return min(max(base, s["minReplicas"]), s["maxReplicas"])


def mirrored_replicas(spec: dict, live: int | None) -> int | None:
    """What spec.replicas must become, or None when it stays. In modes operator and hpa the count
    belongs to the autoscaler or the HPA, and spec.replicas mirrors it (the live Deployment's count),
    so that a switch to mode off, which applies spec.replicas, keeps the fleet as it is (mode keda
    too: KEDA's HPA, and KEDA itself at zero, set the count)."""
    if spec["autoscaling"]["mode"] == "off" or live is None or live == spec.get("replicas"):
        return None
    return live


def rollout(spec: dict) -> dict:
    r = spec["rollout"]
    return {"maxSurge": r["maxSurge"], "maxUnavailable": r["maxUnavailable"]}


def _pod_spec(spec: dict, container: dict, grace_seconds: int) -> dict:
    pod = {
        "terminationGracePeriodSeconds": grace_seconds,
        # OnRootMismatch: a model cache volume of many files is not walked and re-owned at every start.
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [*render_cache.volumes(spec), {"name": "tmp", "emptyDir": {}}, *render_security.volumes(spec)],
        "enableServiceLinks": False,
    }
    # The servers never call the Kubernetes API: with the namespace's default account, no token is
    # mounted, so a compromised server (or model code) holds no API credential. A service that names
    # its own account (spec.serviceAccountName) may need that token in the pod (Vault's agent
    # injector authenticates with it, as do some cloud identity setups): the field is left out, and
    # the account's own automountServiceAccountToken decides.
    if not spec.get("serviceAccountName"):
        pod["automountServiceAccountToken"] = False
    # The production pod fields, passed through as the spec states them (validated by the CRD's
    # schema, spec.problems and, finally, the API server, whose refusal shows as Degraded).
    for field in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "imagePullSecrets",
                  "serviceAccountName", "priorityClassName", "runtimeClassName"):
        if spec.get(field):
            pod[field] = copy.deepcopy(spec[field])
    return pod


def deployment(owner: Owner, spec: dict, image: str, replicas: int | None, grace_seconds: int,
               metrics_port: int = METRICS_PORT) -> dict:
    """`image`: spec.image, else the default image in force for this service (server_image)."""
    res = spec["resources"]
    limits = {"cpu": cpu_for(res), "memory": str(res["memory"])}
    if res["gpu"] > 0:
        limits["nvidia.com/gpu"] = str(res["gpu"])
    # Every probe is /health on health_port (the metrics port when keys, TLS or a NetworkPolicy
    # guard the API port, else the API port): the kubelet's gRPC probe can send neither TLS nor an
    # API key, and its HTTP probe no key; /health answers exactly what grpc.health.v1 says (503
    # while starting, degraded or draining). Liveness included: one event loop serves gRPC and
    # HTTP alike (docs/operator.md says what an HTTP liveness cannot see).
    port = health_port(spec, metrics_port)
    health = {"httpGet": {"path": "/health", "port": port}}
    container = {
        "name": "server",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"},
        ],
        "env": server_env(spec, grace_seconds, metrics_port),
        "resources": {"requests": dict(limits), "limits": limits},
        "startupProbe": {**health, "periodSeconds": STARTUP_PERIOD_S,
                         "failureThreshold": STARTUP_FAILURES, "timeoutSeconds": 3},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 2, "timeoutSeconds": 3},
        "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 6, "timeoutSeconds": 5},
        # Endpoints are removed asynchronously: keep serving a few seconds before SIGTERM.
        "lifecycle": {"preStop": {"exec": {"command": ["python", "-c", "import time; time.sleep(5)"]}}},
        "volumeMounts": [*render_cache.mounts(spec), {"name": "tmp", "mountPath": "/tmp"},
                         *render_security.mounts(spec)],
        "securityContext": {
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
        },
    }
    if spec.get("envFrom"):
        container["envFrom"] = copy.deepcopy(spec["envFrom"])
    meta = _meta(owner)
    # Always sent ("" with spec.image), so that a later removal of spec.image starts from the
    # default in force then, not from one pinned long ago.
    meta["annotations"] = {DEFAULT_IMAGE: "" if spec.get("image") else image}
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector(owner.name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rollout(spec)},
            "progressDeadlineSeconds": PROGRESS_DEADLINE_S,
            "template": {
                "metadata": {
                    # The service's own labels win: the selector depends on them.
                    "labels": {**spec.get("podLabels", {}), **labels(owner.name)},
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                    "prometheus.io/path": "/metrics", **spec.get("podAnnotations", {})},
                },
                "spec": _pod_spec(spec, container, grace_seconds),
            },
        },
    }
    if replicas is not None:  # None: the HorizontalPodAutoscaler owns the count
        body["spec"]["replicas"] = replicas
    return body


def fill_job_name(owner: Owner, spec: dict, grace_seconds: int, claim_uid: str = "") -> str | None:
    """The name of the Job that fills spec.modelCache's claim (of `claim_uid`) for this spec, or
    None (no fill)."""
    return render_cache.fill_job_name(owner.name, spec, server_env(spec, grace_seconds), claim_uid)


def fill_job(owner: Owner, spec: dict, image: str, grace_seconds: int, metrics_port: int = METRICS_PORT,
             claim_uid: str = "") -> dict | None:
    """The Job that fills a pre-filled spec.modelCache claim (render_cache.fill_job), or None."""
    if (name := fill_job_name(owner, spec, grace_seconds, claim_uid)) is None:
        return None
    pod = deployment(owner, spec, image, None, grace_seconds, metrics_port)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    return render_cache.fill_job(_meta(owner, name), spec, image, container["env"], pod, container, claim_uid)


def _ports(spec: dict, metrics_port: int) -> list[dict]:
    # h2c tells gateways and meshes to speak HTTP/2 in plain text to the port; with spec.tls the
    # port speaks TLS, and there is no appProtocol for HTTP/2 over TLS, so none is given.
    grpc = {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
            **({} if spec.get("tls") else {"appProtocol": "kubernetes.io/h2c"})}
    return [
        grpc,
        {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
        # Named `metrics` and numbered as EMBEDOP_METRICS_PORT whatever it leads to: what scrapes it
        # (the chart's ServiceMonitor, by name) reads the pods where health_port says.
        {"name": "metrics", "port": metrics_port, "targetPort": health_port(spec, metrics_port), "protocol": "TCP"},
    ]


def service(owner: Owner, spec: dict, metrics_port: int = METRICS_PORT) -> dict:
    meta = _meta(owner)
    meta["labels"][METRICS_LABEL] = "true"  # the one Service a ServiceMonitor scrapes (not the headless)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"type": "ClusterIP", "selector": selector(owner.name), "ports": _ports(spec, metrics_port)}}


def headless_service(owner: Owner, spec: dict, metrics_port: int = METRICS_PORT) -> dict:
    """For client-side balancing: `dns:///NAME-headless:50051` resolves every ready pod."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(owner, f"{owner.name}-headless"),
            "spec": {"clusterIP": "None", "selector": selector(owner.name), "ports": _ports(spec, metrics_port)}}


def pod_disruption_budget(owner: Owner, spec: dict) -> dict:
    """Evictions (node drains) may take down as many pods at once as a rollout does, and at least
    one: a budget of 0 would block every drain, and so cluster upgrades, for good. Pods that are not
    Ready (Pending, crash-looping) may always be evicted: they serve nothing, and under the default
    policy they use up the budget and block every drain of their nodes."""
    unavailable = spec["rollout"]["maxUnavailable"]
    if str(unavailable) in ("0", "0%"):
        unavailable = 1
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(owner),
            "spec": {"maxUnavailable": unavailable, "selector": {"matchLabels": selector(owner.name)},
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}


def horizontal_pod_autoscaler(owner: Owner, spec: dict) -> dict:
    s = spec["autoscaling"]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(owner),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.name},
            "minReplicas": s["minReplicas"],
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


def network_policy(owner: Owner, spec: dict, metrics_port: int = METRICS_PORT,
                   operator: render_network.OperatorPods | None = None) -> dict:
    return render_network.network_policy(_meta(owner), selector(owner.name), spec, (GRPC_PORT, HTTP_PORT),
                                         metrics_port, operator)


def inference_pool(owner: Owner, spec: dict) -> dict:
    return render_gateway.inference_pool(_meta(owner), selector(owner.name), spec, HTTP_PORT)


def keda_objects(owner: Owner, spec: dict, scaler_address: str, route: str | None) -> list[dict]:
    """Mode keda's ScaledObject and the HTTP add-on's routes (render_keda.objects); `route`: the
    route kind the cluster's add-on takes (render_keda.route_kind). A woken request waits for a pod
    as long as a pod may take to start."""
    return render_keda.objects(lambda name: _meta(owner, name), owner.namespace, spec, scaler_address, route,
                               STARTUP_ALLOWANCE_S)


# Companions rendered only when the spec asks for them: one the spec no longer asks for is deleted.
OPTIONAL_KINDS = ("HorizontalPodAutoscaler", "NetworkPolicy", render_gateway.KIND)


def companions(owner: Owner, spec: dict, metrics_port: int = METRICS_PORT,
               operator: render_network.OperatorPods | None = None) -> list[dict]:
    """What the service owns besides its Deployment, in apply order. `operator`: the operator's own
    pods, which a NetworkPolicy admits to the metrics port."""
    objects = [service(owner, spec, metrics_port), headless_service(owner, spec, metrics_port),
               pod_disruption_budget(owner, spec)]
    if spec["autoscaling"]["mode"] == "hpa":
        objects.append(horizontal_pod_autoscaler(owner, spec))
    if (spec.get("networkPolicy") or {}).get("enabled"):
        objects.append(network_policy(owner, spec, metrics_port, operator))
    if spec.get("routing") == "gateway":
        objects.append(inference_pool(owner, spec))
    return objects


def owned(owner: Owner, spec: dict, image: str, replicas: int | None, grace_seconds: int,
          metrics_port: int = METRICS_PORT, operator: render_network.OperatorPods | None = None) -> list[dict]:
    """Everything the service owns, in apply order; `replicas` as deployment_replicas says."""
    return [deployment(owner, spec, image, replicas, grace_seconds, metrics_port),
            *companions(owner, spec, metrics_port, operator)]
