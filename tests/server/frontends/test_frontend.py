"""FRONTENDS=2: two front-end processes on the same ports feeding one model process, end to end:
the same vectors as one process, both front ends serving, one admission view and one signal,
metrics summed over the processes, cancellation reaching the model, and a graceful stop."""

import asyncio
import json
import os
import re
import resource
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import decode_embeddings
from tests.conftest import ServerProcess, counter, make_text
from tests.server.test_routing import offered_by

SIM = {"MODEL_PATH": "sim:20000", "BATCH_CAPS": "16:8,32:8,64:8,128:8,256:4,512:2"}


def slow_device(rate: int, bucket: int, rows: int | None = None) -> dict:
    """A simulated device of `rate` tokens/s: the one bucket the test's texts use keeps SIM's
    cap (or `rows`), the others one row. The warm-up runs every bucket's cap at least twice: at
    300 tokens/s SIM's caps everywhere slept ~20 s before the test began. The test's rows batch
    as with SIM's caps and the warm-up measures the same device rate."""
    caps = dict(c.split(":") for c in SIM["BATCH_CAPS"].split(","))
    return {"MODEL_PATH": f"sim:{rate}",
            "BATCH_CAPS": ",".join(f"{b}:{(rows or c) if int(b) == bucket else 1}" for b, c in caps.items())}


@pytest.fixture(scope="module")
def fronted():
    server = ServerProcess({**SIM, "FRONTENDS": "2", "MAX_DRAIN_TIME_MS": "600000"}).wait_ready()
    yield server
    server.stop()


def embed(target, texts):
    with grpc.insecure_channel(target) as channel:  # a new connection: any front end may take it
        return decode_embeddings(pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=texts)))


def test_the_same_vectors_as_one_process_and_both_front_ends_serve(fronted):
    single = ServerProcess(SIM).wait_ready()
    try:
        texts = ["front ends tokenize", "the model process computes", "one admission view"]
        np.testing.assert_array_equal(embed(fronted.target, texts), embed(single.target, texts))
    finally:
        single.stop()
    pids = {fronted.health()[1]["frontend_pid"] for _ in range(30)}  # a new HTTP connection each
    assert len(pids) == 2, pids
    body = json.dumps({"inputs": ["over http"]}).encode()
    req = urllib.request.Request(fronted.http + "/embed", body, {"Content-Type": "application/json"})
    assert len(json.loads(urllib.request.urlopen(req).read())[0]) == 384


def test_metrics_sum_over_the_processes_and_the_signal_is_one(fronted):
    before = counter(fronted.http, "embedfleet_requests_total", code="OK", rpc="Embed")
    offered0 = counter(fronted.http, "embedfleet_offered_tokens_total")
    computed0 = counter(fronted.http, "embedfleet_tokens_total", kind="real")
    for i in range(20):
        embed(fronted.target, [f"request {i}"])
    assert counter(fronted.http, "embedfleet_requests_total", code="OK", rpc="Embed") == before + 20
    # Front ends tokenize before the model admits: offered load is counted in real tokens, exactly.
    offered = counter(fronted.http, "embedfleet_offered_tokens_total") - offered0
    assert offered == counter(fronted.http, "embedfleet_tokens_total", kind="real") - computed0 > 0
    text = urllib.request.urlopen(fronted.http + "/metrics").read().decode()
    assert len(re.findall(r"^embedfleet_service_rate_tokens_per_second\{", text, re.M)) == 1  # one signal
    limits = re.findall(r"^embedfleet_admission_backlog_limit_seconds\{model=\S+} (\S+)$", text, re.M)  # from the model process
    assert len(limits) == 1 and 300 <= float(limits[0]) <= 600 - 0.05


def test_a_hedge_is_not_counted_as_new_demand_with_front_ends(fronted):
    """The hedge mark travels from the front end to the model process, which counts demand."""
    assert offered_by(fronted, hedge=False) > 0
    assert offered_by(fronted, hedge=True) == 0


def children(pid: int) -> set[int]:
    """The live processes `pid` started: a model process's front ends."""
    out = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out |= {int(p) for p in f.read().split()}
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return {p for p in out if alive(p)}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def post(url: str, body: dict, timeout: float = 30) -> int:
    """One request on a new connection (any front end may take it) → its HTTP status."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_killed_front_end_is_replaced_and_callers_meanwhile_are_all_served(fronted):
    """SIGKILL one front end: the model process starts another in its place. Started beside a
    sibling that serves the ports, it listens only once it can serve, so no caller on a new
    connection gets an error from it (listening first answered 404 to HTTP callers while it
    asked the model process for the tokenizer: a window of milliseconds, caught here only by
    chance; what is tested for certain is the replacement and that serving never stops)."""
    before = children(fronted.proc.pid)
    assert len(before) == 2, before
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(victim):
        assert time.monotonic() < deadline, "the killed front end did not die"
        time.sleep(0.01)
    # A connection the kernel handed the victim as it died is reset (1 in ~5 runs here, within
    # ~10 ms): the kill's doing. From the first answer on, its sibling alone has the ports until
    # the replacement starts (at the model process's next check, ~1 s) and joins them.
    while True:
        try:
            post(fronted.http + "/embed", {"inputs": ["after the kill"]})
            break
        except OSError:  # reset, or refused (urllib's URLError)
            assert time.monotonic() < deadline, "nothing served after the kill"
    statuses, seen = [], set()
    deadline = time.monotonic() + 60
    while not seen - before:  # until the replacement has answered a caller
        assert time.monotonic() < deadline, f"no new front end served within 60 s: {children(fronted.proc.pid)}"
        statuses.append(post(fronted.http + "/embed", {"inputs": [f"while restarting {len(statuses)}"]}))
        seen.add(fronted.health()[1]["frontend_pid"])
    statuses += [post(fronted.http + "/embed", {"inputs": [f"after {i}"]}) for i in range(20)]
    assert set(statuses) == {200}, statuses
    assert len(children(fronted.proc.pid)) == 2


def test_a_stuck_front_end_is_killed_and_replaced_but_none_while_the_model_warms_up():
    """A front end whose event loop no longer turns (SIGSTOP stands in for a deadlock) keeps its
    sockets: callers the kernel hands it wait forever, and the probes, reaching one front end of
    two at random, pass half the time. The model process, no longer asked for its state by it,
    kills it after FRONTEND_UNRESPONSIVE_S and starts another. A front end says only its hello
    until the model process can answer it: its silence counts from then (counted from its hello,
    every front end was killed at every start whose warm-up outlasts FRONTEND_UNRESPONSIVE_S, as
    every GPU start's does)."""
    # ~6 s of warm-up on a slow simulated device (the larger buckets' batches take ~1 s each).
    server = ServerProcess({**SIM, "MODEL_PATH": "sim:1000", "FRONTENDS": "2", "FRONTEND_UNRESPONSIVE_S": "3"})
    fronts = set()
    try:
        deadline = time.monotonic() + 30
        while len(fronts) < 2:
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log()[-2000:]
            fronts = children(server.proc.pid)
        server.wait_ready()
        assert "stuck, killing it" not in server.log() and children(server.proc.pid) == fronts
        deadline = time.monotonic() + 30
        while {server.health()[1]["frontend_pid"] for _ in range(10)} != fronts:  # both have been heard
            assert time.monotonic() < deadline, "both front ends did not serve"
        victim = min(fronts)
        os.kill(victim, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while alive(victim) or len(children(server.proc.pid)) < 2:
            assert time.monotonic() < deadline, f"the stuck front end was not replaced: {children(server.proc.pid)}"
            time.sleep(0.1)
        while True:  # until the replacement answers (a connection reset by the kill is the kill's)
            assert time.monotonic() < deadline, "the replacement never served"
            try:
                if server.health()[1]["frontend_pid"] not in fronts:
                    break
            except OSError:
                pass
        assert {post(server.http + "/embed", {"inputs": [f"after {i}"]}, timeout=10) for i in range(20)} == {200}
        assert "stuck, killing it" in server.log()
    finally:
        kill_front_ends(fronts)
        server.stop()


def test_a_front_end_that_cannot_be_started_is_started_later():
    """Starting a front end can fail (out of file descriptors, memory or processes): the model
    process tries again, backing off, instead of its supervisor dying without a word (no front
    end replaced again, none killed as stuck)."""
    server = ServerProcess({**SIM, "FRONTENDS": "2"}).wait_ready()
    fronts = children(server.proc.pid)
    limits = resource.prlimit(server.proc.pid, resource.RLIMIT_NOFILE)
    try:
        victim = min(fronts)
        resource.prlimit(server.proc.pid, resource.RLIMIT_NOFILE, (3, limits[1]))  # no new descriptor: Popen fails
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while f"front end {victim} exited" not in server.log():  # its replacement was attempted
            assert time.monotonic() < deadline, "the dead front end was never noticed"
            time.sleep(0.05)
        resource.prlimit(server.proc.pid, resource.RLIMIT_NOFILE, limits)
        deadline = time.monotonic() + 20  # the retry backs off 1, 2, 4 ... s
        while len(children(server.proc.pid)) < 2:
            assert time.monotonic() < deadline, "no front end was started once it could be"
            time.sleep(0.05)
        assert "starting another failed" in server.log()
        assert {post(server.http + "/embed", {"inputs": [f"after {i}"]}, timeout=10) for i in range(10)} == {200}
    finally:
        kill_front_ends(fronts | children(server.proc.pid))
        server.stop()


def kill_front_ends(pids) -> None:
    """Left behind if a test failed (and only they: a pid may have been reused)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"embedserve.frontends.frontend" in f.read():
                    os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def test_when_the_model_process_is_gone_the_front_ends_answer_what_waits_and_exit():
    """The model process dies without a word (SIGKILL, an OOM kill). In a pod it is PID 1 and
    the container goes with it; under an init process, or anywhere else, its front ends would
    hold the ports and leave their callers waiting forever. They answer UNAVAILABLE (503) and
    exit instead."""
    # Its 8 texts of 122 tokens: bucket 128, in four batches of two (held as long as in one of
    # eight, whose warm-up at SIM's cap alone slept 7 s).
    server = ServerProcess({**slow_device(300, 128, rows=2), "FRONTENDS": "2", "MAX_DRAIN_TIME_MS": "600000"}).wait_ready()
    fronts = children(server.proc.pid)
    try:
        with ThreadPoolExecutor(1) as pool:  # ~800 tokens on a 300 tokens/s device: held for seconds
            call = pool.submit(post, server.http + "/embed", {"inputs": [f"held by a slow device {i} " * 20 for i in range(8)]})
            while server.health()[1]["queued_tokens"] == 0 and not call.done():
                time.sleep(0.02)
            server.proc.kill()
            assert call.result(timeout=20) == 503
        deadline = time.monotonic() + 20
        while any(alive(p) for p in fronts):
            assert time.monotonic() < deadline, "front ends outlived their model process"
            time.sleep(0.05)
    finally:
        kill_front_ends(fronts)
        server.stop()


async def test_one_admission_view_across_front_ends_and_cancellation_reaches_the_model():
    """A slow device and a small budget: whichever front end a request lands on, the model
    process refuses what does not fit; a caller that gives up takes its rows out of the queue."""
    # Its texts of 33-50 tokens: bucket 64. The reorder window is half the 150 ms budget either way.
    server = ServerProcess({**slow_device(300, 64), "FRONTENDS": "2", "MAX_DRAIN_TIME_MS": "150"}).wait_ready()
    try:
        rng = np.random.default_rng(0)
        texts = [make_text(rng, 30) for _ in range(40)]

        async def one(text):
            async with grpc.aio.insecure_channel(server.target) as channel:
                try:
                    await pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=[text]), timeout=0.5)
                    return "OK"
                except grpc.aio.AioRpcError as e:
                    return e.code().name

        codes = await asyncio.gather(*(one(t) for t in texts))
        assert "RESOURCE_EXHAUSTED" in codes and "OK" in codes  # refused by the one model-side budget
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
        for _ in range(100):  # callers past their deadline: rows left the model's queue
            if server.health()[1]["queued_tokens"] == 0:
                break
            await asyncio.sleep(0.1)
        assert server.health()[1]["queued_tokens"] == 0
        assert counter(server.http, "embedfleet_rejected_requests_total", reason="drain_time") > 0
    finally:
        server.stop()


async def test_sigterm_drains_the_front_ends_then_the_model_and_loses_nothing():
    # Its texts of 62 tokens: bucket 64.
    server = ServerProcess({**slow_device(2000, 64), "FRONTENDS": "2", "MAX_DRAIN_TIME_MS": "600000"}).wait_ready()
    channel = grpc.aio.insecure_channel(server.target)
    stub = pb_grpc.InferenceStub(channel)
    calls = [asyncio.ensure_future(stub.Embed(pb.EmbedRequest(texts=[f"in flight {i} " * 20]), timeout=30))
             for i in range(12)]
    while server.health()[1]["queued_tokens"] == 0:  # admitted and waiting for the device
        await asyncio.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    results = await asyncio.gather(*calls, return_exceptions=True)
    await channel.close()
    assert [r.shape[0] if not isinstance(r, BaseException) else repr(r) for r in results] == [1] * 12
    assert server.proc.wait(30) == 0
    server.stop()


class Stuck:
    """A front end's process that never exits by itself; killing it ends the supervisor's watch."""

    pid = 4242

    def __init__(self, fronts):
        self.fronts = fronts

    def poll(self):
        return None

    def kill(self):
        self.fronts.stopping = True


async def test_a_stuck_front_end_is_reported_silent_for_the_time_judged(monkeypatch, caplog):
    """Its silence is judged from its last word or from when the model could answer it, whichever
    is later; the log said the time since its last word (its hello, maybe a whole warm-up ago)."""
    import embedserve.__main__ as main

    monkeypatch.setattr(main, "WATCH_EVERY_S", 0.01)
    fronts = main.FrontEnds(1, "unused")
    monkeypatch.setattr(fronts, "_spawn", lambda late=False: Stuck(fronts))
    fronts.start()
    now = time.monotonic()
    heard = {Stuck.pid: now - 300}  # its hello, at the start of a five-minute warm-up
    await asyncio.wait_for(fronts.watch(heard, 20.0, lambda: now - 25), 10)  # answered 25 s ago, silent since
    (line,) = [r.getMessage() for r in caplog.records if "stuck, killing it" in r.getMessage()]
    assert "for 25 s" in line, line


def test_a_front_end_that_keeps_dying_young_is_restarted_ever_more_slowly():
    from embedserve.__main__ import RESTART_MAX_DELAY_S, restart_delay

    delays, delay = [], 0.0
    for _ in range(7):  # dies at once, again and again
        delay = restart_delay(0.5 + delay, delay)
        delays.append(delay)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, RESTART_MAX_DELAY_S, RESTART_MAX_DELAY_S]
    assert restart_delay(3600.0, RESTART_MAX_DELAY_S) == 0.0  # a long life resets it
