"""Prometheus exposition: the only module that imports prometheus_client.

Gauges of the shared signal are read from the estimator at scrape time (never a second copy);
counters and histograms are fed through the Observer calls the core makes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from embedserve.model.batches import Batch


class Observed(Protocol):
    """What the shared signal is read from: the model's process (embedserve.app's Server, each of
    its models a model_stack.ModelStack; a front end renders the values the model process sends it)."""

    models: dict
    device: object  # shared by several models (model.device.Device), None for one


disable_created_metrics()  # *_created series double the exposition for no dashboard's use

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
P = "embedfleet_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 32768, 65536, 262144)
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def model_signal(m) -> dict:
    """One model's part of the signal (a model_stack.ModelStack), in its real tokens."""
    snap, now = m.estimator.snapshot(), m.estimator.clock()
    service, engine, placement = m.service, m.engine, m.placement
    info = {}
    if engine and engine.dim:
        head = m.head.describe() if m.head else {}
        info = {"model": m.name, "source": m.model_name, "task": m.task, "device": str(placement.device),
                "dtype": str(placement.dtype).removeprefix("torch."), "dimension": str(m.dimension()),
                "attention": engine.attention,
                **{k: ",".join(v) if isinstance(v, list) else str(v).lower() if isinstance(v, bool) else str(v)
                   for k, v in head.items()}}
    return {
        "model": m.name,
        "service_rate_tokens_per_second": snap.service_rate,
        "arrival_rate_tokens_per_second": snap.arrival_rate,
        "queued_tokens": snap.queued_tokens,
        "reserved_tokens": service.gate.book.reserved(now) if service else 0.0,
        "estimated_drain_seconds": min(snap.drain_s, 1e9),
        "offered_tokens": m.estimator.offered_total,
        "offered_busy_seconds": m.estimator.offered_busy_s,
        # the queue admission lets grow (None: throughput admission off, or not loaded yet)
        "admission_backlog_limit_seconds": service.policy.backlog_limit_s if service and service.policy.throughput else None,
        "memory_bytes": m.memory_bytes,
        "info": info,
    }


def signal(server: Observed) -> dict:
    """The shared signal's values, read from each model's estimator at scrape time (never a second
    copy): per model in its real tokens, and the pod's demand in one unit across models, busy
    seconds of the device per second. Plain values: a front end (FRONTENDS > 1) gets them from the
    model process and renders the same families."""
    models = [model_signal(m) for m in server.models.values()]
    queued = running = 0
    for m in server.models.values():
        q, r = m.service.requests() if m.service else (0, 0)
        queued, running = queued + q, running + r
    runner = next((m.engine.worker.runner for m in server.models.values() if m.engine and m.engine.worker.runner), None)
    return {
        "models": models,
        "queued_requests": queued,
        "running_requests": running,
        "offered_busy_seconds": sum(v["offered_busy_seconds"] for v in models),
        "demand_busy_seconds_per_second": sum(v["arrival_rate_tokens_per_second"] / v["service_rate_tokens_per_second"]
                                              for v in models if v["service_rate_tokens_per_second"] > 0),
        "gpu_memory_bytes": runner.memory() if runner else {},
    }


_MODEL_GAUGES = (  # One unit per model: its real (unpadded) tokens. Padding is the server's own
    # cost and shows as a lower service rate, so offered / service rate is the busy fraction.
    ("service_rate_tokens_per_second", "Capacity: real (unpadded) tokens computed per second of "
     "model-busy time (EMA); arrival / service rate = utilization"),
    ("arrival_rate_tokens_per_second", "EMA of offered real tokens per second, admitted and rejected "
     "(retries not counted again)"),
    ("queued_tokens", "Real tokens admitted and not yet computed"),
    ("reserved_tokens", "Real tokens booked for requests that found no room in the drain budget (held, or told retry-after-ms)"),
    ("estimated_drain_seconds", "Seconds of device time queued ahead of a new request of this model: its "
     "queued_tokens / service_rate, plus the other models' queued device time where several share the device"),
)
# The Gateway API Inference Extension's model-server protocol (TotalQueuedRequests,
# TotalRunningRequests): its endpoint picker is told these names (docs/gateway.md). In requests,
# not tokens, and the pod's totals over its models: the picker's scorers read these.
_POD_GAUGES = (
    ("queued_requests", "Admitted requests not yet answered and none of whose rows is on the device now "
     "(the Inference Extension's TotalQueuedRequests), every model's"),
    ("running_requests", "Requests with rows in the batch on the device now (the Inference Extension's "
     "TotalRunningRequests)"),
    ("demand_busy_seconds_per_second", "The pod's demand in one unit across its models: the sum over them of "
     "arrival rate / service rate (EMA), seconds of device time per second"),
)


def idle_signal(names: list[str]) -> dict:
    """A front end's signal before the model process first answers (FRONTENDS > 1): its models,
    idle, nothing measured yet (as one process reads while it loads)."""
    models = [{"model": name, "service_rate_tokens_per_second": 0.0, "arrival_rate_tokens_per_second": 0.0,
               "queued_tokens": 0, "reserved_tokens": 0.0, "estimated_drain_seconds": 0.0, "offered_tokens": 0.0,
               "offered_busy_seconds": 0.0, "admission_backlog_limit_seconds": None, "memory_bytes": 0, "info": {}}
              for name in names]
    return {"models": models, "queued_requests": 0, "running_requests": 0, "offered_busy_seconds": 0.0,
            "demand_busy_seconds_per_second": 0.0, "gpu_memory_bytes": {}}


class _SignalCollector(Collector):
    def __init__(self, values):
        self.values = values  # () → the signal dict

    def collect(self):
        v = self.values()
        models = v["models"]
        for name, doc in _MODEL_GAUGES:
            family = GaugeMetricFamily(P + name, doc, labels=["model"])
            for m in models:
                family.add_metric([m["model"]], m[name])
            yield family
        # The autoscaler's demand: its rate over any interval is that interval's exact mean, where
        # the arrival-rate gauge is an EMA seen at one instant.
        offered = CounterMetricFamily(P + "offered_tokens", "Real tokens offered, admitted and rejected, each request "
                                      "once (estimated before tokenization)", labels=["model"])
        limit = GaugeMetricFamily(P + "admission_backlog_limit_seconds", "Backlog, in seconds of model-busy time, a "
                                  "request may join at once: MAX_DRAIN_TIME_MS less the batcher's reorder window",
                                  labels=["model"])
        model_memory = GaugeMetricFamily(P + "model_memory_bytes", "Device memory each model holds, measured as it "
                                         "loaded (weights, warm-up, graph pools; 0 on a CPU)", labels=["model"])
        for m in models:
            offered.add_metric([m["model"]], m["offered_tokens"])
            model_memory.add_metric([m["model"]], m["memory_bytes"])
            if m["admission_backlog_limit_seconds"] is not None:  # throughput admission on, model loaded
                limit.add_metric([m["model"]], m["admission_backlog_limit_seconds"])
        yield from (offered, model_memory)
        if limit.samples:  # throughput admission on, a model loaded
            yield limit
        for name, doc in _POD_GAUGES:
            yield GaugeMetricFamily(P + name, doc, value=v[name])
        # The pod's demand in busy seconds: one query scales a pod of five models as one of one.
        yield CounterMetricFamily(P + "offered_busy_seconds", "Seconds of device time offered: each request's "
                                  "estimated tokens / its model's service rate then, summed over the pod's models "
                                  "(rate: demand in busy seconds per second)", value=v["offered_busy_seconds"])
        yield GaugeMetricFamily(P + "capacity_busy_seconds_per_second", "Busy seconds per second the pod can give: 1 "
                                "per device (utilization = rate(offered_busy_seconds) / this)", value=1.0)
        memory = GaugeMetricFamily(P + "gpu_memory_bytes", "Device memory held by the model workers", labels=["type"])
        for kind, value in v["gpu_memory_bytes"].items():
            memory.add_metric([kind], value)
        yield memory
        if any(m["info"] for m in models):
            info = InfoMetricFamily(P + "model", "What this server serves, a series per model", labels=["model"])
            for m in models:
                if m["info"]:
                    info.add_metric([m["model"]], {k: val for k, val in m["info"].items() if k != "model"})
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
        self.requests = Counter(P + "requests", "Finished requests by outcome and model (empty: none resolved, e.g. an "
                                "unknown one)", ["rpc", "code", "model"], registry=r)
        self.rejected_requests = Counter(
            P + "rejected_requests", "Admission refusals by reason: drain_time (told when there is room; booked within the horizon), "
            "sustained (overload the reservation horizon cannot absorb: not booked, told not to retry), latency_soft, "
            "latency_hard", ["reason", "model"], registry=r)
        self.auth_refusals = Counter(P + "auth_refusals", "Calls refused for their API key: missing (no "
                                     "Authorization: Bearer) or invalid (not a key of this server's)", ["reason"], registry=r)
        self.held_requests = Counter(P + "held_requests", "Requests that waited server-side for booked room "
                                     "(callers that send embedfleet-queue: wait)", ["model"], registry=r)
        self.duration = Histogram(P + "request_duration_seconds", "Server-side latency", ["rpc", "model"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(P + "batch_size", "Rows per forward pass", buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram(P + "batch_padded_tokens", "Padded tokens per forward pass", buckets=TOKEN_BUCKETS, registry=r)
        self.tokens = Counter(P + "tokens", "Tokens computed (real vs padded: padding efficiency)", ["kind"], registry=r)
        self.busy = Counter(P + "model_busy_seconds", "Time the device spent running each model's batches (rate = "
                            "utilization; summed over models, the device's)", ["model"], registry=r)
        self.loop_lag = Histogram(P + "event_loop_lag_seconds", "How late each serving process's event loop woke a "
                                  "sleeper (every 25 ms): the time probes and requests waited behind whatever held it",
                                  buckets=LAG_BUCKETS, registry=r)
        self.registry.register(_SignalCollector(values))
        self._finished: dict[tuple[str, str, str], tuple] = {}  # labelled children, looked up once
        self._real, self._padded = self.tokens.labels("real"), self.tokens.labels("padded")

    def request_finished(self, rpc: str, code: str, seconds: float, model: str = "") -> None:
        """`model`: the served model the request was resolved to (a name the server chose: a
        caller's unknown name never becomes a series)."""
        children = self._finished.get((rpc, code, model))
        if children is None:
            children = self._finished[rpc, code, model] = (self.requests.labels(rpc, code, model),
                                                           self.duration.labels(rpc, model))
        children[0].inc()
        children[1].observe(seconds)

    def for_model(self, name: str) -> "ModelMetrics":
        """The core's Observer for one model: its refusals, held callers and batches."""
        return ModelMetrics(self, name)

    def auth_refused(self, reason: str, count: int = 1) -> None:
        """`count` 0: the series exists at 0 (a key check is on), so a rate over it starts at once."""
        self.auth_refusals.labels(reason).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One model's Observer (gate.Observer, and its engine's batches)."""

    def __init__(self, metrics: Metrics, name: str):
        self.metrics, self.name = metrics, name
        self._held = metrics.held_requests.labels(name)
        self._busy = metrics.busy.labels(name)

    def rejected(self, reason: str) -> None:
        self.metrics.rejected_requests.labels(reason, self.name).inc()

    def held(self) -> None:
        self._held.inc()

    def batch_ran(self, batch: "Batch", busy_s: float) -> None:
        m = self.metrics
        m.batch_size.observe(batch.rows)
        m.batch_tokens.observe(batch.padded_tokens)
        m._real.inc(batch.real_tokens)
        m._padded.inc(batch.padded_tokens)
        self._busy.inc(busy_s)
