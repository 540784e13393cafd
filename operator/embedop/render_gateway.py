"""spec.routing: gateway → the service's InferencePool (the Gateway API Inference Extension,
inference.networking.k8s.io/v1). Pure (render.companions calls it with the service's metadata and
pod selector).

An InferencePool is a Service for inference: a Gateway's HTTPRoute names it as its backend, and
for every request the Gateway asks the pool's endpoint picker (EPP) which pod to send it to; the
picker chooses by what it scrapes from each pod's /metrics (embedfleet_queued_requests,
embedfleet_running_requests: docs/gateway.md). The picker and the Gateway are the cluster's to
deploy; this object only names the pods, their port and the picker.

Target port: the HTTP API alone. The Gateway routes HTTP, and every target port is an endpoint the
picker may choose (`podIP:port`), with one appProtocol for them all: gRPC's port listed here would
be handed HTTP/1.1 requests it cannot answer. The server's HTTP API is HTTP/1.1 (uvicorn speaks no
h2c): appProtocol http, the CRD's default, so it is not sent. Defaults are left out: a field an
older CRD lacks (appProtocol came after v1.0.0, still inference.networking.k8s.io/v1) is pruned by
the API server, and a render that does not stick as sent would be applied again at every check. The picker scrapes the first target port's /metrics by default, which
the API port serves too (behind the keys when spec.auth is set: spec.warnings says so)."""

from __future__ import annotations

GROUP, VERSION, KIND, PLURAL = "inference.networking.k8s.io", "v1", "InferencePool", "inferencepools"
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"
APP_PROTOCOL = "http"  # what the pods speak: the CRD's default, not sent (see above)


def picker_name(service: str, spec: dict) -> str:
    """spec.endpointPicker.name, by default `<service>-epp` (the Service in front of the picker)."""
    return (spec.get("endpointPicker") or {}).get("name") or f"{service}-epp"


def inference_pool(meta: dict, pod_selector: dict, spec: dict, http_port: int) -> dict:
    """`meta`: the service's metadata for an owned object (named like the service); `pod_selector`:
    the labels every one of its pods carries (the Deployment's selector)."""
    picker = spec.get("endpointPicker") or {}
    return {
        "apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
        "spec": {
            "selector": {"matchLabels": dict(pod_selector)},
            "targetPorts": [{"number": http_port}],
            # kind Service (the default, unsent): the picker's Service, whose port is then required
            # (the Service's port, not its target port).
            "endpointPickerRef": {"name": picker_name(meta["name"], spec), "port": {"number": picker["port"]},
                                  "failureMode": picker["failureMode"]},
        },
    }


def warnings(spec: dict) -> list[str]:
    """What a gateway-routed spec may still get wrong, said but not refused (the cluster's picker and
    Gateway may be configured for it; no check here can tell)."""
    out = []
    if spec.get("auth"):
        out.append("routing gateway with auth: the endpoint picker scrapes /metrics on the pool's target port (the HTTP "
                   "API port), which the API keys guard: point its scrape at the metrics port (docs/gateway.md), or it "
                   "reads no queue")
    if spec.get("tls"):
        out.append("routing gateway with tls: the InferencePool's appProtocol is http, and the pods' HTTP API speaks "
                   "TLS: the Gateway needs a BackendTLSPolicy for the pool, and the picker an https scrape")
    if (spec.get("networkPolicy") or {}).get("enabled"):
        out.append("routing gateway with a networkPolicy: admit the Gateway's proxy pods and the endpoint picker's pods "
                   "in networkPolicy.from (the HTTP API port) or metricsFrom (the metrics port), or the policy drops them")
    return out


CRD_MISSING = "InferencePoolCRDMissing"  # the Degraded reason and the Event's


def missing_crd_message(error: str) -> str:
    """The Degraded condition's message when the API has no InferencePool resource (404 on the
    write): the Gateway API Inference Extension's CRD is not installed."""
    return (f"spec.routing is gateway, but this cluster does not serve {KIND} ({API_VERSION}): install the Gateway API "
            f"Inference Extension's CRD {CRD_NAME}, or set spec.routing to service ({error})")
