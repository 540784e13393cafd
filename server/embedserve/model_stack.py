"""One model of a pod, from its files to its answers: what it is (task, head, labels), its
estimator, its engine (buckets, batch caps measured at its own warm-up, its worker thread, CUDA
graphs, warm-start file) and its service (admission on its own budget, tokenization). A pod
serves one (MODEL_PATH) or several (MODELS) on one device; the transports address each by name
(app.Server.model)."""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import Executor
from typing import Callable

import torch

from embedserve import calibrate
from embedserve.admission import policy as admission
from embedserve.admission.estimator import Estimator
from embedserve.batching.engine import Engine
from embedserve.batching.shaping import Limits
from embedserve.config import Settings, served_model_name, text_tokens
from embedserve.frontends.count import container_cores
from embedserve.model import simulated, warm_key, warm_start
from embedserve.model.declared import Head
from embedserve.model.device import Device
from embedserve.model.encoder import Encoder, Placement, choose_placement
from embedserve.model.worker import WarmupPlan, Watchdog
from embedserve.prepare import Prepared, prepare
from embedserve.service import EmbeddingService
from embedserve.threads import in_daemon_thread
from embedserve.transports import encodings
from embedserve.transports.encodings import Quantization

log = logging.getLogger(__name__)


def policy_from(settings: Settings, window_s: float) -> admission.Policy:
    return admission.Policy(
        reorder_s=window_s if settings.backpressure_throughput else 0.0,  # off: no window (engine: inf)
        horizon_s=settings.reservation_horizon_ms / 1000,
        throughput=settings.backpressure_throughput,
        latency=settings.backpressure_latency,
        max_drain_s=settings.max_drain_time_ms / 1000,
        latency_soft_s=settings.latency_soft_ms / 1000,
        latency_hard_s=settings.latency_hard_ms / 1000,
    )


def attention_field(layout: str, declined: str | None) -> str:
    """/health's attention: the layout served, and why packed rows were not, where they were asked
    for (ATTENTION=auto on a GPU) and cannot serve this model (e.g. a decoder)."""
    return f"{layout} ({declined})" if declined else layout


class ModelStack:
    def __init__(self, settings: Settings, observer, executor: Executor, device: Device | None = None,
                 elsewhere: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0),
                 on_failing: Callable[[bool], None] = lambda f: None, after_batch: Callable[[], None] | None = None,
                 on_hung: Callable[[], None] = lambda: None):
        """`settings`: this model's (model_list.each); `observer`: its metrics (metrics.ModelMetrics);
        `device`: shared with the pod's other models, None for one; `elsewhere`: what they hold of
        it (app.Server._elsewhere); `on_failing`: the pod learns when batches start or stop
        failing; `after_batch`: after each of its batches (default: its own held callers may
        have room); `on_hung`: its batch hung the device."""
        self.settings = settings
        self.name = self.served_name = served_model_name(settings)
        self.model_name = settings.model_path
        self.observer, self.device, self.on_failing, self.on_hung = observer, device, on_failing, on_hung
        self.after_batch = after_batch or self._release_held
        self.estimator = Estimator(latency_window_s=settings.latency_window_s, elsewhere=elsewhere)
        self.service: EmbeddingService | None = None  # what the transports call, once published
        self._service: EmbeddingService | None = None
        self.engine: Engine | None = None
        self.placement: Placement | None = None
        self.task = "embed"
        self.activation = ""  # rerank: the cross-encoder's activation, applied to its logits
        self.labels: list[str] = []
        self.head: Head | None = None  # what the model declares, with the environment's overrides
        self.model_dir = ""
        self.warm_start: warm_start.WarmStart | None = None
        self.quantization = Quantization(settings.quantize_range)  # QUANTIZE_RANGE=calibrated: once loaded
        self.memory_bytes = 0  # its footprint on the device, measured at load (0 on a CPU)
        self._executor = executor

    async def load(self) -> None:
        s = self.settings
        sim_rate = simulated.parse(s.model_path)
        m = await in_daemon_thread(prepare, s, name="prepare")  # download, config, tokenizer, declaration
        self.task, self.labels, self.head, self.model_dir = m.task, m.labels, m.head, m.model_dir
        self.activation = m.activation
        cuda = torch.cuda.is_available() and not sim_rate
        self.placement = choose_placement(s, cuda, cuda and torch.cuda.is_bf16_supported())
        if sim_rate:
            # STATIC_SHAPES=true pads as on a GPU: tests see padding cost simulated device time.
            self.placement = Placement(torch.device("cpu"), torch.float32, False, s.static_shapes == "true")
        tokenizer = m.tokenizer
        plan = WarmupPlan(
            m.buckets, s.max_batch_size, s.max_tokens_per_batch, self.placement.static_shapes,
            s.batch_caps, tokenizer.pad_id, tokenizer.vocab_size,
        )
        placement = self.placement
        self.warm_start = self._warm_start(m, plan, sim_rate)

        def load():
            # Before the first compile: torch.compile's caches beside the warm-up files, only
            # where COMPILE_CACHE=shared says the cache's writers are trusted to run code here.
            # Not with WARM_START=false: nothing of a start is kept for the next.
            os.environ.update(warm_start.compile_cache_env(os.environ, s.model_cache_dir, placement.device.type,
                                                           placement.compile and s.warm_start != "false",
                                                           shared=s.compile_cache == "shared"))
            if sim_rate:
                return simulated.SimulatedAccelerator(sim_rate, vocab_size=tokenizer.vocab_size)
            return Encoder(m.model_dir, s, placement, m.exclude_ids, self.task, m.head, m.sep_id)

        self.engine = Engine(
            plan, load, self.estimator,
            s.deadline_wait_ms / 1000, s.gpu_queue_maxsize,
            s.max_drain_time_ms / 1000 if s.backpressure_throughput else math.inf,  # off: no bound, no window
            lookahead=s.batch_lookahead if s.batch_lookahead is not None else (2 if cuda or sim_rate else 0),
            on_batch=self._batch_ran, on_failing=self.on_failing, on_lost=self._lost,
            watchdog=Watchdog(s.watchdog_multiple, s.watchdog_floor_s), warm=self.warm_start.warm,
            device=self.device,
        )
        await self.engine.start()
        # What this model holds (the models load one at a time): its worker measured it.
        self.memory_bytes = simulated.footprint(s.model_path) if sim_rate else self.engine.worker.footprint
        if m.head and not sim_rate:
            m.head.check_dimension(self.engine.dim)
        if s.long_texts == "window" and self.task != "embed":  # every long_text request would get a 400
            log.warning("LONG_TEXTS=window: a %s server embeds no long texts (windows pool dense vectors: task embed)",
                        self.task)
        if s.quantize_calibrated and self.task in ("embed", "bgem3"):  # before the API: every quantized answer calibrated
            self.quantization = await in_daemon_thread(calibrate.calibrated, s, m, self.engine.dim, sim_rate,
                                                       name="calibrate")
        elif s.quantize_calibrated:
            log.info("QUANTIZE_RANGE=calibrated: a %s server %s", self.task,
                     "quantizes over the fixed range (calibration is an embed model's)" if self.task == "multivector"
                     else "has no int8/uint8 encodings, nothing to calibrate")
        self._service = EmbeddingService(
            self.engine, tokenizer, self.estimator, policy_from(s, self.engine.window_s),
            Limits(s.max_texts_per_request, m.buckets[-1], s.truncate, s.long_texts, text_tokens(s, m.buckets[-1]),
                   encodings.most_rows(s.max_reply_bytes, self.engine.states_dim, encodings.FLOAT, True, extra_per_row=8)),
            executor=self._executor, observer=self.observer, task=self.task, head=None if sim_rate else m.head,
            activation=self.activation,
        )

    def publish(self) -> None:
        """Serve: once every model of the pod has loaded (a model serving while the next warms up
        would disturb that one's measurements; its routes, and the others', come all at once)."""
        self.service = self._service

    def _warm_start(self, m: Prepared, plan: WarmupPlan, sim_rate: float | None) -> warm_start.WarmStart:
        """The warm-up, reused from MODEL_CACHE_DIR when its key matches (WARM_START)."""
        s, placement = self.settings, self.placement

        def key() -> dict:  # on the model worker's thread: it reads the model's files and asks CUDA
            on_cuda = placement.device.type == "cuda"
            device = warm_key.device_name(placement.device.type, warm_key.cuda_device(placement.device) if on_cuda
                                          else "", torch.get_num_threads(), container_cores(), sim_rate)
            return warm_key.server_key(warm_key.revision(m.model_dir), device, warm_key.library_versions(), plan,
                                       placement, m.task, m.head.describe() if m.head else None, m.exclude_ids,
                                       s.trust_remote_code)

        return warm_start.WarmStart(s.model_cache_dir, key, s.warm_start)

    def _batch_ran(self, batch, busy_s: float) -> None:
        self.observer.batch_ran(batch, busy_s)
        self.after_batch()

    def _release_held(self) -> None:
        if self.service:
            self.service.gate.release_held()

    def _lost(self) -> None:
        if self.service:  # callers held for booked room learn now that none will come
            self.service.gate.release_all()
        if self.engine and self.engine.hung:
            self.on_hung()

    @property
    def ready(self) -> bool:
        return bool(self.service and self.service.ready)

    @property
    def model_dimension(self) -> int:
        """Dimensions the model computes (0 until loaded): the most a request's `dimensions` may ask."""
        return self.engine.dim if self.engine else 0

    def dimension(self) -> int:
        """Dimensions served by default (a declared truncate_dim)."""
        if not self.engine:
            return 0
        return self.head.dimension(self.engine.dim) if self.head else self.engine.dim

    def health_fields(self) -> dict:
        """This model's part of /health (app.Server: the pod's fields are its default model's)."""
        snap, snap_time = self.estimator.snapshot(), self.estimator.clock()
        return {
            "queued_tokens": int(snap.queued_tokens),
            "reserved_tokens": int(self.service.gate.book.reserved(snap_time)) if self.service else 0,
            # Refusing without booking, "do not retry": admission.still_sustained.
            "sustained_overload": bool(self.service and self.service.gate.sustained(snap)),
            "service_rate_tokens_per_sec": snap.service_rate,
            "arrival_rate_tokens_per_sec": snap.arrival_rate,
            "estimated_drain_time_ms": min(snap.drain_s, 1e9) * 1000,
            "p95_server_side_latency_ms": snap.p95_latency_s * 1000,
            "gpu_queue_depth": self.engine.in_worker if self.engine else 0,
            "in_flight_requests": self.service.in_flight if self.service else 0,
            "embedding_dimension": self.dimension(),  # served by default (a declared truncate_dim)
            "model_dimension": self.model_dimension,  # the most `dimensions` may ask
            **self.quantization.health(),  # quantize_range, quantize_calibration (the calibration's digest)
            "task": self.task if self.model_dir else "",  # known once the model's files are read
            **(self.head.describe() if self.head else {}),
            "model": self.model_name,
            "device": str(self.placement.device) if self.placement else "",
            "attention": attention_field(self.engine.attention, getattr(self.engine.worker.runner, "declined", None))
            if self.engine and self.engine.warmup else "",
            "warmup": self.warm_start.state if self.warm_start else "",  # measured | reused (model.warm_start)
            "memory_bytes": self.memory_bytes,
        }

    async def stop(self) -> None:
        if self.service:
            self.service.draining = True
        if self.engine:
            await self.engine.stop()

