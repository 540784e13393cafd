"""A front-end process (FRONTENDS > 1): gRPC and HTTP on the pod's ports (SO_REUSEPORT: the kernel
spreads connections over the front ends), validation and tokenization, and the token rows handed
to the model process over IPC, which admits, batches and computes them (embedserve.frontends.door).
A single event loop tops out at ~1,300-2,500 single-text requests/s: several front ends feed
one device that can do far more. `python -m embedserve.frontends.frontend`, started by the model process.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from embedserve import __version__, logs, model_list, tracing
from embedserve.frontends import ipc, token_rows_ipc
from embedserve.batching.multivector_tokenization import from_spec
from embedserve.config import Settings, served_model_name, text_tokens
from embedserve.model.declared import Head
from embedserve.errors import NotReady, from_wire
from embedserve.admission.gate import Caller
from embedserve.lifecycle import settle_heap, until_stopped
from embedserve.metrics import Metrics, idle_signal
from embedserve.batching.shaping import Limits, PreTokenized, Result, Texts, cut, require_task, tokenize
from embedserve.model.calibration import digest
from embedserve.model.m3_rows import M3Rows
from embedserve.model.sparse_rows import SparseRows
from embedserve.batching.tokenization import TextTokenizer
from embedserve.batching import windows
from embedserve.transports.encodings import Quantization
from embedserve.transports.listeners import Transports

log = logging.getLogger(__name__)
STATE_EVERY_S = 0.25  # how fresh a front end's /health, gRPC health and shared signal are
STATE_TIMEOUT_S = 2.0  # how long a front end waits for the model process's state
STATE_MISSES = 2  # unanswered state requests in a row that make the model process unhealthy


class RemoteService(PreTokenized):
    """What the transports call, as EmbeddingService: the rows go to the model process."""

    def __init__(self, link: ipc.Link, tokenizer: TextTokenizer, limits: Limits, head: Head | None, task: str,
                 executor, activation: str = "", model: str = ""):
        super().__init__()
        self.link, self.tokenizer, self.limits, self.head, self.task = link, tokenizer, limits, head, task
        self.executor, self.activation = executor, activation
        self.model = model  # its name in the model process (MODELS; "" there: the default)

    def require_task(self, task: str) -> None:
        require_task(self.task, task)

    async def _texts(self, r: Texts, caller: Caller) -> Result:
        trace = caller.trace
        started = time.monotonic() if trace is not None else 0.0
        owners = None
        if r.window:  # the windows travel as rows, each with its text: pooled in the model process
            ids, lengths, owners = await windows.tokenize(self.tokenizer, self.executor, r.texts, r.prompt, r.truncate,
                                                          max(self.limits.text_tokens, self.limits.max_length))
        else:
            ids, lengths = await tokenize(self.tokenizer, self.executor, r)
        if trace is not None:
            trace.tokenized(started)
        return await self._rows(ids, lengths, r.key, caller, owners)

    async def _rows(self, ids: np.ndarray, lengths: np.ndarray, key: int, caller: Caller,
                    owners: np.ndarray | None = None) -> Result:
        ids, lengths = cut(ids, lengths, self.limits)
        header = {"op": "rows", "model": self.model, "key": key, "retry": caller.retry, "deadline": caller.deadline_s,
                  "waits": caller.waits, "hedge": caller.hedge, "rows": ids.shape[0], "width": ids.shape[1], "lengths": lengths.tolist()}
        if owners is not None:
            header["owners"] = owners.tolist()
        trace = caller.trace
        if trace is not None:  # the model process stamps admission, queue and batches, and sends them back
            header["trace"] = True
        reply, data = await self.link.call(header, np.ascontiguousarray(ids, dtype="<i4").tobytes())
        if trace is not None:
            if "trace" in reply:
                trace.merge(reply["trace"])
            trace.answered()
        if "error" in reply:
            raise from_wire(reply)
        if (tokens := token_rows_ipc.rows_of(reply, data)) is not None:  # task multivector: token vectors
            return Result(tokens, reply["tokens"])
        if "m3" in reply:  # task bgem3: dense, sparse and ColBERT rows (embedserve.model.m3_rows)
            return Result(M3Rows.from_wire(reply, data), reply["tokens"])
        if "nnz" in reply:  # task sparse: CSR (embedserve.model.sparse_rows)
            return Result(SparseRows.from_bytes(data, reply["rows"], reply["nnz"], reply["dim"]), reply["tokens"])
        return Result(np.frombuffer(data, dtype="<f4").reshape(reply["rows"], reply["dim"]), reply["tokens"])


class RemoteModel:
    """One model of the model process, as a front end's transports address it (hub.Model)."""

    def __init__(self, settings: Settings):
        self.served_name, self.model_name = served_model_name(settings), settings.model_path
        self.service: RemoteService | None = None
        self.task, self.labels, self.head, self.activation = "embed", [], None, ""
        self.model_dimension = 0  # dimensions the model computes: from the model process
        self.quantization = Quantization(settings.quantize_range)  # the model process's, once it is ready

    def said(self, hello: dict, calibration, link: ipc.Link, settings: Settings, executor) -> None:
        """What the model process said of it (its part of the hello, its calibration's bytes)."""
        head = Head(**{**hello["head"], "pooling": tuple(hello["head"]["pooling"]), "dense": ()}) if hello["head"] else None
        tokenizer = from_spec(hello["tokenizer"], settings.truncate)  # a multi-vector model's: by side
        self.task, self.labels, self.head = hello["task"], hello["labels"], head
        self.model_dimension = hello["model_dimension"]
        self.quantization = quantization_from(hello["quantization"], calibration)
        self.activation = hello.get("activation", "")
        self.service = RemoteService(link, tokenizer, Limits(settings.max_texts_per_request, tokenizer.max_length,
                                                             settings.truncate, settings.long_texts,
                                                             text_tokens(settings, tokenizer.max_length)),
                                     None if hello["simulated"] else head, self.task, executor, self.activation,
                                     hello["name"])


def quantization_from(said: dict, payload) -> Quantization:
    """The model process's Quantization from its hello: a fixed range, or the calibration's
    vectors (the payload, float32), checked against the digest it named."""
    shape = tuple(said["shape"])
    if not all(shape):
        return Quantization(said["r"])
    calibration = np.frombuffer(payload, dtype="<f4").reshape(shape).astype(np.float32)
    q = Quantization(calibration=calibration, normalized=said["normalized"], digest=said["digest"])
    if q.digest != digest(calibration):
        raise RuntimeError(f"the calibration from the model process is not the one it named ({said['digest']})")
    return q


class Frontend:
    """The hub the transports serve, in a front end: the model's state comes from the model
    process, refreshed every STATE_EVERY_S."""

    def __init__(self, settings: Settings, path: str, late: bool = False):
        self.settings = settings
        self.late = late  # started again beside front ends that serve: listen only once it can serve
        # The model process (its pid from its environment: if it died while this one imported,
        # the parent is already another process).
        self.parent = int(os.environ.get("EMBEDSERVE_MODEL_PID", os.getppid()))
        self.link = ipc.Link(path)
        self.state: dict = {"health": {"status": "starting"}, "healthy": False, "signal": None}
        self.metrics = Metrics(self._signal, os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.models = {m.served_name: m for m in map(RemoteModel, model_list.each(settings))}
        self.default = next(iter(self.models.values()))
        self.started_at = time.monotonic()
        self.draining = False
        self._executor = ThreadPoolExecutor(max_workers=settings.tokenization_workers, thread_name_prefix="tokenize")
        self.transports = Transports(self, reuse_port=True)
        self._refresher: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._missed = 0  # state requests unanswered in a row

    def model(self, name: str | None = None) -> RemoteModel:
        return model_list.addressed(self.models, name)

    # The default model's, as the Server has them (hub.Hub).
    service = property(lambda self: self.default.service)
    served_name = property(lambda self: self.default.served_name)
    model_name = property(lambda self: self.default.model_name)
    task = property(lambda self: self.default.task)
    labels = property(lambda self: self.default.labels)
    head = property(lambda self: self.default.head)
    activation = property(lambda self: self.default.activation)
    model_dimension = property(lambda self: self.default.model_dimension)
    quantization = property(lambda self: self.default.quantization)

    def _signal(self) -> dict:
        return self.state["signal"] or idle_signal(list(self.models))

    @property
    def healthy(self) -> bool:
        return self.service is not None and not self.draining and self.state["healthy"]

    def drain_s(self) -> float:
        """The model process's, as its latest reply over the link stamped it (every reply does,
        a request's answer and the state alike: transports/drain.py). Before any, 0: nothing is
        queued before the model is ready (what one process answers while it warms up)."""
        return self.link.stamp.get("drain_s", 0.0)

    def health_fields(self) -> dict:
        return {**self.state["health"], "frontend_pid": os.getpid(),
                "frontend_in_flight_requests": self.service.in_flight if self.service else 0}

    async def start(self) -> None:
        settle_heap()  # before any request: what is frozen now is never freed
        self._watcher = asyncio.create_task(self._watch_model(), name="model-process")
        if not self.late:  # at the pod's start: nothing serves the ports yet, and probes read "starting"
            await self.transports.start()
        hello, payload = await self.link.call({"op": "hello", "pid": os.getpid()})  # answered once the models are ready
        at = 0
        for said in hello["models"]:  # each model's calibration follows the one before in the payload
            size = 4 * math.prod(said["quantization"]["shape"])
            self.models[said["name"]].said(said, payload[at:at + size], self.link, self.settings, self._executor)
            at += size
        self.transports.install_api()  # with the service, in one step: no window where API paths 404
        if self.late:
            # Its siblings serve the ports meanwhile, and the kernel spreads new connections over
            # every listening socket at once: started before the API was installed, it answered
            # some callers 404 (HTTP) or UNAVAILABLE (gRPC) while the pod was Ready. Now the HTTP
            # socket is not listening until here; gRPC's listens from the moment its port was
            # added, and what lands there waits in the backlog until this start: served, late by
            # one round trip to the model process.
            await self.transports.start()
        await self._refresh()
        self._refresher = asyncio.create_task(self._keep_fresh(), name="state")
        log.info("front end %d serving gRPC :%d, HTTP :%d", os.getpid(), self.transports.grpc_port,
                 self.transports.http.port)

    async def refresh(self) -> None:
        """/health and /metrics read the model process's state as it is now (or, if it does not
        answer within STATE_TIMEOUT_S STATE_MISSES times in a row, report it unhealthy: a probe never
        hangs)."""
        if self.service is not None:
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            state, _ = await asyncio.wait_for(self.link.call({"op": "state", "pid": os.getpid()}), STATE_TIMEOUT_S)
            if "error" in state:  # the model process failed to answer (a bug there): a missed answer
                raise RuntimeError(f"state request answered {state}")
            self._missed = 0
        except Exception:  # noqa: BLE001 - no answer, or a broken one
            self._missed += 1
            log.warning("the model process did not answer a state request (%d in a row)", self._missed, exc_info=True)
            if self._missed < STATE_MISSES:  # one late answer from a busy process is not an outage
                return
            state = {**self.state, "healthy": False,
                     "health": {**self.state["health"], "status": "unresponsive"}}
        was = self.healthy
        self.state = state
        if self.healthy != was:
            await self.transports.serving(self.healthy)

    async def _keep_fresh(self) -> None:
        """Also this front end's heartbeat: the model process kills one that stops asking
        (FRONTEND_UNRESPONSIVE_S), so nothing may end this loop but a stop."""
        while True:
            await asyncio.sleep(STATE_EVERY_S)
            try:
                await self._refresh()
            except Exception:  # noqa: BLE001
                log.exception("refreshing the model's state failed")

    async def _watch_model(self) -> None:
        while os.getppid() == self.parent:
            await asyncio.sleep(STATE_EVERY_S)
        self._orphaned()

    def _orphaned(self) -> None:
        """The model process is gone (in a pod it is PID 1 and the container goes with it; not so
        under an init process or anywhere else): fail what waits on it, which would otherwise
        never be answered, and stop."""
        log.error("the model process %d is gone: failing %d requests in flight and stopping", self.parent,
                  self.link.pending)
        self.draining = True
        for m in self.models.values():
            if m.service is not None:
                m.service.draining = True  # refused before any work, as in a graceful stop
        self.link.fail_all(NotReady("the model process of this server is gone; retry on another server"))
        os.kill(os.getpid(), signal.SIGTERM)  # the graceful stop: refuse, drain what is left, exit

    async def stop(self, grace: float) -> None:
        self.draining = True
        await self.transports.stop(grace)  # still asking for the state: draining, not stuck
        for task in (self._refresher, self._watcher):
            if task and task is not asyncio.current_task():
                task.cancel()
        await self.link.close()
        self._executor.shutdown(wait=False)


async def _serve(settings: Settings, path: str) -> None:
    tracing.setup(settings, __version__)  # a request's span is its front end's (the model process stamps it)
    frontend = Frontend(settings, path, late=os.environ.get("EMBEDSERVE_FRONTEND_LATE") == "1")
    try:
        start, stop = await until_stopped(frontend.start())
        if start.done() and start.exception() is not None:
            raise start.exception()
        await stop.wait()
        start.cancel()
        await frontend.stop(settings.shutdown_grace_s)
    finally:
        await asyncio.to_thread(tracing.shutdown)


def main() -> int:
    import sys

    settings = Settings.from_env()  # the model process read it already: no error to report here
    logs.setup(settings, os.environ.get("LOG_LEVEL", "INFO"), process="frontend")
    if settings.gil_switch_interval_ms > 0:
        sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)
    try:
        asyncio.run(_serve(settings, os.environ["EMBEDSERVE_IPC"]))
    except Exception as e:  # noqa: BLE001 - one line in LOG_FORMAT, not Python's traceback print; restarted by the model process
        log.error("front end failed: %s", e, exc_info=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
