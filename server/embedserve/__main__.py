"""`python -m embedserve`: serve until SIGTERM/SIGINT, then drain gracefully and exit 0.

FRONTENDS=1: one process does everything. FRONTENDS=N > 1: this process is the model's (admission,
batching, the device) and starts N front-end processes that serve the ports (embedserve.frontends.frontend);
SIGTERM drains the front ends first (their requests are still computed here), then the model."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

from embedserve import __version__, logs, tracing
from embedserve.model.device import ModelsDoNotFit
from embedserve.config import ConfigError, Settings
from embedserve.frontends.count import frontend_count
from embedserve.lifecycle import hold_collections, imports_done, until_stopped

log = logging.getLogger("embedserve")
RESTART_YOUNG_S = 10.0  # a front end that dies sooner than this after its start died young
RESTART_MAX_DELAY_S = 30.0
WATCH_EVERY_S = 1.0  # how often the model process looks at its front ends


async def _serve(settings: Settings) -> None:
    from embedserve.app import Server

    imports_done()  # torch and the server's modules imported: collections on (lifecycle.hold_collections)
    tracing.setup(settings, __version__)  # one process: its requests' spans are its own
    server = Server(settings)
    try:
        start, stop = await until_stopped(server.start())
        if start.done() and start.exception() is not None:
            await server.stop(grace=0)
            raise start.exception()
        if not start.done():
            start.cancel()
        await stop.wait()
        log.info("signal received: draining")
        await server.stop()
    finally:
        await asyncio.to_thread(tracing.shutdown)  # the last spans, exported off the loop


def restart_delay(lived_s: float, delay_s: float) -> float:
    """How long the next restart of a front end waits after its start, given how long it lived
    and the wait before it: none after a long life, else doubled (1, 2, 4 … 30 s) so a front end
    that cannot start does not spin. Pure."""
    if lived_s >= RESTART_YOUNG_S + delay_s:
        return 0.0
    return min(RESTART_MAX_DELAY_S, max(1.0, 2 * delay_s))


class FrontEnds:
    """The front-end processes: started, restarted if one dies while serving, and on stop asked
    to drain (SIGTERM), waited for, killed only past the grace period."""

    def __init__(self, count: int, ipc_path: str):
        self.count, self.env = count, {**os.environ, "EMBEDSERVE_IPC": ipc_path, "EMBEDSERVE_MODEL_PID": str(os.getpid())}
        self.procs: list[subprocess.Popen] = []
        self.stopping = False
        # Per slot: when its process started and how long to wait before the next restart
        # (doubled while it keeps dying young, so a front end that cannot start does not spin).
        self._since: list[float] = []
        self._delay: list[float] = []
        self._silent: list[float | None] = []  # killed as stuck: when it fell silent (its life ended then)

    def start(self) -> None:
        self.procs = [self._spawn() for _ in range(self.count)]
        self._since, self._delay = [time.monotonic()] * self.count, [0.0] * self.count
        self._silent = [None] * self.count

    def _spawn(self, late: bool = False) -> subprocess.Popen:
        """`late`: started again while its siblings serve the ports (it listens only once ready)."""
        env = {**self.env, "EMBEDSERVE_FRONTEND_LATE": "1"} if late else self.env
        return subprocess.Popen([sys.executable, "-m", "embedserve.frontends.frontend"], env=env)

    async def watch(self, heard: dict[int, float], unresponsive_s: float,
                    answering_since: Callable[[], float | None]) -> None:
        """Restart front ends that exit; kill one whose loop is stuck (not `heard` from, asking for
        the model's state, for `unresponsive_s`), so that it is restarted: its callers would wait
        forever, and the probes, each reaching one front end of N, would not notice. A front end
        says only its hello until the model process answers it (`answering_since()`: when it
        could, None before): its silence counts from then, not through the model's warm-up."""
        turn = time.monotonic()
        while not self.stopping:
            await asyncio.sleep(WATCH_EVERY_S)
            now = time.monotonic()
            # After a stall of this process's own loop, what the front ends sent meanwhile is not
            # read yet: judge their silence on a later turn, not on stale stamps.
            stalled, turn = now - turn > 2 * WATCH_EVERY_S, now
            since = answering_since()
            for i, p in enumerate(self.procs):
                if p.poll() is None:
                    last = heard.get(p.pid)
                    # Silent since its last word, or since the model could answer it if later.
                    silent_s = None if last is None or since is None else now - max(last, since)
                    if (not stalled and silent_s is not None and silent_s > unresponsive_s
                            and self._silent[i] is None and not self.stopping):
                        log.error("front end %d has not asked for the model's state for %.0f s: stuck, killing it",
                                  p.pid, silent_s)
                        p.kill()  # restarted on a later turn, once it has exited
                        self._silent[i] = last
                    continue
                if self.stopping or now < self._since[i] + self._delay[i]:
                    continue
                heard.pop(p.pid, None)
                # A front end killed as stuck lived until it fell silent: one that wedges soon
                # after each start backs off as one that dies young does.
                lived = (self._silent[i] or now) - self._since[i]
                self._delay[i] = restart_delay(lived, self._delay[i])
                self._since[i], self._silent[i] = now, None
                try:
                    self.procs[i] = self._spawn(late=True)
                except (OSError, subprocess.SubprocessError) as e:
                    # EMFILE, ENOMEM, EAGAIN: tried again on a later turn, backing off as after a
                    # life that ended at once (the supervisor had died with this, without a word).
                    log.error("front end %d exited with %s; starting another failed (%s): trying again", p.pid,
                              p.returncode, e)
                    continue
                log.error("front end %d exited with %s: starting another%s", p.pid, p.returncode,
                          f" (it died young: the next restart waits {self._delay[i]:.0f} s)" if self._delay[i] else "")
                heard.pop(self.procs[i].pid, None)  # a reused pid's old stamp is not this one's

    async def stop(self, grace: float) -> None:
        self.stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        # A front end drains for up to `grace`, then flushes its spans (tracing.shutdown, at most
        # FLUSH_S): killed only after both, or the slowest requests' spans are the ones lost.
        deadline = time.monotonic() + grace + tracing.FLUSH_S
        for p in self.procs:
            try:
                await asyncio.to_thread(p.wait, max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()


async def _serve_with_frontends(settings: Settings, count: int, ipc_path: str) -> None:
    from embedserve.app import Server
    from embedserve.frontends.door import ModelDoor

    imports_done()  # as in _serve
    server = Server(settings, listen=False)
    door = ModelDoor(server, ipc_path)
    door.start()
    fronts = FrontEnds(count, ipc_path)
    fronts.start()
    watcher = asyncio.create_task(fronts.watch(door.heard, settings.frontend_unresponsive_s, lambda: server.loaded_at))
    watcher.add_done_callback(_supervisor_ended)
    try:
        start, stop = await until_stopped(server.start())
        if start.done() and start.exception() is not None:
            raise start.exception()
        await stop.wait()
        start.cancel()
        log.info("signal received: draining %d front ends, then the model", count)
        t0 = time.monotonic()
        await fronts.stop(settings.shutdown_grace_s)
        await server.stop(grace=max(0.0, settings.shutdown_grace_s - (time.monotonic() - t0)))
    finally:
        watcher.cancel()
        await fronts.stop(0)
        await door.close()


def _supervisor_ended(task: asyncio.Task) -> None:
    """Never silently: front ends that die or wedge would no longer be replaced."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the front ends' supervisor failed: front ends are no longer restarted", exc_info=task.exception())


def check_files(settings: Settings) -> None:
    """What the API key and TLS files hold, checked once at start-up, in this process, before any
    front end starts: ConfigError names the variable whose file cannot be used. (auth and tls
    import no prometheus_client, which must come after PROMETHEUS_MULTIPROC_DIR is set.)"""
    from embedserve.transports import auth, tls

    auth.from_settings(settings)
    tls.from_settings(settings)


def main() -> int:
    hold_collections()  # over the imports of torch and the server (_serve ends it)
    level = os.environ.get("LOG_LEVEL", "INFO")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # gRPC's C core writes its own lines (e.g. one per failed TLS handshake, at INFO) to stderr,
    # past our handler and LOG_FORMAT: only its errors, unless the operator asks (front ends inherit it).
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        settings = Settings.from_env()
    except ConfigError as e:
        # In the format asked for, if that much can be read (a bad LOG_FORMAT itself: text).
        logs.configure("json" if os.environ.get("LOG_FORMAT", "").strip().lower() == "json" else "text", level)
        log.error("configuration error: %s", e)
        return 2
    logs.setup(settings, level)  # before the file checks: their warnings in LOG_FORMAT too
    try:
        check_files(settings)  # the keys and certificates, before any front end starts
    except ConfigError as e:
        log.error("configuration error: %s", e)
        return 2
    if settings.gil_switch_interval_ms > 0:
        sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)
    count = frontend_count(settings)
    try:
        if count == 1:
            asyncio.run(_serve(settings))
        else:
            # Before prometheus_client is imported: counters and histograms of every process of the
            # pod go to files in one directory, and any front end's /metrics renders their sum.
            workdir = tempfile.mkdtemp(prefix="embedserve-")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = workdir
            try:
                asyncio.run(_serve_with_frontends(settings, count, os.path.join(workdir, "model.ipc")))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    except ModelsDoNotFit as e:  # said where Kubernetes keeps it: the operator reports it (Degraded)
        log.error("start-up failed: %s", e)
        write_termination_message(str(e))
        return 1
    except Exception as e:  # start-up failures: one clear line, non-zero exit
        log.error("start-up failed: %s", e, exc_info=True)
        return 1
    return 0


# Kubernetes' default terminationMessagePath: what a container writes there is its status's
# `terminated.message` (up to 4 KiB), which the operator reads.
TERMINATION_LOG = "/dev/termination-log"


def write_termination_message(message: str) -> None:
    path = os.environ.get("TERMINATION_MESSAGE_PATH", TERMINATION_LOG)
    if path == TERMINATION_LOG and not os.path.exists(path):  # not in a container: kubelet mounts it
        return
    try:
        with open(path, "w") as f:
            f.write(message[:4096])
    except OSError as e:  # outside a container (no such file, read-only): the log has it
        log.debug("no termination message written to %s: %s", path, e)


if __name__ == "__main__":
    sys.exit(main())
