"""The operator as KEDA's external scaler (mode keda): KEDA's own externalscaler.proto, compiled;
the scaler served over real gRPC on loopback and called as KEDA's scaler code calls it
(GetMetricSpec for the target, GetMetrics for the value, IsActive and StreamIsActive for
activity), with the HPA's arithmetic applied to the answers. Over the load traces of
bench.autoscale_sim, the count KEDA's HPA would set is mode operator's decision at every step
(tolerance 0); with the HPA's default tolerance (10%, which the ScaledObject leaves) the steps
where it differs are counted, and are exactly those within 10% of the current count."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from bench import autoscale_sim as sim
from embedop import externalscaler_pb2 as pb
from embedop import externalscaler_pb2_grpc as pb_grpc
from embedop import scaler
from embedop.decisions import Decisions

ROOT = Path(__file__).resolve().parents[2]
KEY = ("fleet", "svc")


class Served:
    """The scaler on a loopback port, its event loop in a thread (as the operator's), and a
    channel to it; `publish` runs a decision on that loop, as the autoscaling step does."""

    def __init__(self):
        self.decisions = Decisions()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = self.run(scaler.serve(self.decisions, self.port, host="127.0.0.1"))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.ExternalScalerStub(self.channel)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def publish(self, count: int, demanded: bool, idle_s: float, now: float, key=KEY, running: bool = True):
        async def go():
            return self.decisions.publish(key, count, demanded, idle_s, now, running)
        return self.run(go())

    def close(self):
        self.channel.close()
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


def ref(key=KEY) -> pb.ScaledObjectRef:
    return pb.ScaledObjectRef(namespace=key[0], name=key[1], scalerMetadata={"scalerAddress": "embedop-scaler:9090"})


def hpa_count(stub, current: int, min_replicas: int, max_replicas: int, tolerance: float) -> int:
    """KEDA's external scaler and its HPA, for a trigger of metricType AverageValue: the target
    from GetMetricSpec, the value from GetMetrics (KEDA strips its "sN-" prefix before asking),
    then the HPA's external-metric rule (replica_calculator.go, GetExternalPerPodMetricReplicas):
    within tolerance of the current count, the current count; else ceil(value / target), within
    [max(1, minReplicaCount), maxReplicaCount]. The ScaledObject's behavior has no stabilization
    window and policies wider than any step, so they change nothing. At 0, KEDA activates."""
    spec = stub.GetMetricSpec(ref()).metricSpecs[0]
    value = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(), metricName=spec.metricName)).metricValues[0]
    target, usage = spec.targetSizeFloat, value.metricValueFloat
    if current > 0 and abs(usage / (target * current) - 1) <= tolerance:
        return current
    return min(max(math.ceil(usage / target), max(1, min_replicas)), max_replicas)


class ThroughKeda(sim.Ours):
    """Mode keda in the simulation: mode operator's decision (sim.Ours: embedop.autoscale.decide),
    published to the served scaler; the count is what KEDA's HPA makes of the scaler's answers."""

    def __init__(self, served: Served, tolerance: float):
        super().__init__()
        self.served, self.tolerance, self.steps = served, tolerance, []

    def __call__(self, fleet, t):
        decided = super().__call__(fleet, t)
        self.served.publish(decided, True, 300, t)
        count = hpa_count(self.served.stub, len(fleet), self.policy.min_replicas, self.policy.max_replicas,
                          self.tolerance)
        self.steps.append((len(fleet), decided, count))
        return count


@pytest.mark.parametrize("trace", ["step x4", "ramp", "spike 2x", "diurnal"])
def test_keda_sets_mode_operators_count_at_every_step(served, trace):
    exact = ThroughKeda(served, tolerance=0.0)
    sim.simulate(trace, "ours", policy=exact)
    assert exact.steps and all(count == decided for _, decided, count in exact.steps)
    changes = sum(1 for current, decided, _ in exact.steps if decided != current)
    assert changes > 0  # the trace moves the fleet: the check is not of a count that never changes
    # The HPA's default tolerance: a decision within 10% of the current count is not applied.
    loose = ThroughKeda(served, tolerance=0.1)
    sim.simulate(trace, "ours", policy=loose)
    differ = [(current, decided, count) for current, decided, count in loose.steps if count != decided]
    assert all(count == current and abs(decided / current - 1) <= 0.1 for current, decided, count in differ)
    print(f"\n{trace}: {len(exact.steps)} steps, {changes} changes, all equal with tolerance 0; "
          f"{len(differ)} kept by a 10% tolerance")


def test_activity_follows_demand_within_the_idle_window(served):
    stub = served.stub
    served.publish(2, False, idle_s=60, now=1000.0)  # a first decision counts as demand (no past seen)
    assert stub.IsActive(ref()).result
    served.publish(1, False, idle_s=60, now=1059.0)
    assert stub.IsActive(ref()).result
    served.publish(0, False, idle_s=60, now=1060.0)  # 60 s without demand: idle
    assert not stub.IsActive(ref()).result
    served.publish(1, True, idle_s=60, now=1061.0)
    assert stub.IsActive(ref()).result
    # At zero, a first decision is no demand: an operator restarting (or a new leader) must not
    # wake every service at zero.
    served.publish(0, False, idle_s=60, now=2000.0, key=("fleet", "asleep"), running=False)
    assert not stub.IsActive(ref(("fleet", "asleep"))).result


def test_stream_is_active_pushes_each_flip(served):
    served.publish(1, True, idle_s=10, now=0.0)
    stream = served.stub.StreamIsActive(ref())
    assert next(stream).result is True  # the current state at once
    served.publish(1, False, idle_s=10, now=5.0)  # no flip: nothing sent
    served.publish(0, False, idle_s=10, now=10.0)
    assert next(stream).result is False
    served.publish(1, True, idle_s=10, now=11.0)
    assert next(stream).result is True
    served.run(_forget(served.decisions))  # the service left mode keda: the stream ends cleanly
    with pytest.raises(StopIteration):  # (OK, which KEDA reads as EOF: its reconnect back-off resets)
        next(stream)
    assert stream.code() == grpc.StatusCode.OK


async def _forget(decisions: Decisions) -> None:
    decisions.forget(KEY)


def test_a_service_without_a_decision_is_unavailable_and_push_of_specs_unimplemented(served):
    for call in (lambda: served.stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(("x", "y")))),
                 lambda: served.stub.IsActive(ref(("x", "y")))):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "x/y" in e.value.details()
    spec = served.stub.GetMetricSpec(ref(("x", "y"))).metricSpecs  # the spec is the same for every service
    assert [(s.metricName, s.targetSizeFloat, s.targetSize) for s in spec] == [(scaler.METRIC, 1.0, 1)]
    with pytest.raises(grpc.RpcError) as e:  # optional in KEDA: it falls back to GetMetricSpec
        next(served.stub.StreamMetricSpec(ref()))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_message_far_larger_than_kedas_is_refused_and_the_scaler_serves_on(served):
    huge = pb.ScaledObjectRef(namespace=KEY[0], name=KEY[1], scalerMetadata={"x": "y" * 2 * scaler.MAX_MESSAGE_BYTES})
    with pytest.raises(grpc.RpcError) as e:
        served.stub.IsActive(huge)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    served.publish(1, True, 60, 0.0)
    assert served.stub.IsActive(ref()).result


def test_the_compiled_code_is_kedas_own_proto(tmp_path):
    """protos/embedop/externalscaler.proto is KEDA's file as vendored (no retyping), and the
    committed modules are what grpc_tools makes of it now."""
    vendored = ROOT.parent / "shared" / "vendor" / "keda" / "externalscaler.proto"
    ours = ROOT / "protos" / "embedop" / "externalscaler.proto"
    if vendored.exists():  # the vendored tree sits beside the repository here, not in a clean clone
        assert ours.read_bytes() == vendored.read_bytes()
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(ours)], check=True)
    for name in ("externalscaler_pb2.py", "externalscaler_pb2.pyi", "externalscaler_pb2_grpc.py"):
        assert (tmp_path / "embedop" / name).read_text() == (ROOT / "operator" / "embedop" / name).read_text(), name
