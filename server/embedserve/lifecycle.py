"""A serving process's life around SIGTERM/SIGINT: the same for the model process and each
front end."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import Callable


async def until_stopped(start_coro) -> tuple[asyncio.Task, asyncio.Event]:
    """Start; return when it fails, or when SIGTERM/SIGINT comes (before or after it is ready).
    → (the start task, done or not; the stop event, set once a signal has come)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    start = asyncio.create_task(start_coro)
    await asyncio.wait({start, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    return start, stop


def settle_heap() -> None:
    """Once start-up is done: collect its garbage, then move every object left (torch,
    transformers, the model: ~250,000 of them) out of the collector's reach. Each full
    collection walked them all, a pause of ~100-150 ms on the event loop every few seconds
    under load; after this, ~5 ms (bench/RESULTS.md, "Host path")."""
    gc.collect()
    gc.freeze()
    gc.enable()


def hold_collections() -> None:
    """No garbage collection while the model process imports torch and the server's modules
    (until `imports_done`): they create ~150,000 long-lived objects, and the collections they
    trigger walk them again and again (bench/RESULTS.md, "Start-up"). Only the imports: the
    loading, compiling and warming-up that follow make cyclic garbage of their own (compiling
    shapes with the collector off left 153k cyclic objects instead of 19k, and a model dropped
    in a cycle would keep its device memory) and run with it on."""
    gc.disable()


def imports_done() -> None:
    """The end of `hold_collections`: collect the imports' garbage, freeze what is left (later
    collections, transformers' imports first, do not walk it again) and collect from here on."""
    settle_heap()


LAG_EVERY_S = 0.025  # the loop-lag probe's period: a stall shows within this of its length
STALL_WARNING_S = 0.25  # a stall this long is logged: probes time out at 3 s, and a tenth of that is a cause
log = logging.getLogger(__name__)


async def watch_loop_lag(observe: Callable[[float], None], every_s: float = LAG_EVERY_S) -> None:
    """Forever: how late the event loop wakes a sleeper, each `every_s`, to `observe(seconds)`.
    Whatever holds the loop (a request's JSON, a long C call, the GIL kept by another thread) is
    time the probes and every other request wait: kubelet's readiness probe gives up after 3 s,
    twice. ~40 wake-ups a second, a few microseconds each."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every_s
        await asyncio.sleep(every_s)
        lag = max(0.0, loop.time() - due)
        observe(lag)
        if lag >= STALL_WARNING_S:
            log.warning("the event loop stalled %.2f s (probes, scrapes and every request waited)", lag)
