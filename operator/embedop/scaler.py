"""KEDA's external scaler, served by the operator (mode keda): KEDA's own externalscaler.proto
(protos/embedop/, compiled: embedop.externalscaler_pb2*), so the count KEDA sets is the operator's
decision from the servers' service rate and drain time (embedop.decisions), not a queue length.

- GetMetricSpec: one metric, target 1 (AverageValue, as the ScaledObject's trigger says).
- GetMetrics: the decided count. KEDA's HPA computes ceil(value / target) = the count, unless the
  ratio to the current count is within its tolerance (10% by default, which the ScaledObject
  leaves: render_keda says why; docs/autoscaling.md what it costs).
- IsActive / StreamIsActive (the `external-push` trigger type): demand within the service's idle
  window. With minReplicaCount 0, KEDA takes the service to zero when every trigger has been
  inactive for cooldownPeriod, and back to one when any is active (the HTTP add-on's, at zero).
- StreamMetricSpec: not implemented (UNIMPLEMENTED): KEDA falls back to GetMetricSpec, whose
  answer never changes.

Only the leader has decisions, and serves at all (handlers.py starts the server with each
leadership term and stops it at its end, which closes KEDA's connection: gRPC reuses one
connection, so a follower that kept it open would be asked for ever). A service not known here
(not mode keda, not decided yet) is UNAVAILABLE: KEDA's HPA then keeps the count it has."""

from __future__ import annotations

import logging

import grpc

from embedop import externalscaler_pb2 as pb
from embedop import externalscaler_pb2_grpc as pb_grpc
from embedop.decisions import Decisions, Published

log = logging.getLogger(__name__)

METRIC = "embedfleet-replicas"  # the one metric: replicas the operator decided
TARGET = 1.0  # per replica: ceil(count / 1) = count


class Scaler(pb_grpc.ExternalScalerServicer):
    def __init__(self, decisions: Decisions):
        self.decisions = decisions

    async def _published(self, ref: pb.ScaledObjectRef, context) -> Published:
        published = self.decisions.get((ref.namespace, ref.name))
        if published is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"no decision for {ref.namespace}/{ref.name}: not an EmbeddingService in "
                                "autoscaling.mode keda, or not decided yet")
        return published

    async def IsActive(self, request: pb.ScaledObjectRef, context) -> pb.IsActiveResponse:
        return pb.IsActiveResponse(result=(await self._published(request, context)).active)

    async def StreamIsActive(self, request: pb.ScaledObjectRef, context):
        async for active in self.decisions.activity((request.namespace, request.name)):
            if active is None:  # gone from mode keda, or this pod stopped leading: KEDA asks again
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"no decision for {request.namespace}/{request.name}")
            yield pb.IsActiveResponse(result=active)

    async def GetMetricSpec(self, request: pb.ScaledObjectRef, context) -> pb.GetMetricSpecResponse:
        return pb.GetMetricSpecResponse(metricSpecs=[pb.MetricSpec(metricName=METRIC, targetSize=int(TARGET),
                                                                   targetSizeFloat=TARGET)])

    async def GetMetrics(self, request: pb.GetMetricsRequest, context) -> pb.GetMetricsResponse:
        count = (await self._published(request.scaledObjectRef, context)).count
        return pb.GetMetricsResponse(metricValues=[pb.MetricValue(metricName=request.metricName or METRIC,
                                                                  metricValue=count, metricValueFloat=float(count))])


# What KEDA sends is a ScaledObject's name, namespace and trigger metadata: a few hundred bytes.
# Anything far larger, or more streams than a cluster's ScaledObjects, is not KEDA's.
MAX_MESSAGE_BYTES = 64 * 1024
MAX_STREAMS = 1024  # per connection: KEDA keeps one StreamIsActive per mode keda ScaledObject


async def serve(decisions: Decisions, port: int, host: str = "[::]") -> grpc.aio.Server:
    """The scaler on `port` (every address, IPv4 and IPv6), started."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_concurrent_streams", MAX_STREAMS)])
    pb_grpc.add_ExternalScalerServicer_to_server(Scaler(decisions), server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    log.info("KEDA external scaler on :%d", port)
    return server


# On the leader's own pod: the scaler's Service (the chart's) selects it, so KEDA's one
# connection reaches the pod that has the decisions.
LEADER_LABEL = "embedfleet.dev/scaler"


class ScalerTerm:
    """The scaler for one leadership term (or, without election, the pod's life): served from
    `start`, and the pod labelled, until `stop` (which closes KEDA's connection, so it reconnects
    through the Service to the next leader). The label is best effort: without it (no POD_NAME, or
    RBAC without patch on pods in the operator's namespace) the Service reaches no pod, said once."""

    def __init__(self, decisions: Decisions, port: int, kube, namespace: str, pod: str):
        self.decisions, self.port, self.kube, self.namespace, self.pod = decisions, port, kube, namespace, pod
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        if not self.port or self.server is not None:
            return
        self.server = await serve(self.decisions, self.port)
        await self._label("leader")

    async def stop(self) -> None:
        server, self.server = self.server, None
        if server is None:
            return
        await self._label(None)
        await server.stop(grace=1.0)

    async def _label(self, value: str | None) -> None:
        if not self.pod or not self.namespace:
            log.warning("this operator pod's name or namespace is unknown (POD_NAME, POD_NAMESPACE): the scaler's "
                        "Service cannot select the leader; KEDA reaches the scaler only at EMBEDOP_SCALER_ADDRESS")
            return
        try:
            await self.kube.merge_patch("Pod", self.namespace, self.pod, {"metadata": {"labels": {LEADER_LABEL: value}}})
        except Exception as e:  # noqa: BLE001 - the decisions are served whatever the label's fate
            log.warning("labelling this pod %s=%s failed (%s): the scaler's Service may not reach the leader",
                        LEADER_LABEL, value, e)
