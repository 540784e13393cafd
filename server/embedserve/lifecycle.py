"""A serving process's life around SIGTERM/SIGINT: the same for the model process and each
front end."""

from __future__ import annotations

import asyncio
import gc
import signal


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
    under load; after this, ~5 ms (bench/RESULTS.md, "Host path"). The collector is on again
    from here if `collect_after_start` held it off."""
    gc.collect()
    gc.freeze()
    gc.enable()


def collect_after_start() -> None:
    """No garbage collection until the start-up is done (settle_heap): importing torch and
    transformers and loading the model creates ~250,000 long-lived objects, and the collections
    they trigger walk them again and again, ~1 s of a 3.3 s start-up's imports on a 2-core host
    (bench/RESULTS.md, "Start-up"). What start-up leaves in cycles is freed by settle_heap's
    collection, and nothing large is: tensors are freed by their reference counts."""
    gc.disable()
