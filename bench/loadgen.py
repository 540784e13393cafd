"""Load generation against an embedfleet server: closed loop at concurrency C, or open loop with
Poisson arrivals at a target rate. Every call has a deadline; every outcome is recorded."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Awaitable, Callable

import grpc
import numpy as np


@dataclasses.dataclass
class Outcome:
    code: str  # gRPC status name
    latency_s: float
    tokens: int  # real tokens offered
    server_ms: float | None = None  # server-side latency, from trailing metadata
    retry_after_ms: int | None = None


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
    return Outcome(code, time.perf_counter() - t0, tokens, server_ms, retry)


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


async def closed_loop(send: Callable[[], Awaitable[Outcome]], concurrency: int, total: int) -> tuple[list[Outcome], float]:
    """`concurrency` callers, each sending its next request when the last one ends."""
    remaining = [total]
    outcomes: list[Outcome] = []

    async def caller():
        while remaining[0] > 0:
            remaining[0] -= 1
            outcomes.append(await send())

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return outcomes, time.perf_counter() - start


def summarize(outcomes: list[Outcome], elapsed_s: float) -> dict:
    ok = [o for o in outcomes if o.code == "OK"]
    lat = np.array([o.latency_s for o in ok]) * 1000 if ok else np.zeros(1)
    codes: dict[str, int] = {}
    for o in outcomes:
        codes[o.code] = codes.get(o.code, 0) + 1
    return {
        "requests": len(outcomes),
        "codes": codes,
        "ok_tokens_per_s": sum(o.tokens for o in ok) / elapsed_s,
        "ok_requests_per_s": len(ok) / elapsed_s,
        "p50_ms": float(np.percentile(lat, 50)),
        "p95_ms": float(np.percentile(lat, 95)),
        "p99_ms": float(np.percentile(lat, 99)),
    }
