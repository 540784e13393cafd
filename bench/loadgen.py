"""Load generation against an embedfleet server: closed loop at concurrency C, or open loop with
Poisson arrivals at a target rate. Every call has a deadline; every outcome is recorded.
Throughput is counted from what completes inside a steady window, so a scenario's start (an empty
queue filling) and its end (the queue draining, callers finishing) do not count."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Awaitable, Callable

import grpc
import numpy as np

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import WAIT_FOR_BOOKED_ROOM


@dataclasses.dataclass
class Outcome:
    code: str  # gRPC status name
    latency_s: float
    tokens: int  # real tokens offered
    server_ms: float | None = None  # server-side latency, from trailing metadata
    retry_after_ms: int | None = None
    done_at: float = 0.0  # perf_counter() when the call ended
    final: bool = False  # refused for sustained overload: do not retry (negative grpc-retry-pushback-ms)


async def call(stub_method, request, tokens: int, timeout_s: float, metadata=()) -> Outcome:
    t0 = time.perf_counter()
    rpc = stub_method(request, timeout=timeout_s, metadata=metadata)
    try:
        await rpc
        code = "OK"
    except grpc.aio.AioRpcError as e:
        code = e.code().name
    trailing = dict(await rpc.trailing_metadata() or ())
    server_ms = float(trailing["embedfleet-server-ms"]) if "embedfleet-server-ms" in trailing else None
    retry = int(trailing["retry-after-ms"]) if "retry-after-ms" in trailing else None
    final = trailing.get("grpc-retry-pushback-ms", "").startswith("-")
    done_at = time.perf_counter()
    return Outcome(code, done_at - t0, tokens, server_ms, retry, done_at, final)


class GrpcSystem:
    """Single-text Embed calls on one channel; text i of `texts` offers `tokens[i]` real tokens."""

    def __init__(self, name, target, texts, tokens):
        self.name, self.target, self.texts, self.tokens = name, target, texts, tokens

    async def __aenter__(self):
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = pb_grpc.InferenceStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()

    async def send(self, i: int, timeout_s: float = 60, refused: int = 0, wait: bool = True) -> Outcome:
        # A retry after `refused` refusals is marked as our Client marks it (not new demand; with
        # `wait`, wait server-side for the booked room); a server that does not know the keys
        # ignores them.
        attempt = (("embedfleet-attempt", str(refused + 1)),) if refused else ()
        metadata = attempt + ((WAIT_FOR_BOOKED_ROOM,) if refused and wait else ())
        return await call(self.stub.Embed, pb.EmbedRequest(texts=[self.texts[i]]), self.tokens[i], timeout_s, metadata)


async def until_served(system, i: int, rng, retries: float = float("inf"), wait: bool = True) -> Outcome:
    """A caller that gets its request done: a refused request waits the server's retry-after
    (with the Client's jitter) and tries again, marked as a retry; counted once, its latency
    from the first try. Saturation is what such callers get done. With `retries=2, wait=False`
    it is the openai client with its defaults (a marked retry, no server-side wait). A refusal
    for sustained overload ends it, as `x-should-retry: false` ends the openai client's."""
    refused, t0 = 0, time.perf_counter()
    while ((o := await system.send(i, refused=refused, wait=wait)).code == "RESOURCE_EXHAUSTED"
           and refused < retries and not o.final):
        refused += 1
        await asyncio.sleep((o.retry_after_ms or 10) / 1000 * float(rng.uniform(1.0, 1.05)))
    o.latency_s = time.perf_counter() - t0
    return o


async def open_loop(
    send: Callable[[], Awaitable[Outcome]], rate_per_s: float, duration_s: float, seed: int = 0
) -> tuple[list[Outcome], float]:
    """Poisson arrivals for `duration_s`; → (outcomes, seconds actually spent sending)."""
    rng = np.random.default_rng(seed)
    tasks = []
    start = time.perf_counter()
    next_at = start
    while True:
        next_at += rng.exponential(1.0 / rate_per_s)
        if next_at - start > duration_s:
            break
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(send()))
    sent_for = time.perf_counter() - start
    return list(await asyncio.gather(*tasks)), sent_for


async def closed_loop(send: Callable[[], Awaitable[Outcome]], concurrency: int, total: int | None = None,
                      duration_s: float = float("inf")) -> tuple[list[Outcome], float]:
    """`concurrency` callers, each sending its next request when the last one ends, until `total`
    requests are sent or `duration_s` has passed."""
    remaining = [float("inf") if total is None else total]
    outcomes: list[Outcome] = []
    start = time.perf_counter()

    async def caller():
        while remaining[0] > 0 and time.perf_counter() - start < duration_s:
            remaining[0] -= 1
            outcomes.append(await send())

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return outcomes, time.perf_counter() - start


def summarize(outcomes: list[Outcome], elapsed_s: float, window: tuple[float, float] | None = None) -> dict:
    """Codes and latency over every outcome; throughput over `elapsed_s`, or, given a `window`
    (perf_counter from, to), from the OK calls that ended inside it."""
    ok = [o for o in outcomes if o.code == "OK"]
    done = ok if window is None else [o for o in ok if window[0] <= o.done_at < window[1]]
    span = elapsed_s if window is None else window[1] - window[0]
    lat = np.array([o.latency_s for o in ok]) * 1000 if ok else np.zeros(1)
    codes: dict[str, int] = {}
    for o in outcomes:
        codes[o.code] = codes.get(o.code, 0) + 1
    return {
        "requests": len(outcomes),
        "codes": codes,
        "ok_tokens_per_s": sum(o.tokens for o in done) / span,
        "ok_requests_per_s": len(done) / span,
        "p50_ms": float(np.percentile(lat, 50)),
        "p95_ms": float(np.percentile(lat, 95)),
        "p99_ms": float(np.percentile(lat, 99)),
    }
