"""Blocking start-up work off the event loop, on daemon threads: a download, loading weights, a
warm-up. Not asyncio's default executor, whose threads the interpreter waits for at exit: a
SIGTERM during a download must not wait for the download."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


def in_daemon_thread(fn: Callable[..., Any], *args, name: str = "startup", **kwargs) -> asyncio.Future:
    """`await in_daemon_thread(fn, ...)` → fn's result (or its exception). Cancelling the await
    abandons the thread, which dies with the process."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
