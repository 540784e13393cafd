"""Files that change under a running server: a mounted Secret's API keys, certificate and key.

Kubelet updates a mounted Secret (one mounted without subPath) by writing its new files into a
new directory and swapping the `..data` symlink to it in one rename, so every file of the Secret
changes at once and a reader never sees half of one. The files' paths go through that symlink:
their `os.stat` (which follows it) shows a new inode when it swaps, and a file edited in place
shows a new mtime or size. One task per process looks once a second (RELOAD_EVERY_S), off every
request's path; what it reads again replaces what the requests use in one assignment."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable, Iterable

log = logging.getLogger(__name__)
RELOAD_EVERY_S = 1.0


def signature(path: str) -> tuple | None:
    """What tells a file's new version from its old one, without reading it (None: not there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


class Watched:
    """Files read together (a certificate and its key). `changed()` is true once per change of any
    of them, whether or not reading them then succeeds: a file left broken is reported once, not
    every second, and read again at its next change."""

    def __init__(self, paths: Iterable[str]):
        self.paths = tuple(paths)
        self._seen = self._now()

    def _now(self) -> tuple:
        return tuple(signature(p) for p in self.paths)

    def changed(self) -> bool:
        now = self._now()
        if now == self._seen:
            return False
        self._seen = now
        return True


async def every(period_s: float, checks: list[Callable[[], None]]) -> None:
    """Run each check every `period_s` until cancelled; one that fails is logged and tried again."""
    while True:
        await asyncio.sleep(period_s)
        for check in checks:
            try:
                check()
            except Exception:  # noqa: BLE001 - the next look may succeed; serving goes on meanwhile
                log.exception("reading changed files failed")
