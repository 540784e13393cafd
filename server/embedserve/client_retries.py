"""The Client's retry decisions (embedserve.client), from a try's error and what the call saw
before (no I/O; the waits' jitter is random): whether to retry and after how long
(`wait_before_retry`), and whether the retry spends the process's retry budget (`spends_budget`;
the budget: client_routing.RetryBudget)."""

from __future__ import annotations

import random

import grpc

UNAVAILABLE_BACKOFF_S = (0.02, 1.0)  # first and largest wait when every pod is unavailable
# Retried at once on the next pod: a pod draining or gone (UNAVAILABLE), and a call the server
# cancelled as it shut down (a call that raced its GOAWAY; this client never cancels one itself:
# a caller's cancellation arrives as asyncio.CancelledError, never as a status).
ELSEWHERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def retry_after_s(error: grpc.RpcError) -> float | None:
    """The server's retry-after-ms, in seconds; None when it sent none (the refusal is not
    admission's, e.g. a message over the size limit: retrying cannot help)."""
    for key, value in error.trailing_metadata() or ():
        if key == "retry-after-ms":
            try:
                return max(0.0, float(value) / 1000)
            except ValueError:
                return None
    return None


def is_final(error: grpc.RpcError) -> bool:
    """The server said not to retry (gRPC's standard negative pushback): sustained overload."""
    return any(k == "grpc-retry-pushback-ms" and v.startswith("-") for k, v in error.trailing_metadata() or ())


def spends_budget(error: grpc.RpcError, unavailable: int) -> bool:
    """Whether retrying after `error` spends the retry budget; `unavailable`: this call's
    UNAVAILABLE/CANCELLED answers so far, `error`'s included. Free: the first retry after a pod
    said go elsewhere (draining, killed, shutting down: no answer came, so the retry is the one
    try of the call that can answer; what a pod's drain or death turns back is bounded by the
    calls it held, not multiplied, and gRPC's own throttling, gRFC A6, never throttles its
    transparent retries of calls a server never processed), and a retry onto the room the
    server booked for it (retry-after-ms: the server scheduled it and bounds those itself, by
    its reservation horizon). Charged: a retry after negative pushback (sustained overload),
    one after a backoff (every pod keeps saying go elsewhere), and hedges (client_calls): what
    multiplies load on a fleet that is slow or failing everywhere. Pure."""
    if error.code() in ELSEWHERE:
        return unavailable > 1
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return is_final(error)
    return True


def wait_before_retry(error: grpc.aio.AioRpcError, unavailable: int, final: int) -> float | None:
    """Seconds to wait before the next try; None: do not retry."""
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and is_final(error):
        # Sustained overload on that pod. Another pod may have room (one a scale-up just
        # added; the same pod behind a single address): once, at once, no more.
        return 0.0 if final == 0 else None
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        booked = retry_after_s(error)
        # Back on time: the room is booked for a grace after the moment, not before it.
        return None if booked is None else booked * random.uniform(1.0, 1.05)
    if error.code() in ELSEWHERE:
        # The next try goes to another pod: at once the first time; backing off only when
        # every pod keeps saying no (all draining, warming up, or gone).
        first, most = UNAVAILABLE_BACKOFF_S
        return 0.0 if unavailable == 0 else min(most, first * 2 ** unavailable) * random.uniform(0.5, 1.0)
    return None
