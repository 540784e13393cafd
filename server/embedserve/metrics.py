"""Prometheus exposition: the only module that imports prometheus_client.

Gauges of the shared signal are read from the estimator at scrape time (never a second copy);
counters and histograms are fed through the Observer calls the core makes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from embedserve.admission.estimator import Estimator
    from embedserve.batching.engine import Engine
    from embedserve.model.batches import Batch
    from embedserve.model.declared import Head
    from embedserve.model.encoder import Placement
    from embedserve.service import EmbeddingService


class Observed(Protocol):
    """What the shared signal is read from: the model's process (embedserve.app's Server; a front
    end renders the values the model process sends it)."""

    estimator: "Estimator"
    service: "EmbeddingService | None"  # None until ready: its gate's bookings, its policy's backlog limit
    engine: "Engine | None"
    placement: "Placement | None"
    head: "Head | None"
    model_name: str
    task: str  # embed | classify | rerank


disable_created_metrics()  # *_created series double the exposition for no dashboard's use

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
P = "embedfleet_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 32768, 65536, 262144)
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def signal(server: Observed) -> dict:
    """The shared signal's values, in one unit (real tokens), read from the estimator at scrape
    time (never a second copy). Plain values: a front end (FRONTENDS > 1) gets them from the
    model process and renders the same families."""
    snap, now = server.estimator.snapshot(), server.estimator.clock()
    service, engine, placement = server.service, server.engine, server.placement
    runner = engine.worker.runner if engine else None
    queued, running = service.requests() if service else (0, 0)
    info = {}
    if engine and engine.dim:
        head = server.head.describe() if server.head else {}
        info = {"model": server.model_name, "task": server.task, "device": str(placement.device),
                "dtype": str(placement.dtype).removeprefix("torch."), "dimension": str(server.head.dimension(engine.dim) if server.head else engine.dim),
                "attention": engine.attention,
                **{k: ",".join(v) if isinstance(v, list) else str(v).lower() if isinstance(v, bool) else str(v)
                   for k, v in head.items()}}
    return {
        "service_rate_tokens_per_second": snap.service_rate,
        "arrival_rate_tokens_per_second": snap.arrival_rate,
        "queued_tokens": snap.queued_tokens,
        "reserved_tokens": service.gate.book.reserved(now) if service else 0.0,
        "estimated_drain_seconds": min(snap.drain_s, 1e9),
        "offered_tokens": server.estimator.offered_total,
        "queued_requests": queued,
        "running_requests": running,
        # the queue admission lets grow (None: throughput admission off, or not loaded yet)
        "admission_backlog_limit_seconds": service.policy.backlog_limit_s if service and service.policy.throughput else None,
        "gpu_memory_bytes": runner.memory() if runner else {},
        "model": info,
    }


_GAUGES = (  # One unit: real (unpadded) tokens. Padding is the server's own cost and shows as a
    # lower service rate, so offered / service rate is the busy fraction.
    ("service_rate_tokens_per_second", "Capacity: real (unpadded) tokens computed per second of "
     "model-busy time (EMA); arrival / service rate = utilization"),
    ("arrival_rate_tokens_per_second", "EMA of offered real tokens per second, admitted and rejected "
     "(retries not counted again)"),
    ("queued_tokens", "Real tokens admitted and not yet computed"),
    ("reserved_tokens", "Real tokens booked for requests that found no room in the drain budget (held, or told retry-after-ms)"),
    ("estimated_drain_seconds", "Seconds to compute the queue: queued_tokens / service_rate"),
    # The Gateway API Inference Extension's model-server protocol (TotalQueuedRequests,
    # TotalRunningRequests): its endpoint picker is told these names (docs/gateway.md). In
    # requests, not tokens: the tokens above say more, but the picker's scorers read these.
    ("queued_requests", "Admitted requests not yet answered and none of whose rows is on the device now "
     "(the Inference Extension's TotalQueuedRequests)"),
    ("running_requests", "Requests with rows in the batch on the device now (the Inference Extension's "
     "TotalRunningRequests)"),
)


# A front end's signal before the model process first answers (FRONTENDS > 1): idle, unknown model.
IDLE_SIGNAL = {"service_rate_tokens_per_second": 0.0, "arrival_rate_tokens_per_second": 0.0, "queued_tokens": 0,
               "reserved_tokens": 0.0, "estimated_drain_seconds": 0.0, "offered_tokens": 0.0,
               "queued_requests": 0, "running_requests": 0, "admission_backlog_limit_seconds": None,
               "gpu_memory_bytes": {}, "model": {}}


class _SignalCollector(Collector):
    def __init__(self, values):
        self.values = values  # () → the signal dict

    def collect(self):
        v = self.values()
        for name, doc in _GAUGES:
            yield GaugeMetricFamily(P + name, doc, value=v[name])
        # The autoscaler's demand: its rate over any interval is that interval's exact mean, where
        # the arrival-rate gauge is an EMA seen at one instant.
        yield CounterMetricFamily(P + "offered_tokens", "Real tokens offered, admitted and rejected, each request once "
                                  "(estimated before tokenization)", value=v["offered_tokens"])
        if v.get("admission_backlog_limit_seconds") is not None:  # throughput admission on, model loaded
            yield GaugeMetricFamily(P + "admission_backlog_limit_seconds", "Backlog, in seconds of model-busy time, "
                                    "a request may join at once: MAX_DRAIN_TIME_MS less the batcher's reorder window",
                                    value=v["admission_backlog_limit_seconds"])
        memory = GaugeMetricFamily(P + "gpu_memory_bytes", "Device memory held by the model worker", labels=["type"])
        for kind, value in v["gpu_memory_bytes"].items():
            memory.add_metric([kind], value)
        yield memory
        if v["model"]:
            info = InfoMetricFamily(P + "model", "What this server serves")
            info.add_metric([], v["model"])
            yield info


class Metrics:
    """Implements the core's Observer; `render()` is the /metrics body."""

    def __init__(self, values, multiprocess_dir: str | None = None):
        """`values`: () → the signal dict (`signal(server)`, or a front end's copy of it).
        `multiprocess_dir` (FRONTENDS > 1): counters and histograms live in files every process
        of the pod writes, and /metrics (in any front end) renders their sum."""
        self.registry = CollectorRegistry()
        r = None if multiprocess_dir else self.registry
        if multiprocess_dir:
            from prometheus_client import multiprocess

            multiprocess.MultiProcessCollector(self.registry, path=multiprocess_dir)
        self.requests = Counter(P + "requests", "Finished requests by outcome", ["rpc", "code"], registry=r)
        self.rejected_requests = Counter(
            P + "rejected_requests", "Admission refusals by reason: drain_time (told when there is room; booked within the horizon), "
            "sustained (overload the reservation horizon cannot absorb: not booked, told not to retry), latency_soft, "
            "latency_hard", ["reason"], registry=r)
        self.auth_refusals = Counter(P + "auth_refusals", "Calls refused for their API key: missing (no "
                                     "Authorization: Bearer) or invalid (not a key of this server's)", ["reason"], registry=r)
        self.held_requests = Counter(P + "held_requests", "Requests that waited server-side for booked room "
                                     "(callers that send embedfleet-queue: wait)", registry=r)
        self.duration = Histogram(P + "request_duration_seconds", "Server-side latency", ["rpc"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(P + "batch_size", "Rows per forward pass", buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram(P + "batch_padded_tokens", "Padded tokens per forward pass", buckets=TOKEN_BUCKETS, registry=r)
        self.tokens = Counter(P + "tokens", "Tokens computed (real vs padded: padding efficiency)", ["kind"], registry=r)
        self.busy = Counter(P + "model_busy_seconds", "Time the model worker spent running batches (rate = utilization)", registry=r)
        self.loop_lag = Histogram(P + "event_loop_lag_seconds", "How late each serving process's event loop woke a "
                                  "sleeper (every 25 ms): the time probes and requests waited behind whatever held it",
                                  buckets=LAG_BUCKETS, registry=r)
        self.registry.register(_SignalCollector(values))
        self._finished: dict[tuple[str, str], tuple] = {}  # labelled children, looked up once
        self._real, self._padded = self.tokens.labels("real"), self.tokens.labels("padded")

    def request_finished(self, rpc: str, code: str, seconds: float) -> None:
        children = self._finished.get((rpc, code))
        if children is None:
            children = self._finished[rpc, code] = (self.requests.labels(rpc, code), self.duration.labels(rpc))
        children[0].inc()
        children[1].observe(seconds)

    def rejected(self, reason: str) -> None:
        self.rejected_requests.labels(reason).inc()

    def auth_refused(self, reason: str, count: int = 1) -> None:
        """`count` 0: the series exists at 0 (a key check is on), so a rate over it starts at once."""
        self.auth_refusals.labels(reason).inc(count)

    def held(self) -> None:
        self.held_requests.inc()

    def batch_ran(self, batch: "Batch", busy_s: float) -> None:
        self.batch_size.observe(batch.rows)
        self.batch_tokens.observe(batch.padded_tokens)
        self._real.inc(batch.real_tokens)
        self._padded.inc(batch.padded_tokens)
        self.busy.inc(busy_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
