"""KEDA, as far as a mode keda ScaledObject needs it, for the emulated API server (kmock has no
controllers): every pollingInterval, for each ScaledObject, ask the external scaler its trigger
names what KEDA's scaler code asks (IsActive, GetMetricSpec, GetMetrics), and write the target
Deployment's count through its scale subresource as KEDA and the HPA it makes do:

- at 0 replicas, an active trigger scales to max(1, minReplicaCount) (KEDA's activation);
- with minReplicaCount 0, every trigger inactive for cooldownPeriod since it last was active
  scales to 0 (KEDA's deactivation);
- else the HPA's rule for an AverageValue external metric: ceil(value / target), unless within
  the tolerance of the current count (the ScaledObject's behavior tolerance, else 10%), within
  [max(1, minReplicaCount), maxReplicaCount]; the behavior's windows are 0 (checked), so no
  stabilization is emulated.

Its HPA, as KEDA's controller builds it (controllers/keda/hpa.go), is written too: one External
metric per trigger whose scaler answers GetMetricSpec at that moment, named "s<index>-<metric>",
a silent one left out; the ScaledObject's labels; built when it is missing and again when its
annotations change (KEDA's watch of the HPAs it owns; the rebuild drops annotations of others).
The count follows the operator's decision only while that HPA has its metric.

Only the `external-push` triggers whose scalerAddress it is told to reach are asked; the HTTP
add-on's answers its metric spec (it is never active here: no request waits in an interceptor).
What a real KEDA does beyond this (its metrics adapter, the HPA's 15 s sync, fallback) is
tests/cluster's."""

from __future__ import annotations

import math
import threading
import time

import grpc

from embedop import externalscaler_pb2 as pb
from embedop import externalscaler_pb2_grpc as pb_grpc

PLURAL = "/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects"
HPAS = "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers"


def hpa_count(value: float, target: float, current: int, low: int, high: int, tolerance: float) -> int:
    """The HPA's count from an AverageValue external metric (replica_calculator.go)."""
    if current > 0 and abs(value / (target * current) - 1) <= tolerance:
        return current
    return min(max(math.ceil(value / target), max(1, low)), high)


class Keda(threading.Thread):
    def __init__(self, emulator, namespace: str, scaler: str, address: str):
        """`scaler`: where the operator's scaler is reached from here; `address`: the one its
        ScaledObjects' trigger names (EMBEDOP_SCALER_ADDRESS: the in-cluster Service)."""
        super().__init__(daemon=True, name="keda-double")
        self.emulator, self.namespace, self.address = emulator, namespace, address
        self.reach(scaler)
        self.built: dict[str, dict] = {}  # ScaledObject → the annotations its HPA had when built
        # ScaledObjects whose next HPA build finds the operator's scaler silent (as when the lease
        # changes hands just then): its metric is left out of that build.
        self.silent_once: set[str] = set()
        self.halt = threading.Event()
        self.last_active: dict[str, float] = {}
        self.writes: list[tuple[str, int]] = []  # (name, count) each time it scaled
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.halt.is_set():
            wait = 1.0
            for so in (self.emulator.get(PLURAL.format(ns=self.namespace)) or {}).get("items", []):
                try:
                    wait = min(wait, float(so["spec"].get("pollingInterval", 30)))
                    self.step(so)
                except grpc.RpcError as e:  # UNAVAILABLE: no decision yet; KEDA keeps the count
                    self.errors.append(f"{so['metadata']['name']}: {e.code().name} {e.details()}")
            self.halt.wait(wait)

    def reach(self, scaler: str) -> None:
        self.channel = grpc.insecure_channel(scaler)
        self.stub = pb_grpc.ExternalScalerStub(self.channel)

    def hpa(self, so: dict) -> dict | None:
        """KEDA's HPA of `so`, built again when missing or when its annotations changed."""
        name = so["metadata"]["name"]
        path = HPAS.format(ns=self.namespace) + f"/keda-hpa-{name}"
        live = self.emulator.get(path)
        if live is not None and (live["metadata"].get("annotations") or {}) == self.built.get(name):
            return live
        metrics = []
        for i, trigger in enumerate(so["spec"]["triggers"]):
            if trigger["metadata"].get("scalerAddress") != self.address:  # the add-on's: it answers
                metrics.append(_external(f"s{i}-{trigger['name']}", 1, name))
                continue
            ref = pb.ScaledObjectRef(name=name, namespace=self.namespace, scalerMetadata=trigger["metadata"])
            if name in self.silent_once:
                self.silent_once.discard(name)
                continue
            try:
                metrics += [_external(f"s{i}-{m.metricName}", m.targetSize, name)
                            for m in self.stub.GetMetricSpec(ref, timeout=2).metricSpecs]
            except grpc.RpcError:
                pass  # left out, as KEDA does (it fails only when no trigger answers)
        if not metrics:
            return live
        spec = so["spec"]
        body = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": f"keda-hpa-{name}", "namespace": self.namespace,
                             "labels": {**(so["metadata"].get("labels") or {}), "scaledobject.keda.sh/name": name},
                             "annotations": None},
                "spec": {"scaleTargetRef": spec["scaleTargetRef"], "minReplicas": max(1, spec.get("minReplicaCount", 1)),
                         "maxReplicas": spec.get("maxReplicaCount", 100), "metrics": metrics}}
        if live is None:
            live = self.emulator.request("POST", HPAS.format(ns=self.namespace), {**body, "metadata": {
                **body["metadata"], "annotations": {}}})
        else:
            live = self.emulator.request("PATCH", path, body, content_type="application/merge-patch+json")
        self.built[name] = live["metadata"].get("annotations") or {}
        return live

    def step(self, so: dict) -> None:
        spec, name = so["spec"], so["metadata"]["name"]
        (ours,) = [t for t in spec["triggers"] if t["type"] == "external-push"
                   and t["metadata"].get("scalerAddress") == self.address]
        ref = pb.ScaledObjectRef(name=name, namespace=self.namespace, scalerMetadata=ours["metadata"])
        target = spec["scaleTargetRef"]["name"]
        path = f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{target}"
        deployment = self.emulator.get(path)
        if deployment is None:
            return
        hpa = self.hpa(so)
        current = int(deployment["spec"].get("replicas") or 0)
        low, high = int(spec.get("minReplicaCount", 0)), int(spec.get("maxReplicaCount", 100))
        now = time.monotonic()
        active = self.stub.IsActive(ref).result
        if active:
            self.last_active[name] = now
        behavior = ((spec.get("advanced") or {}).get("horizontalPodAutoscalerConfig") or {}).get("behavior") or {}
        tolerance = float((behavior.get("scaleDown") or {}).get("tolerance", 0.1))
        if current == 0:
            count = max(1, low) if active else 0
        elif low == 0 and now - self.last_active.get(name, now) >= float(spec.get("cooldownPeriod", 300)):
            count = 0
        elif not any(m["external"]["metric"]["name"].startswith("s0-") for m in (hpa or {}).get("spec", {}).get("metrics", [])):
            count = current  # its HPA counts without the operator's metric
        else:
            metric = self.stub.GetMetricSpec(ref).metricSpecs[0]
            value = self.stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName=metric.metricName))
            count = hpa_count(value.metricValues[0].metricValueFloat, metric.targetSizeFloat, current, low, high,
                              tolerance)
        if count != current:
            self.emulator.request("PATCH", path + "/scale", {"spec": {"replicas": count}},
                                  content_type="application/merge-patch+json")
            self.writes.append((name, count))

    def stop(self) -> None:
        self.halt.set()
        self.join(10)
        self.channel.close()


def _external(metric: str, target: int, scaled_object: str) -> dict:
    return {"type": "External", "external": {
        "metric": {"name": metric, "selector": {"matchLabels": {"scaledobject.keda.sh/name": scaled_object}}},
        "target": {"type": "AverageValue", "averageValue": str(target)}}}
