"""Faults and overload on real server processes (simulated device, so timings are known):
oversized messages, device faults, cancellation storms, SIGTERM, and a bounded soak."""

import asyncio
import signal
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.loadgen import call, open_loop
from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.model.simulated import FAIL_TOKEN
from tests.conftest import ONE_ROW_CAPS, ServerProcess, counter, make_text

CAPS = "16:8,32:8,64:8,128:4,256:2,512:1"


def infer_request(ids):
    ids = np.asarray([ids], "<i4")
    return pb.InferRequest(input_ids=ids.tobytes(), attention_mask=np.ones_like(ids).tobytes(), shape=list(ids.shape))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def serving(target) -> int:
    channel = grpc.insecure_channel(target)
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="")).status
    finally:
        channel.close()


@pytest.fixture(scope="module")
def sim_server():
    """One server for the two tests below, each of which leaves it serving: a 1 MiB message
    limit (what the device-fault test sends is bytes)."""
    server = ServerProcess({"MODEL_PATH": "sim:50000", "BATCH_CAPS": CAPS, "GRPC_MAX_MESSAGE_BYTES": str(1 << 20)}).wait_ready()
    yield server
    assert server.stop() == 0


def test_oversized_message_is_refused_by_grpc_and_the_server_keeps_serving(sim_server):
    server = sim_server
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 8 << 20)]))
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(pb.EmbedRequest(texts=["x" * (2 << 20)]))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.Embed(pb.EmbedRequest(texts=["still serving"])).shape == [1, 384]


def test_device_faults_fail_only_their_batch_then_probes_report_unhealthy_until_recovery(sim_server):
    server = sim_server
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.target))
    for i in range(3):
        with pytest.raises(grpc.RpcError) as e:
            stub.Infer(infer_request([101, FAIL_TOKEN, 102]))
        assert e.value.code() == grpc.StatusCode.INTERNAL and "simulated device fault" in e.value.details()
        if i < 2:
            assert server.health()[0] == 200 and serving(server.target) == health_pb2.HealthCheckResponse.SERVING
    code, fields = server.health()
    assert code == 503 and fields["status"] == "degraded"
    assert serving(server.target) == health_pb2.HealthCheckResponse.NOT_SERVING
    # still accepting: the next good batch succeeds and clears the failure state
    assert stub.Infer(infer_request([101, 2000, 102])).shape == [1, 384]
    assert server.health()[0] == 200 and serving(server.target) == health_pb2.HealthCheckResponse.SERVING


async def test_a_storm_of_cancelled_requests_leaves_the_queue_and_never_reaches_the_device():
    # 200 tokens/s: 60 requests of ~60 tokens would keep the device busy for ~18 s.
    server = ServerProcess({"MODEL_PATH": "sim:200", "BATCH_CAPS": ONE_ROW_CAPS,
                            "MAX_DRAIN_TIME_MS": "600000"}).wait_ready()
    try:
        channel = grpc.aio.insecure_channel(server.target)
        stub = pb_grpc.InferenceStub(channel)
        text = make_text(np.random.default_rng(0), 45)
        outcomes = await asyncio.gather(*(call(stub.Embed, pb.EmbedRequest(texts=[text]), 60, timeout_s=0.5)
                                          for _ in range(60)))
        assert {o.code for o in outcomes} <= {"OK", "DEADLINE_EXCEEDED"}
        assert sum(o.code == "DEADLINE_EXCEEDED" for o in outcomes) >= 55
        t0 = time.monotonic()
        while server.health()[1]["queued_tokens"] and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.05)
        assert server.health()[1]["queued_tokens"] == 0
        assert time.monotonic() - t0 < 3  # far sooner than computing them would take
        real = counter(server.http, "embedfleet_tokens_total", kind="real")
        assert real < 10 * 60  # at most the few batches already on the device ran
        assert (await stub.Embed(pb.EmbedRequest(texts=["after the storm"]), timeout=30)).shape == [1, 384]
        await channel.close()
    finally:
        server.stop()


async def test_sigterm_drains_in_flight_requests_and_exits_zero():
    # Its texts: 55 tokens, bucket 64. One row in the others: at 400 tokens/s the warm-up sleeps
    # through every bucket's cap at least twice (4 rows at 128 and 2 at 256 were ~4 s of it).
    server = ServerProcess({"MODEL_PATH": "sim:400", "BATCH_CAPS": "16:1,32:1,64:4,128:1,256:1,512:1",
                            "MAX_DRAIN_TIME_MS": "600000", "SHUTDOWN_GRACE_S": "20"}).wait_ready()
    channel = grpc.aio.insecure_channel(server.target)
    stub = pb_grpc.InferenceStub(channel)
    text = make_text(np.random.default_rng(1), 40)
    in_flight = [asyncio.ensure_future(call(stub.Embed, pb.EmbedRequest(texts=[text]), 50, timeout_s=30)) for _ in range(12)]
    def admitted():  # finished first, then in flight: a request between the two is missed, never doubled
        finished = counter(server.http, "embedfleet_requests_total", code="OK", rpc="Embed")
        return finished + server.health()[1]["in_flight_requests"]

    deadline = time.monotonic() + 60
    while admitted() < 12 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert admitted() == 12, server.health()[1]
    assert server.health()[1]["queued_tokens"] > 0  # work is still queued when SIGTERM arrives
    server.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.3)
    assert server.health()[0] == 503
    try:  # the listener is closed at once (new connections refused), or health says NOT_SERVING
        assert serving(server.target) == health_pb2.HealthCheckResponse.NOT_SERVING
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE
    late = await call(stub.Embed, pb.EmbedRequest(texts=["too late"]), 3, timeout_s=5)
    assert late.code == "UNAVAILABLE"
    results = await asyncio.gather(*in_flight)
    assert [o.code for o in results] == ["OK"] * 12  # everything admitted before SIGTERM finished
    assert server.proc.wait(30) == 0
    await channel.close()
    server.stop()


async def test_bounded_soak_at_three_times_capacity():
    rate = 3000
    server = ServerProcess({"MODEL_PATH": f"sim:{rate}", "BATCH_CAPS": CAPS, "MAX_DRAIN_TIME_MS": "300"}).wait_ready()
    try:
        channel = grpc.aio.insecure_channel(server.target)
        stub = pb_grpc.InferenceStub(channel)
        rng = np.random.default_rng(4)
        texts = [make_text(rng, int(n)) for n in rng.integers(10, 40, size=100)]
        await call(stub.Embed, pb.EmbedRequest(texts=texts[:8]), 0, timeout_s=30)  # warm the paths
        _, before = server.health()
        rss_before = rss_kib(server.proc.pid)
        picks = iter(rng.integers(0, len(texts), size=1_000_000))

        async def send():
            return await call(stub.Embed, pb.EmbedRequest(texts=[texts[next(picks)]]), 25, timeout_s=30)

        outcomes, _ = await open_loop(send, 3 * rate / 25, 12, seed=9)  # ~4,300 requests: enough to show growth
        assert {o.code for o in outcomes} <= {"OK", "RESOURCE_EXHAUSTED"}
        t0 = time.monotonic()
        while server.health()[1]["queued_tokens"] and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.05)
        _, after = server.health()
        growth_mib = (rss_kib(server.proc.pid) - rss_before) / 1024
        print(f"\nsoak: {len(outcomes)} requests, {sum(o.code == 'OK' for o in outcomes)} OK, "
              f"RSS growth {growth_mib:.1f} MiB, threads {before['threads']}→{after['threads']}, "
              f"tasks {before['asyncio_tasks']}→{after['asyncio_tasks']}")
        assert after["queued_tokens"] == 0 and after["in_flight_requests"] == 0  # every request answered
        assert growth_mib < 64
        assert after["threads"] <= before["threads"] + 1  # the tokenizer pool may have grown to its cap
        assert after["asyncio_tasks"] <= before["asyncio_tasks"] + 2
        await channel.close()
    finally:
        assert server.stop() == 0


def test_model_code_from_the_repository_never_runs_unless_trusted(tmp_path, model_dir):
    """A model directory that asks for its own Python code (auto_map): by default the code is not
    imported (its marker file never appears) and the built-in architecture serves; with
    TRUST_REMOTE_CODE=true it is."""
    import json
    import shutil

    repo = tmp_path / "untrusted"
    shutil.copytree(model_dir, repo)
    marker = tmp_path / "code-ran"
    (repo / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                  "from transformers import BertConfig as EvilConfig, BertModel as EvilModel\n")
    config = json.loads((repo / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}
    (repo / "config.json").write_text(json.dumps(config))
    server = ServerProcess({"MODEL_PATH": str(repo), "BATCH_CAPS": ONE_ROW_CAPS}).wait_ready()
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.target))
    assert stub.Embed(pb.EmbedRequest(texts=["served by the built-in BertModel"])).shape == [1, 384]
    assert server.stop() == 0
    assert not marker.exists()
    trusted = ServerProcess({"MODEL_PATH": str(repo), "TRUST_REMOTE_CODE": "true"})
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and trusted.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists()  # the switch really is the only thing between the repo's code and us
    finally:
        trusted.stop()
