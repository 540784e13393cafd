"""A serving process's life around SIGTERM/SIGINT: the same for the model process and each
front end."""

from __future__ import annotations

import asyncio
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
