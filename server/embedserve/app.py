"""Wiring: settings → each model's stack (model_stack: files, estimator, engine, service) on one
device, and the gRPC and HTTP transports; start-up in the right order and graceful shutdown."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from embedserve import metrics, model_list
from embedserve.config import Settings, served_model_name
from embedserve.lifecycle import settle_heap, watch_loop_lag
from embedserve.metrics import Metrics
from embedserve.model.device import Device, ModelsDoNotFit, fits, misfit_message
from embedserve.model_stack import ModelStack
from embedserve.transports.listeners import Transports

log = logging.getLogger(__name__)
STATUS_ORDER = ("healthy", "degraded", "overloaded", "starting")  # a pod of several models: its worst


def out_of_memory(e: BaseException) -> bool:
    """A CUDA allocation that failed, however it surfaced (torch's own error, or a CUDA or cuBLAS
    error string from a capture or a library's start-up)."""
    text = str(e)
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


class Server:
    """The model's process: its models (each a model_stack.ModelStack: estimator, admission,
    engine) on one device. With `listen` (one process, FRONTENDS=1) it also serves gRPC and HTTP:
    the transports come up first (reporting "starting"), then the models. Without, front-end
    processes serve them (embedserve.frontends.door)."""

    def __init__(self, settings: Settings, listen: bool = True):
        self.settings = settings
        self.metrics = Metrics(lambda: metrics.signal(self), os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.started_at = time.monotonic()
        self.draining = False
        self._lag: asyncio.Task | None = None  # the loop-lag probe of a model process with front ends
        self.loaded = asyncio.Event()
        self.loaded_at: float | None = None  # monotonic: from then on front ends get answers (FRONTENDS > 1)
        self._executor = ThreadPoolExecutor(max_workers=settings.tokenization_workers, thread_name_prefix="tokenize")
        each = model_list.each(settings)
        # Several models share the device one batch at a time; one runs as it always has.
        self.device = Device() if len(each) > 1 else None
        self.models: dict[str, ModelStack] = {}
        for model_settings in each:
            name = served_model_name(model_settings)
            self.models[name] = ModelStack(model_settings, self.metrics.for_model(name), self._executor, self.device,
                                           functools.partial(self._elsewhere, name), self._failing,
                                           self._batch_ran, self._device_hung)
        self.default = next(iter(self.models.values()))
        self.transports = Transports(self) if listen else None

    def model(self, name: str | None = None) -> ModelStack:
        """The model a request names (none: the default, the first listed); UnknownModel (404,
        NOT_FOUND) naming the served ones."""
        return model_list.addressed(self.models, name)

    def _elsewhere(self, name: str) -> tuple[float, float]:
        """What the models other than `name` hold of the device: the device seconds they have
        queued (what may run before its next row) and the busy fraction their demand takes."""
        if self.device is None:
            return 0.0, 0.0
        others = [m.estimator for n, m in self.models.items() if n != name]
        # Finite: a model with rows and no rate yet must not make every refusal's moment infinite.
        return min(sum(e.queued_s() for e in others), 1e6), sum(e.busy_fraction() for e in others)

    def _batch_ran(self) -> None:
        """After any model's batch: every model's held callers may have room, and every batcher a
        device free (model.device: idle)."""
        for m in self.models.values():
            if m.service:
                m.service.gate.release_held()
            if m.engine and self.device is not None:
                m.engine.look_soon()

    def _device_hung(self) -> None:
        """One model's batch hung the device they all share: every model's requests fail now."""
        for m in self.models.values():
            if m.engine:
                m.engine.device_lost()

    # The default model's, for what reads one model (a one-model pod's fields, its front ends' hello).
    service = property(lambda self: self.default.service)
    engine = property(lambda self: self.default.engine)
    estimator = property(lambda self: self.default.estimator)
    placement = property(lambda self: self.default.placement)
    task = property(lambda self: self.default.task)
    labels = property(lambda self: self.default.labels)
    head = property(lambda self: self.default.head)
    activation = property(lambda self: self.default.activation)
    quantization = property(lambda self: self.default.quantization)
    served_name = property(lambda self: self.default.served_name)
    model_name = property(lambda self: self.default.model_name)
    model_dimension = property(lambda self: self.default.model_dimension)
    warm_start = property(lambda self: self.default.warm_start)

    async def start(self) -> None:
        if self.transports:
            await self.transports.start()
            log.info("gRPC on :%d, HTTP on :%d; loading %s", self.transports.grpc_port, self.transports.http.port,
                     ", ".join(m.model_name for m in self.models.values()))
        else:  # the model process of front ends: its loop answers them (the transports' probe is theirs)
            self._lag = asyncio.create_task(watch_loop_lag(self.metrics.loop_lag.observe), name="loop-lag")
        await self._load()
        settle_heap()
        self.loaded_at = time.monotonic()
        self.loaded.set()
        if self.transports:
            self.transports.install_api()
            await self.transports.serving(True)
        for m in self.models.values():
            log.info("ready: dimension %d on %s%s", m.engine.dim, m.placement.device,
                     f" (model {m.name})" if len(self.models) > 1 else "")

    async def _load(self) -> None:
        """Each model loads and warms up alone: its warm-up times the device undisturbed, and its
        footprint is what the device's memory grew by. After each, the models so far must fit."""
        footprints: dict[str, int] = {}
        for name, stack in self.models.items():
            try:
                await stack.load()
            except Exception as e:
                limit = self._device_bytes(stack)
                if len(self.models) > 1 and limit and out_of_memory(e):
                    raise ModelsDoNotFit(misfit_message(footprints, limit, failed=name)) from None
                raise
            footprints[name] = stack.memory_bytes
            limit = self._device_bytes(stack)
            if len(self.models) > 1 and not fits(footprints, limit):
                raise ModelsDoNotFit(misfit_message(footprints, limit))
        if len(self.models) > 1:
            log.info("models on the device: %s", ", ".join(f"{n} {b / 2**30:.2f} GiB" for n, b in footprints.items()))
        for stack in self.models.values():
            stack.publish()

    def _device_bytes(self, stack: ModelStack) -> int:
        """The memory the models may fill: DEVICE_MEMORY_BYTES, else the GPU's (0: unbounded)."""
        if self.settings.device_memory_bytes:
            return self.settings.device_memory_bytes
        device = stack.placement.device if stack.placement else None
        return torch.cuda.mem_get_info(device)[1] if device is not None and device.type == "cuda" else 0

    def _failing(self, failing: bool) -> None:
        log.error("failing: reporting NOT_SERVING" if failing else "failing no more: the next batch succeeded")

        if self.transports:  # front ends follow /health's healthy instead
            self._health_task = asyncio.ensure_future(self.transports.serving(self.healthy))

    async def refresh(self) -> None:
        """The model's state is this process's own: always fresh (a front end fetches it)."""

    @property
    def healthy(self) -> bool:
        """What probes see: ready, not draining, and no model failing batch after batch."""
        return self.ready and not self.draining and not any(m.engine and m.engine.failing for m in self.models.values())

    def drain_s(self) -> float:
        """The pod's backlog in seconds of device time, every model's (transports/drain.py)."""
        return sum(m.estimator.queued_s() for m in self.models.values())

    def health_fields(self) -> dict:
        """The default model's fields at the top (a one-model pod's /health as it always was), the
        pod's status, and each model's under `models`."""
        stacks = list(self.models.values())
        statuses = [m.service.status() if m.service else "starting" for m in stacks]
        status = max(statuses, key=STATUS_ORDER.index)
        fields = {
            "status": status,
            "accepting_requests": bool(self.ready and status != "overloaded"),
            **{k: v for k, v in self.default.health_fields().items() if k != "memory_bytes"},
            "uptime_seconds": time.monotonic() - self.started_at,
            "threads": threading.active_count(),
            "asyncio_tasks": len(asyncio.all_tasks()),
        }
        # Each model's own, the memory it holds included (several: the drain above is then the pod's).
        fields["models"] = [{"name": m.name, "status": st, **m.health_fields()} for m, st in zip(stacks, statuses)]
        if len(stacks) > 1:
            fields["estimated_drain_time_ms"] = min(self.drain_s(), 1e9) * 1000
        return fields

    @property
    def ready(self) -> bool:
        return all(m.ready for m in self.models.values())

    async def stop(self, grace: float | None = None) -> None:
        """Graceful: stop admitting (UNAVAILABLE, health NOT_SERVING), let in-flight requests
        finish within the grace period, then stop the model workers."""
        grace = self.settings.shutdown_grace_s if grace is None else grace
        self.draining = True
        if self.transports:
            await self.transports.stop(grace)
        await asyncio.gather(*(m.stop() for m in self.models.values()))  # each worker's stop waits on its own
        if self._lag is not None:
            self._lag.cancel()
        self._executor.shutdown(wait=False)
