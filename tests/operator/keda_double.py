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

Only the `external-push` triggers whose scalerAddress it is told to reach are asked (the HTTP
add-on's is never active here: no request waits in an interceptor). What a real KEDA does
beyond this (its metrics adapter, the HPA's 15 s sync, fallback) is tests/cluster's."""

from __future__ import annotations

import math
import threading
import time

import grpc

from embedop import externalscaler_pb2 as pb
from embedop import externalscaler_pb2_grpc as pb_grpc

PLURAL = "/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects"


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
        self.channel = grpc.insecure_channel(scaler)
        self.stub = pb_grpc.ExternalScalerStub(self.channel)
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
