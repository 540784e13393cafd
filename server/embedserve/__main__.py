"""`python -m embedserve`: serve until SIGTERM/SIGINT, then drain gracefully and exit 0."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from embedserve.config import ConfigError, Settings


async def _serve(settings: Settings) -> None:
    from embedserve.app import Server

    server = Server(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    start = asyncio.create_task(server.start())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if start.done() and start.exception() is not None:
        await server.stop(grace=0)
        raise start.exception()
    if not start.done():
        start.cancel()
    await stop.wait()
    logging.getLogger("embedserve").info("signal received: draining")
    await server.stop()


def main() -> int:
    logging.basicConfig(
        level=os.environ.get("LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        settings = Settings.from_env()
    except ConfigError as e:
        print(f"embedserve: configuration error: {e}", file=sys.stderr)
        return 2
    if settings.gil_switch_interval_ms > 0:
        sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)
    try:
        asyncio.run(_serve(settings))
    except Exception as e:  # start-up failures: one clear line, non-zero exit
        logging.getLogger("embedserve").error("start-up failed: %s", e, exc_info=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
