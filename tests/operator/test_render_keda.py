"""autoscaling.mode keda's objects (render_keda, pure): KEDA's ScaledObject and the HTTP add-on's
routes, validated against the real CRDs (tests/operator/fixtures; keda_schema.py checks their
schemas and CEL rules), and what each field must say: the count the operator decides reaches the
Deployment through KEDA's HPA unreshaped (behavior), the route wakes the service at zero and holds
requests longer than a start. The operator process against the emulator: test_keda.py."""

import copy
import math

import pytest

from embedop import reconcile, render, render_keda, spec as specs, status
from tests.operator import keda_schema, structural

OWNER = render.Owner("search", "ns1", "0b0c7e8e-0000-4000-8000-0000000000aa")
SCALER = "embedop-scaler.embedfleet-system.svc:9090"
BASE = {"model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"}}


def spec_of(**autoscaling) -> dict:
    return specs.defaulted({**BASE, "autoscaling": {"mode": "keda", **autoscaling}})


def render_all(route=render_keda.ROUTE_KIND, **autoscaling) -> list[dict]:
    return render.keda_objects(OWNER, spec_of(**autoscaling), SCALER, route)


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


CASES = {
    "zero, InterceptorRoute": (render_keda.ROUTE_KIND, {"minReplicas": 0, "maxReplicas": 8}),
    "zero, HTTPScaledObject": (render_keda.HTTPSO_KIND, {"minReplicas": 0, "maxReplicas": 3}),
    "zero, no add-on": (None, {"minReplicas": 0, "maxReplicas": 2}),
    "one": (render_keda.ROUTE_KIND, {"minReplicas": 1, "maxReplicas": 1}),
    "two to 1000": (None, {"minReplicas": 2, "maxReplicas": 1000, "idleSeconds": 86400, "intervalSeconds": 3600}),
}


@pytest.mark.parametrize("route, autoscaling", CASES.values(), ids=CASES.keys())
def test_every_object_validates_against_its_crd_and_every_field_sent_is_kept(route, autoscaling):
    """What the API server would refuse (schema, CEL rules, list types) or prune (a field its
    schema lacks: stored otherwise than sent, it would be applied again at every check)."""
    objects = render_all(route, **autoscaling)
    assert objects and objects[-1]["kind"] == "ScaledObject"  # last: its triggers name the routes before it
    for obj in objects:
        assert keda_schema.problems(obj) == [], (obj["kind"], keda_schema.problems(obj))
        plural = keda_schema.plural_of(obj["kind"])
        assert structural.prune(copy.deepcopy(obj), keda_schema.schema(plural)) == obj
        assert obj["apiVersion"] == keda_schema.api_version(plural)


def test_every_cel_rule_of_the_crds_is_checked():
    """keda_schema checks the CEL rules as plain code: every rule the CRDs state is one it knows
    (an unknown one is reported as a problem, so this fails with a newer CRD), and none is stale."""
    assert set(keda_schema.rules()) == set(keda_schema.RULES)


@pytest.mark.parametrize("break_it, found", [
    (lambda so: so["spec"].update(minReplicaCount=9), "minReplicaCount must be less than or equal"),
    (lambda so: so["spec"].update(triggers=[]), "triggers"),
    (lambda so: so["spec"]["triggers"][0].pop("metadata"), "metadata"),
    (lambda so: so["spec"]["triggers"][0]["metadata"].update(x=1), "is not of type 'string'"),
    (lambda so: so["spec"]["scaleTargetRef"].update(name=""), "name"),
    (lambda so: so["spec"].update(cooldownPeriod=-1), "cooldownPeriod"),
    (lambda so: so.update(apiVersion="keda.sh/v1"), "not served"),
], ids=["min over max", "no trigger", "trigger without metadata", "metadata not a string", "no target", "negative",
        "version"])
def test_the_scaled_object_check_refuses_what_the_api_server_would(break_it, found):
    """The validation can fail: each fact of KEDA's CRD, broken once."""
    so = copy.deepcopy(render_all(None, minReplicas=1, maxReplicas=4)[-1])
    break_it(so)
    assert any(found in p for p in keda_schema.problems(so)), keda_schema.problems(so)


@pytest.mark.parametrize("break_it, found", [
    (lambda r: r["spec"]["target"].update(port=8001), "exactly one of 'port' or 'portName'"),
    (lambda r: r["spec"].update(scalingMetric={}), "at least one of 'concurrency' or 'requestRate'"),
    (lambda r: r["spec"]["rules"][0].update(hosts=["a", "a"]), "duplicate entries"),
    (lambda r: r["spec"].pop("target"), "target"),
    (lambda r: r["spec"]["scalingMetric"]["concurrency"].update(targetValue=0), "minimum"),
    (lambda r: r["spec"].update(coldStart={}), "at least one of 'fallback' or 'placeholder'"),
], ids=["port and portName", "no metric", "a host twice", "no target", "target 0", "empty coldStart"])
def test_the_route_check_refuses_what_the_api_server_would(break_it, found):
    route = copy.deepcopy(by_kind(render_all(minReplicas=0), "InterceptorRoute")[0])
    break_it(route)
    assert any(found in p for p in keda_schema.problems(route)), keda_schema.problems(route)


def test_the_http_scaled_object_check_refuses_a_target_without_a_port():
    httpso = copy.deepcopy(render_all(render_keda.HTTPSO_KIND, minReplicas=0)[0])
    httpso["spec"]["scaleTargetRef"].pop("portName")
    assert any("must define either the 'portName' or the 'port'" in p for p in keda_schema.problems(httpso))


def test_the_scaled_object_is_owned_named_and_bounded_as_the_spec_says():
    spec = spec_of(minReplicas=2, maxReplicas=7, idleSeconds=600, intervalSeconds=10)
    (so,) = render.keda_objects(OWNER, spec, SCALER, render_keda.ROUTE_KIND)  # no route above zero
    service = render.service(OWNER, spec)
    assert (so["metadata"]["name"], so["metadata"]["namespace"]) == ("search", "ns1")
    # Labels and owner reference as every other owned object's (the Service's, less its metrics label).
    assert so["metadata"]["ownerReferences"] == service["metadata"]["ownerReferences"]
    assert so["metadata"]["labels"] == render.labels("search")
    (ref,) = so["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"], ref["controller"]) == ("EmbeddingService", OWNER.uid, True)
    deployment = render.deployment(OWNER, spec, "img", None, 30)
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": deployment["apiVersion"], "kind": "Deployment",
                                            "name": deployment["metadata"]["name"]}
    s = so["spec"]
    assert (s["minReplicaCount"], s["maxReplicaCount"], s["cooldownPeriod"], s["pollingInterval"]) == (2, 7, 600, 10)
    (ours,) = s["triggers"]
    assert ours == {"type": "external-push", "name": "embedop", "metricType": "AverageValue",
                    "metadata": {"scalerAddress": SCALER}}


def test_no_objects_outside_mode_keda_and_the_defaults():
    for mode in ("operator", "hpa", "off"):
        assert render.keda_objects(OWNER, specs.defaulted({**BASE, "autoscaling": {"mode": mode}}), SCALER,
                                   render_keda.ROUTE_KIND) == []
    (so,) = render.keda_objects(OWNER, specs.defaulted({**BASE, "autoscaling": {"mode": "keda"}}), SCALER, None)
    assert (so["spec"]["minReplicaCount"], so["spec"]["cooldownPeriod"]) == (1, 300)  # idleSeconds' default


def hpa(current: int, value: float, behavior: dict, maximum: int, minimum: int = 1, tolerance: float = 0.1) -> int:
    """Kubernetes' HPA for one AverageValue external metric of target 1 (KEDA's HPA with our trigger
    alone): the recommendation ceil(value / target), skipped within the tolerance of the current
    count, bounded by the behavior's policies (selectPolicy Max: the widest) over one period."""
    ratio = value * 1000 / (1000 * current)  # as the HPA: milli-units, in float64
    wanted = current if abs(ratio - 1) <= tolerance else math.ceil(value)
    wanted = min(max(wanted, minimum), maximum)
    if wanted > current:
        limits = [current * (1 + p["value"] / 100) if p["type"] == "Percent" else current + p["value"]
                  for p in behavior["scaleUp"]["policies"]]
        return min(wanted, math.floor(max(limits)))
    if wanted < current:
        limits = [current * (1 - p["value"] / 100) if p["type"] == "Percent" else current - p["value"]
                  for p in behavior["scaleDown"]["policies"]]
        return max(wanted, math.ceil(min(limits)))
    return current


def test_the_behavior_lets_the_decision_through_but_for_the_hpa_tolerance():
    """With the count as the metric and a target of 1, KEDA's HPA sets the operator's decision in
    one step, up or down, from any count to any other, with no stabilization window; except where
    the HPA's own tolerance (10%) holds the current count: a decision within 10% of it, i.e. a step
    of one pod (up to four, at 40 pods) from 10 pods up (the comment above render_keda.behavior
    says so)."""
    maximum = 40
    so = render_all(None, minReplicas=1, maxReplicas=maximum)[-1]
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == behavior["scaleDown"]["stabilizationWindowSeconds"] == 0
    held = []
    for current in range(1, maximum + 1):
        for decision in range(1, maximum + 1):
            got = hpa(current, decision, behavior, maximum)
            if got != decision:
                held.append((current, decision))
                assert got == current and abs(decision / current - 1) <= 0.1
    # From 10 pods: 10 → 9 is held (|1 − 0.9| ≤ 0.1), 10 → 11 is not (in floating point, as the HPA
    # computes it, |1 − 1.1| is a hair above 0.1); from 11, one pod either way is held.
    assert min(c for c, _ in held) == 10 and (10, 9) in held and (10, 11) not in held
    assert {(11, 10), (11, 12), (40, 39)} <= set(held) and not [h for h in held if abs(h[0] - h[1]) > 4]
    # HPA's defaults would not: +4 pods (or +100%) per 15 s up, a 300 s window down.
    defaults = {"scaleUp": {"policies": [{"type": "Pods", "value": 4}, {"type": "Percent", "value": 100}]},
                "scaleDown": {"policies": [{"type": "Percent", "value": 100}]}}
    assert hpa(1, 30, defaults, maximum) == 5 and hpa(1, 30, behavior, maximum) == 30


def test_at_zero_the_route_holds_requests_longer_than_a_start_and_wakes_the_scaled_object():
    objects = render_all(render_keda.ROUTE_KIND, minReplicas=0, maxReplicas=5)
    http, grpc = by_kind(objects, "InterceptorRoute")
    so = objects[-1]
    service = render.service(OWNER, spec_of(minReplicas=0))
    ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    # The ClusterIP Service (not the headless one), by its named ports: HTTP to the API port, gRPC
    # (h2c) to the gRPC port, by its services' paths; the names the Service answers to.
    assert http["spec"]["target"] == {"service": service["metadata"]["name"], "portName": "http"}
    assert grpc["spec"]["target"] == {"service": "search", "portName": "grpc"}
    assert ports["http"] == "http" and ports["grpc"] == "grpc"
    assert http["spec"]["rules"] == [{"hosts": ["search.ns1", "search.ns1.svc", "search.ns1.svc.cluster.local"]}]
    assert [p["value"] for p in grpc["spec"]["rules"][0]["paths"]][0] == "/embedfleet.v1.Inference"
    for route in (http, grpc):
        t = route["spec"]["timeouts"]
        seconds = {k: int(v.removesuffix("s")) for k, v in t.items()}
        assert seconds["readiness"] >= render.STARTUP_ALLOWANCE_S  # a whole start, not the add-on's default
        assert seconds["request"] >= seconds["readiness"] + seconds["responseHeader"]
        assert route["metadata"]["name"] != so["metadata"]["name"]  # the add-on's ScaledObject name, never ours
    assert so["spec"]["minReplicaCount"] == 0
    addon = so["spec"]["triggers"][1:]
    assert addon == [{"type": "external-push", "name": r["metadata"]["name"],
                      "metadata": {"scalerAddress": "keda-add-ons-http-external-scaler.keda:9090",
                                   "interceptorRoute": r["metadata"]["name"]}} for r in (http, grpc)]


def test_an_older_add_on_gets_an_http_scaled_object_that_makes_no_scaled_object_of_its_own():
    httpso, so = render_all(render_keda.HTTPSO_KIND, minReplicas=0, maxReplicas=3)
    assert httpso["kind"] == "HTTPScaledObject"
    assert httpso["metadata"]["annotations"] == {"httpscaledobject.keda.sh/skip-scaledobject-creation": "true"}
    assert httpso["metadata"]["name"] == "search-http" != so["metadata"]["name"]
    assert httpso["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "search",
                                                "service": "search", "portName": "http"}
    assert int(httpso["spec"]["timeouts"]["conditionWait"].removesuffix("s")) >= render.STARTUP_ALLOWANCE_S
    assert so["spec"]["triggers"][1]["metadata"] == {"scalerAddress": render_keda.ADDON_SCALER,
                                                     "httpScaledObject": "search-http"}


def test_the_add_on_trigger_wakes_but_does_not_size():
    """Its HPA recommendation, ceil(requests in flight / target), is at most one pod for any real
    concurrency: the HPA's max over the triggers is the operator's count."""
    (route, _, so) = render_all(minReplicas=0)
    target = route["spec"]["scalingMetric"]["concurrency"]["targetValue"]
    assert math.ceil(50_000 / target) == 1 and route["spec"]["scalingMetric"] == {"concurrency": {"targetValue": target}}


def test_without_the_add_on_zero_is_refused_by_a_floor_of_one():
    (so,) = render_all(None, minReplicas=0, maxReplicas=4)
    assert so["spec"]["minReplicaCount"] == 1 and len(so["spec"]["triggers"]) == 1
    assert render_keda.route_kind(lambda kind: False) is None
    assert render_keda.route_kind(lambda kind: True) == "InterceptorRoute"
    assert render_keda.route_kind(lambda kind: kind == "HTTPScaledObject") == "HTTPScaledObject"
    assert "minReplicas to 1" in render_keda.missing_addon_message()
    assert render_keda.ROUTE_CRD in render_keda.missing_addon_message()
    assert render_keda.HTTPSO_CRD in render_keda.missing_addon_message()


def test_above_zero_no_route_is_rendered_whatever_the_add_on():
    for route in (render_keda.ROUTE_KIND, render_keda.HTTPSO_KIND):
        assert [o["kind"] for o in render_all(route, minReplicas=1)] == ["ScaledObject"]


def test_the_count_is_handed_over_to_kedas_hpa_and_mirrored():
    spec = spec_of(minReplicas=0, maxReplicas=5)
    assert render.deployment_replicas(spec, 3) is None  # KEDA's HPA owns it, as ours in mode hpa
    assert render.deployment_replicas(spec, None, exists=False) == 1  # created with spec.replicas, within bounds
    assert render.mirrored_replicas(spec, 0) == 0  # spec.replicas follows, zero included


def test_status_at_zero_in_mode_keda_is_not_ready_scaled_to_zero():
    keda = status.from_deployment({"spec": {"replicas": 0}, "status": {}}, 0, [], 1, [], zero_is_ready=False)
    off = status.from_deployment({"spec": {"replicas": 0}, "status": {}}, 0, [], 1, [])
    ready = {c["type"]: c for c in keda["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", status.SCALED_TO_ZERO) and "KEDA" in ready["message"]
    assert {c["type"]: c for c in off["conditions"]}["Ready"]["status"] == "True"  # mode off: stopped on purpose
    spec = spec_of(minReplicas=0)
    assert reconcile.desired_replicas(spec, {"spec": {"replicas": 0}}, {"status": {"desiredReplicas": 3}}) == 0
    assert reconcile.desired_replicas(spec, {"spec": {"replicas": 2}}, {"status": {"desiredReplicas": 3}}) == 3
    assert reconcile.desired_replicas(spec, {"spec": {"replicas": 2}}, None) == 2


@pytest.mark.parametrize("extra, said", [
    ({}, []), ({"tls": {"secretRef": {"name": "t"}}}, ["tls"]),
    ({"networkPolicy": {"enabled": True, "metricsFrom": [{"podSelector": {}}]}}, ["networkPolicy.from"]),
    ({"routing": "gateway"}, ["routing gateway"]),
])
def test_what_a_zero_spec_may_get_wrong_is_warned_not_refused(extra, said):
    spec = specs.defaulted({**BASE, **extra, "autoscaling": {"mode": "keda", "minReplicas": 0}})
    assert specs.problems(spec) == []
    zero = [w for w in specs.warnings(spec) if w.startswith("autoscaling.minReplicas 0")]
    assert len(zero) == len(said) and all(s in w for s, w in zip(said, zero))
    above = specs.defaulted({**BASE, **extra, "autoscaling": {"mode": "keda", "minReplicas": 1}})
    assert not [w for w in specs.warnings(above) if w.startswith("autoscaling.minReplicas 0")]


def test_others_scaled_objects_on_the_service_are_said_in_every_mode_but_off():
    def so(name, kind, target, owned=False):
        return {"metadata": {"name": name, "owned": owned}, "spec": {"scaleTargetRef": {"kind": kind, "name": target}}}

    objects = [so("recipe", "EmbeddingService", "svc"), so("on-deploy", "Deployment", "svc"),
               so("ours", "Deployment", "svc", True), so("elsewhere", "Deployment", "other"),
               {"metadata": {"name": "no-kind"}, "spec": {"scaleTargetRef": {"name": "svc"}}}]
    ours = lambda o: o["metadata"].get("owned")  # noqa: E731
    for mode in ("operator", "hpa", "keda"):
        said = render_keda.fighting(objects, ours, "svc", mode)
        assert [s.split()[1] for s in said] == ["recipe", "on-deploy", "no-kind"], said  # a kind left out is a Deployment
        assert all(f"autoscaling.mode {mode}" in s for s in said)
    assert render_keda.fighting(objects, ours, "svc", "off") == []


def test_keda_hpa_without_the_operators_metric_is_told_apart():
    def hpa(*names):
        return {"spec": {"metrics": [{"type": "External", "external": {"metric": {"name": n}}} for n in names]}}

    assert render_keda.lacks_our_metric(hpa("s1-svc-http"))
    assert render_keda.lacks_our_metric({"spec": {}})
    assert not render_keda.lacks_our_metric(hpa("s0-embedfleet-replicas", "s1-svc-http"))
    assert not render_keda.lacks_our_metric(None)  # KEDA has not built it yet
    assert render_keda.HPA_METRIC == "s0-" + render_keda.SCALER_METRIC


def test_the_grpc_route_reaches_a_port_the_interceptor_speaks_h2c_to():
    """KEDA's interceptor proxies to a route's target port in HTTP/1.1 unless that Service port says
    appProtocol kubernetes.io/h2c (http-add-on interceptor/handler/upstream.go, requiresHTTP2): the
    gRPC route's port must say it, the HTTP route's must not (the API port speaks HTTP/1.1)."""
    spec = spec_of(minReplicas=0)
    ports = {p["name"]: p for p in render.service(OWNER, spec)["spec"]["ports"]}
    routes = {r["metadata"]["name"]: r for r in by_kind(render_all(minReplicas=0), render_keda.ROUTE_KIND)}
    to_grpc, to_http = routes["search-grpc"]["spec"]["target"], routes["search-http"]["spec"]["target"]
    assert to_grpc["service"] == render.service(OWNER, spec)["metadata"]["name"]
    assert ports[to_grpc["portName"]].get("appProtocol") == "kubernetes.io/h2c"
    assert ports[to_http["portName"]].get("appProtocol") != "kubernetes.io/h2c"


def test_keda_is_asked_again_after_growing_waits():
    waits = render_keda.REBUILD_AFTER_S
    assert render_keda.rebuild_due(None, 0.0)
    for times, wait in enumerate(waits, start=1):
        assert not render_keda.rebuild_due((100.0, times), 100.0 + wait - 0.1)
        assert render_keda.rebuild_due((100.0, times), 100.0 + wait)
    assert not render_keda.rebuild_due((100.0, 50), 100.0 + waits[-1] - 0.1)  # the last one, repeated
    assert list(waits) == sorted(waits) and waits[-1] >= 300  # KEDA that cannot reach it: no write a minute
