"""spec.networkPolicy → the service's NetworkPolicy: who may reach its server pods, port by port.
Pure (render.companions calls it with the service's metadata and pod selector).

Ingress only: the servers' egress (the model hub or S3, the trace collector, DNS) is theirs to
need, and a policy here that guessed it would break downloads. Two rules:
- the serving ports (gRPC, HTTP API) from spec.networkPolicy.from, by default the pods of the
  service's own namespace (`podSelector: {}` alone): never the world by omission;
- the metrics port (/health, /metrics, plain text) from the operator's own pods (their namespace
  and labels, which the chart tells the operator: EMBEDOP_POD_NAMESPACE/POD_NAMESPACE and
  EMBEDOP_POD_LABELS), so its scrapes still reach the pods, and from spec.networkPolicy.metricsFrom
  (Prometheus).
The kubelet's probes need no rule: traffic from a pod's own node is always allowed. Ports are
numbers, not names: every network plugin enforces numbered ports; some ignore named ones.

A rule with no peers would admit everyone (an empty `from` matches all sources): a port nobody is
named for gets no rule, and is closed."""

from __future__ import annotations

import copy
import dataclasses

# The label every namespace carries (the API server sets it): how a peer names one namespace.
NAMESPACE_LABEL = "kubernetes.io/metadata.name"
# spec.networkPolicy.from unset or empty: the service's own namespace, every pod of it.
SAME_NAMESPACE = ({"podSelector": {}},)


@dataclasses.dataclass(frozen=True)
class OperatorPods:
    """Where the operator's own pods run and the labels they all carry (its settings)."""
    namespace: str
    labels: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, settings) -> "OperatorPods":
        """From the operator's settings (config.OperatorSettings: pod_namespace, pod_labels)."""
        return cls(settings.pod_namespace, settings.pod_labels)

    def peer(self) -> dict | None:
        """The peer that selects them: that namespace AND those labels (one peer with both
        selectors; as two peers they would admit every pod of the namespace, and any pod with the
        labels anywhere). None when either is unknown (an operator outside the cluster)."""
        if not (self.namespace and self.labels):
            return None
        return {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: self.namespace}},
                "podSelector": {"matchLabels": dict(self.labels)}}


def _tcp(*ports: int) -> list[dict]:
    return [{"port": p, "protocol": "TCP"} for p in ports]


def network_policy(meta: dict, pod_selector: dict, spec: dict, serving_ports: tuple[int, ...],
                   metrics_port: int, operator: OperatorPods | None) -> dict:
    """`meta`: the service's metadata for an owned object; `pod_selector`: its pods' labels."""
    policy = spec["networkPolicy"]
    rules = [{"from": copy.deepcopy(list(policy.get("from") or SAME_NAMESPACE)), "ports": _tcp(*serving_ports)}]
    operator_peer = operator.peer() if operator is not None else None
    if metrics_peers := [*([operator_peer] if operator_peer else []), *copy.deepcopy(policy.get("metricsFrom") or [])]:
        rules.append({"from": metrics_peers, "ports": _tcp(metrics_port)})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": {"matchLabels": dict(pod_selector)}, "policyTypes": ["Ingress"],
                     "ingress": rules}}
