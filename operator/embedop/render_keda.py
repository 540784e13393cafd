"""autoscaling.mode keda → the service's KEDA ScaledObject and, with minReplicas 0, the KEDA HTTP
add-on's route that wakes it. Pure (render.keda_objects calls it with the service's metadata).

The ScaledObject (keda.sh/v1alpha1, named as the service) targets the service's Deployment. KEDA
makes a HorizontalPodAutoscaler from it (`keda-hpa-<name>`, which carries the ScaledObject's labels,
ours) and scales between zero and one itself. Its first trigger is the operator, as KEDA's external
scaler (`external-push`: KEDA keeps a StreamIsActive stream open, so a wake-up is pushed, not
polled): GetMetricSpec answers a target of 1 and GetMetrics the count the operator decided, so the
HPA's AverageValue arithmetic, ceil(value / target), is that count. What the HPA would add of its
own is turned off in `behavior` (see the comment above behavior()).

Scale to zero (minReplicas 0): at zero no pod exports demand, so something in front of the pods
must hold a request while the first pod starts and count it as demand: KEDA's HTTP add-on, whose
interceptor proxies HTTP/1.1, HTTP/2 and gRPC over h2c. Its route names the service's ClusterIP
Service: an InterceptorRoute (http.keda.sh/v1beta1) where that CRD is installed, else, for older
add-ons, an HTTPScaledObject (v1alpha1, HTTP only) with the annotation that stops the add-on from
making a ScaledObject of its own (KEDA allows one ScaledObject per Deployment). The add-on's scaler
is then a second trigger of OUR ScaledObject, there to wake the service, not to size it (WAKE_TARGET).
Without the add-on's CRDs nothing could wake a service at zero: the ScaledObject keeps one pod
(minReplicaCount 1) and the service is Degraded (ADDON_MISSING)."""

from __future__ import annotations

from typing import Callable

from embedop import crd

GROUP, VERSION, KIND, PLURAL = "keda.sh", "v1alpha1", "ScaledObject", "scaledobjects"
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"
HTTP_GROUP = "http.keda.sh"
ROUTE_KIND, ROUTE_VERSION, ROUTE_PLURAL = "InterceptorRoute", "v1beta1", "interceptorroutes"
HTTPSO_KIND, HTTPSO_VERSION, HTTPSO_PLURAL = "HTTPScaledObject", "v1alpha1", "httpscaledobjects"
ROUTE_CRD, HTTPSO_CRD = f"{ROUTE_PLURAL}.{HTTP_GROUP}", f"{HTTPSO_PLURAL}.{HTTP_GROUP}"
# kind → (group, version, plural) of every kind of this mode (kube.KINDS takes them).
KINDS = {KIND: (GROUP, VERSION, PLURAL), ROUTE_KIND: (HTTP_GROUP, ROUTE_VERSION, ROUTE_PLURAL),
         HTTPSO_KIND: (HTTP_GROUP, HTTPSO_VERSION, HTTPSO_PLURAL)}

# KEDA's trigger type for an external scaler that pushes activity (StreamIsActive); plain
# `external` would be polled every pollingInterval, and a wake-up would wait for it.
TRIGGER_TYPE = "external-push"
# The HTTP add-on, where its Helm chart (kedacore/keda-add-ons-http) puts it by default: release
# `http-add-on` in namespace `keda`, whose Services are these. Module constants, not settings: a
# cluster that installs the add-on elsewhere is rare, and the addresses are written only here.
ADDON_SCALER = "keda-add-ons-http-external-scaler.keda:9090"
INTERCEPTOR = "keda-add-ons-http-interceptor-proxy.keda:8080"  # where clients of a zero-capable service go
# Skips the add-on's own ScaledObject for an HTTPScaledObject (InterceptorRoutes never make one).
SKIP_SCALED_OBJECT = "httpscaledobject.keda.sh/skip-scaledobject-creation"
# The interceptor routes by the request's Host (port stripped): the names the service's ClusterIP
# Service answers to. A cluster domain other than this one still matches the two shorter names.
CLUSTER_DOMAIN = "cluster.local"
# The gRPC services the servers answer (protos/embedfleet/v1/inference.proto, grpc.health.v1,
# reflection): their path prefixes send a gRPC call to the gRPC port. The HTTP API port speaks
# HTTP/1.1 only (uvicorn's h11): a gRPC call forwarded there would fail.
GRPC_SERVICES = ("/embedfleet.v1.Inference", "/grpc.health.v1.Health", "/grpc.reflection.v1.ServerReflection",
                 "/grpc.reflection.v1alpha.ServerReflection")
# Timeouts of a request at the interceptor. READINESS: how long a request waits for the first
# ready pod after waking the service; the pod's whole start-up allowance (render.STARTUP_ALLOWANCE_S:
# schedule, pull, model load, warm-up), not the add-on's default, which gives up on a GPU start
# long before a pod would be counted failed. A client's own deadline, shorter, still ends its wait.
# RESPONSE_HEADER: once forwarded, the server answers within its drain budget or refuses at once
# (admission): the add-on's default (300 s), sent so a cluster-wide shorter one does not cut a long
# batch. REQUEST: the two together (a global request timeout would otherwise bound the wait).
RESPONSE_HEADER_S = 300
# The add-on's trigger only wakes the service: its metric (requests in flight at the interceptor)
# over this target is at most 1 pod for any real concurrency, so the HPA's max over the triggers
# is the operator's count whenever a pod runs. (The add-on's default, 100 per pod, would size the
# fleet by concurrency, against the operator's service-rate decision.)
WAKE_TARGET = 1_000_000
# KEDA's HPA would reshape the operator's decision with the HPA defaults (a 300 s scale-down
# window; at most +4 pods or +100% per 15 s up). Here: no windows (the operator's own policy has
# its stabilization, ramp and surge already) and policies wide enough to take any step at once:
# up by 1000% or by maxReplicas pods per 15 s, whichever is more; down by 100% per 15 s. What the
# HPA still does: its tolerance (10% by default, the controller manager's
# --horizontal-pod-autoscaler-tolerance): a count within 10% of the current one is not applied
# (from 10 pods up, a step of one pod, a few at 40, waits until the decision moves further). The per-HPA
# `tolerance` field is left unset: it needs the HPAConfigurableTolerance feature gate, and an API
# server without it drops the field from KEDA's HPA, which KEDA would then update again and again.
SCALE_PERIOD_S = 15


def behavior(max_replicas: int) -> dict:
    """`advanced.horizontalPodAutoscalerConfig.behavior` (see above)."""
    return {
        "scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max", "policies": [
            {"type": "Percent", "value": 1000, "periodSeconds": SCALE_PERIOD_S},
            {"type": "Pods", "value": max_replicas, "periodSeconds": SCALE_PERIOD_S}]},
        "scaleDown": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max", "policies": [
            {"type": "Percent", "value": 100, "periodSeconds": SCALE_PERIOD_S}]},
    }


def hpa_name(service: str) -> str:
    """The HorizontalPodAutoscaler KEDA makes for the service's ScaledObject (KEDA's default name)."""
    return f"keda-hpa-{service}"


def route_names(service: str) -> dict[str, str]:
    """The add-on's routes of a service, by what they carry. Not the service's own name: the add-on
    deletes the ScaledObject named as an HTTPScaledObject (its own), and ours is named as the service."""
    return {"http": f"{service}-http", "grpc": f"{service}-grpc"}


def owned_names(service: str) -> list[tuple[str, str]]:
    """(kind, name) of every object this mode may render for a service, in deletion order (the
    ScaledObject before the routes its triggers name)."""
    names = route_names(service)
    return [(KIND, service), (ROUTE_KIND, names["http"]), (ROUTE_KIND, names["grpc"]), (HTTPSO_KIND, names["http"])]


def route_kind(serves: Callable[[str], bool]) -> str | None:
    """Which route the cluster's add-on takes: InterceptorRoute where served (newer add-ons), else
    HTTPScaledObject, else None (no add-on: nothing can wake a service at zero)."""
    return next((kind for kind in (ROUTE_KIND, HTTPSO_KIND) if serves(kind)), None)


def scales_to_zero(spec: dict) -> bool:
    s = spec["autoscaling"]
    return s["mode"] == "keda" and s["minReplicas"] == 0


def hosts(service: str, namespace: str) -> list[str]:
    return [f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.{CLUSTER_DOMAIN}"]


def _timeouts(readiness_s: int) -> dict:
    return {"readiness": f"{readiness_s}s", "responseHeader": f"{RESPONSE_HEADER_S}s",
            "request": f"{readiness_s + RESPONSE_HEADER_S}s"}


def interceptor_routes(meta: Callable[[str], dict], service: str, namespace: str, readiness_s: int) -> list[dict]:
    """Two routes to the service's ClusterIP Service (named ports: the Service's own `http` and
    `grpc`): HTTP to the API port; gRPC (h2c) to the gRPC port, by its services' paths (the longest
    matching prefix wins over the HTTP route's `/`)."""
    names, rule = route_names(service), {"hosts": hosts(service, namespace)}

    def route(name: str, port: str, rules: dict) -> dict:
        return {"apiVersion": f"{HTTP_GROUP}/{ROUTE_VERSION}", "kind": ROUTE_KIND, "metadata": meta(name),
                "spec": {"target": {"service": service, "portName": port}, "rules": [rules],
                         "scalingMetric": {"concurrency": {"targetValue": WAKE_TARGET}},
                         "timeouts": _timeouts(readiness_s)}}

    return [route(names["http"], "http", rule),
            route(names["grpc"], "grpc", {**rule, "paths": [{"value": p} for p in GRPC_SERVICES]})]


def http_scaled_object(meta: Callable[[str], dict], service: str, namespace: str, readiness_s: int) -> dict:
    """The older add-ons' route: HTTP to the API port (those add-ons proxy no gRPC)."""
    m = meta(route_names(service)["http"])
    m["annotations"] = {**(m.get("annotations") or {}), SKIP_SCALED_OBJECT: "true"}
    return {"apiVersion": f"{HTTP_GROUP}/{HTTPSO_VERSION}", "kind": HTTPSO_KIND, "metadata": m,
            "spec": {"hosts": hosts(service, namespace),
                     "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": service,
                                        "service": service, "portName": "http"},
                     "scalingMetric": {"concurrency": {"targetValue": WAKE_TARGET}},
                     # conditionWait: how long a request waits for a replica (READINESS above).
                     "timeouts": {"conditionWait": f"{readiness_s}s", "responseHeader": f"{RESPONSE_HEADER_S}s"}}}


def scaled_object(meta: dict, spec: dict, scaler_address: str, routes: list[dict]) -> dict:
    """`routes`: the add-on's routes rendered with it (each gets a trigger); none with minReplicas
    0 means no add-on, and the floor stays at one pod."""
    s, service = spec["autoscaling"], meta["name"]
    triggers = [{"type": TRIGGER_TYPE, "name": "embedop", "metricType": "AverageValue",
                 "metadata": {"scalerAddress": scaler_address}}]
    for route in routes:
        key = "interceptorRoute" if route["kind"] == ROUTE_KIND else "httpScaledObject"
        triggers.append({"type": TRIGGER_TYPE, "name": route["metadata"]["name"],
                         "metadata": {"scalerAddress": ADDON_SCALER, key: route["metadata"]["name"]}})
    return {
        "apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": service},
            "minReplicaCount": s["minReplicas"] if routes or s["minReplicas"] > 0 else 1,
            "maxReplicaCount": s["maxReplicas"],
            # Zero only after this long without demand (KEDA applies it to the last pod alone).
            "cooldownPeriod": s["idleSeconds"],
            "pollingInterval": s["intervalSeconds"],
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(s["maxReplicas"])}},
            "triggers": triggers,
        },
    }


def objects(meta: Callable[[str], dict], namespace: str, spec: dict, scaler_address: str, route: str | None,
            readiness_s: int) -> list[dict]:
    """Mode keda's objects for a service, in apply order (the routes before the ScaledObject whose
    triggers name them); none in other modes. `meta(name)`: an owned object's metadata; `route`:
    route_kind's answer; `readiness_s`: how long a woken request waits for a pod."""
    if spec["autoscaling"]["mode"] != "keda":
        return []
    so_meta = meta(None)
    service = so_meta["name"]
    routes = []
    if scales_to_zero(spec) and route == ROUTE_KIND:
        routes = interceptor_routes(meta, service, namespace, readiness_s)
    elif scales_to_zero(spec) and route == HTTPSO_KIND:
        routes = [http_scaled_object(meta, service, namespace, readiness_s)]
    return [*routes, scaled_object(so_meta, spec, scaler_address, routes)]


KEDA_MISSING, ADDON_MISSING = "KedaCRDMissing", "KedaHTTPAddOnMissing"  # Degraded reasons, and the Events'
METRIC_MISSING = "KedaMetricMissing"

# The operator's one metric (scaler.py serves it), as KEDA's HPA names it: KEDA prefixes each
# trigger's metric with its place among the triggers ("s<index>-", scalers.GenerateMetricNameWithIndex),
# and ours is the first (scaled_object).
SCALER_METRIC = "embedfleet-replicas"
HPA_METRIC = f"s0-{SCALER_METRIC}"
# An annotation on KEDA's HorizontalPodAutoscaler: KEDA's controller reconciles a ScaledObject when
# one on the HPA it owns changes (its predicates ignore the ScaledObject's own metadata), and builds
# the HPA again from every trigger that answers then.
REBUILD_ANNOTATION = "embedfleet.dev/rebuild-metrics"
# The wait after each request while the metric stays missing, the last one repeated: a new leader's
# scaler may not be reachable at once (its label, the Service's endpoints, KEDA's reconnection
# back-off), and a scaler KEDA cannot reach at all is not worth a write a minute.
REBUILD_AFTER_S = (10.0, 30.0, 60.0, 300.0)


def rebuild_due(last: tuple[float, int] | None, now: float) -> bool:
    """Whether to ask KEDA again: `last` is (when, how many times so far) for this service."""
    if last is None:
        return True
    when, times = last
    return now - when >= REBUILD_AFTER_S[min(times, len(REBUILD_AFTER_S)) - 1]


def lacks_our_metric(hpa: dict | None) -> bool:
    """Whether KEDA's HPA was built without the operator's metric. KEDA builds it from the triggers
    whose scaler answers GetMetricSpec at that moment and leaves a silent one out (it fails only
    when none answers): an HPA made while the scaler was unreachable (a leader changing, a
    NetworkPolicy) counts the add-on's pending requests alone, and stays so until KEDA reconciles
    the ScaledObject again. False while there is no HPA yet."""
    if hpa is None:
        return False
    names = {((m.get("external") or {}).get("metric") or {}).get("name") for m in (hpa.get("spec") or {}).get("metrics") or []}
    return HPA_METRIC not in names


def missing_metric_message(hpa: str, scaler_address: str) -> str:
    return (f"KEDA's HorizontalPodAutoscaler {hpa} has no metric {HPA_METRIC}: KEDA could not reach the operator's "
            f"scaler at {scaler_address} when it built it, so the count follows the HTTP add-on's pending requests "
            f"alone; KEDA was asked to build it again (annotation {REBUILD_ANNOTATION}); if this stays, check that "
            "KEDA's operator reaches that address (the chart's kedaScaler.from, EMBEDOP_SCALER_ADDRESS)")


def missing_keda_message(error: str) -> str:
    return (f"autoscaling.mode is keda, but this cluster does not serve {KIND} ({API_VERSION}): install KEDA "
            f"(its CRD {CRD_NAME}), or choose another autoscaling.mode; the Deployment keeps its count meanwhile "
            f"({error})")


def missing_addon_message() -> str:
    return (f"autoscaling.minReplicas is 0 (scale to zero), but this cluster serves neither {ROUTE_CRD} nor "
            f"{HTTPSO_CRD}: without KEDA's HTTP add-on nothing holds a request at zero or wakes the service, so "
            "it keeps one pod; install the add-on (kedacore/keda-add-ons-http, in namespace keda), or set "
            "minReplicas to 1")


def warnings(spec: dict) -> list[str]:
    """What a scale-to-zero spec may still get wrong, said but not refused."""
    if not scales_to_zero(spec):
        return []
    out = []
    if spec.get("tls"):
        out.append("autoscaling.minReplicas 0 with tls: KEDA's HTTP add-on forwards to the pods in plain text, and "
                   "their API ports speak TLS: requests through the interceptor fail")
    if (spec.get("networkPolicy") or {}).get("enabled"):
        out.append("autoscaling.minReplicas 0 with a networkPolicy: admit the HTTP add-on's interceptor pods "
                   "(namespace keda) in networkPolicy.from, or the policy drops what the interceptor forwards")
    if spec.get("routing") == "gateway":
        out.append("autoscaling.minReplicas 0 with routing gateway: the InferencePool's endpoint picker chooses "
                   "among running pods; at zero there is none, and a request sent past the HTTP add-on's "
                   "interceptor wakes nothing")
    return out


def fighting(scaled_objects: list[dict], ours: Callable[[dict], bool], service: str, mode: str) -> list[str]:
    """Someone else's ScaledObjects that scale the service, through its scale subresource (the
    docs' recipe for mode off, from before mode keda) or its Deployment: in any mode but off the
    operator, or KEDA's HPA of its own ScaledObject, sets that count too, and the two fight.
    `scaled_objects`: those of the service's namespace; `ours`: whether one is the service's own."""
    if mode == "off":
        return []
    out = []
    for so in scaled_objects:
        ref = (so.get("spec") or {}).get("scaleTargetRef") or {}
        kind = ref.get("kind") or "Deployment"
        if not ours(so) and ref.get("name") == service and kind in (crd.KIND, "Deployment"):
            out.append(f"ScaledObject {so['metadata']['name']} scales {kind}/{service} too, but in autoscaling.mode "
                       f"{mode} the {'operator' if mode == 'operator' else 'HorizontalPodAutoscaler of the operator'} "
                       "sets its count: the two fight; delete that ScaledObject, or set autoscaling.mode off to keep it")
    return out
