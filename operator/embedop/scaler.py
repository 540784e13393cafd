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

import asyncio
import logging
from typing import Callable

import grpc

from embedop import externalscaler_pb2 as pb
from embedop import externalscaler_pb2_grpc as pb_grpc
from embedop import render_keda
from embedop.decisions import Decisions, Published

log = logging.getLogger(__name__)

METRIC = render_keda.SCALER_METRIC  # the one metric: replicas the operator decided
TARGET = 1.0  # per replica: ceil(count / 1) = count


class Scaler(pb_grpc.ExternalScalerServicer):
    def __init__(self, decisions: Decisions, leading: Callable[[], bool] = lambda: True):
        """`leading`: this pod may act now (its lease held and renewed): a leader whose renewals
        lapse answers nothing rather than decisions that have stopped moving."""
        self.decisions, self.leading = decisions, leading

    async def _published(self, ref: pb.ScaledObjectRef, context) -> Published:
        published = self.decisions.get((ref.namespace, ref.name)) if self.leading() else None
        if published is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"no decision for {ref.namespace}/{ref.name}: not an EmbeddingService in "
                                "autoscaling.mode keda, or not decided yet")
        return published

    async def IsActive(self, request: pb.ScaledObjectRef, context) -> pb.IsActiveResponse:
        return pb.IsActiveResponse(result=(await self._published(request, context)).active)

    async def StreamIsActive(self, request: pb.ScaledObjectRef, context):
        async for active in self.decisions.activity((request.namespace, request.name)):
            if active is None or not self.leading():
                # No decision (not yet, gone from mode keda, this pod no longer leads): the stream
                # ends cleanly, which KEDA reads as EOF: it opens another after 2 s, its back-off
                # reset (an error would double it up to a minute per reconnect).
                return
            yield pb.IsActiveResponse(result=active)

    async def GetMetricSpec(self, request: pb.ScaledObjectRef, context) -> pb.GetMetricSpecResponse:
        return pb.GetMetricSpecResponse(metricSpecs=[pb.MetricSpec(metricName=METRIC, targetSize=int(TARGET),
                                                                   targetSizeFloat=TARGET)])

    async def GetMetrics(self, request: pb.GetMetricsRequest, context) -> pb.GetMetricsResponse:
        count = (await self._published(request.scaledObjectRef, context)).count
        return pb.GetMetricsResponse(metricValues=[pb.MetricValue(metricName=request.metricName or METRIC,
                                                                  metricValue=count, metricValueFloat=float(count))])


# What KEDA sends is a ScaledObject's name, namespace and trigger metadata: a few hundred bytes.
# (Streams are not bounded: KEDA keeps one StreamIsActive per mode keda ScaledObject on its one
# pooled connection, and its unary calls would queue behind them.)
MAX_MESSAGE_BYTES = 64 * 1024


async def serve(decisions: Decisions, port: int, host: str = "[::]",
                leading: Callable[[], bool] = lambda: True) -> grpc.aio.Server:
    """The scaler on `port` (every address, IPv4 and IPv6), started."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    pb_grpc.add_ExternalScalerServicer_to_server(Scaler(decisions, leading), server)
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
    through the Service to the next leader). `leading`: whether this pod may act now (a lapsed
    lease: nothing is answered). The label is retried until it sticks (an API hiccup must not
    leave the Service without an endpoint for a whole term); `forget` at start-up removes one a
    crashed container left on this pod (a restart keeps the pod and its labels), so the Service
    never selects a follower beside the leader."""

    RETRY_S = (1.0, 30.0)  # first and longest wait between tries of the label

    def __init__(self, decisions: Decisions, port: int, kube, namespace: str, pod: str,
                 leading: Callable[[], bool] = lambda: True, release: dict | None = None):
        """`release`: the labels of this release's operator pods (EMBEDOP_POD_LABELS): another
        release in the namespace has a leader of its own, whose label is not ours to take."""
        self.decisions, self.port, self.kube, self.namespace, self.pod = decisions, port, kube, namespace, pod
        self.leading, self.release = leading, release or {}
        self.server: grpc.aio.Server | None = None
        self._labelling: asyncio.Task | None = None

    async def forget(self) -> None:
        """Before any election: this pod leads nothing yet."""
        if self.port and self.pod and self.namespace:
            await self._label(None)

    async def start(self) -> None:
        if not self.port or self.server is not None:
            return
        self.server = await serve(self.decisions, self.port, leading=self.leading)
        self._labelling = asyncio.create_task(self._label_until_it_sticks(), name="scaler-label")

    async def stop(self) -> None:
        server, self.server = self.server, None
        if server is None:
            return
        if self._labelling is not None:
            self._labelling.cancel()
            await asyncio.gather(self._labelling, return_exceptions=True)
        await self._label(None)
        await server.stop(grace=1.0)

    async def _label_until_it_sticks(self) -> None:
        if not self.pod or not self.namespace:
            log.warning("this operator pod's name or namespace is unknown (POD_NAME, POD_NAMESPACE): the scaler's "
                        "Service cannot select the leader; KEDA reaches the scaler only at EMBEDOP_SCALER_ADDRESS")
            return
        wait, most = self.RETRY_S
        while not await self._label("leader") or not await self._unlabel_others():
            await asyncio.sleep(wait)
            wait = min(most, 2 * wait)

    async def _unlabel_others(self) -> bool:
        """The label off every other pod of this release: one an earlier leader kept (its removal
        at its term's end failed, and it runs on as a follower) would have the Service send KEDA
        to a pod that answers nothing. Only while this pod leads (a former leader still retrying
        must not take its successor's)."""
        if not self.leading():
            return True  # nothing to do in this term any more (or a lapse: done at the next try)
        try:
            pods, _ = await self.kube.list_versioned("Pod", self.namespace, {**self.release, LEADER_LABEL: "leader"})
        except Exception as e:  # noqa: BLE001 - tried again, as the label is
            log.warning("listing the pods labelled %s=leader failed (%s)", LEADER_LABEL, e)
            return False
        stale = [p["metadata"]["name"] for p in pods if p["metadata"]["name"] != self.pod]
        results = [self.leading() and await self._label(None, pod) for pod in stale]
        if stale:
            log.info("took the scaler's label off %s (a former leader's)", ", ".join(stale))
        return all(results)

    async def _label(self, value: str | None, pod: str | None = None) -> bool:
        """Set (or, None, remove) the label on this pod, or on `pod`."""
        if not self.pod or not self.namespace:
            return True
        try:
            await self.kube.merge_patch("Pod", self.namespace, pod or self.pod, {"metadata": {"labels": {LEADER_LABEL: value}}})
            return True
        except Exception as e:  # noqa: BLE001 - the decisions are served whatever the label's fate
            log.warning("labelling this pod %s=%s failed (%s): the scaler's Service may not reach the leader",
                        LEADER_LABEL, value, e)
            return False
