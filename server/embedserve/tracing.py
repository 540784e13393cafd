"""OpenTelemetry traces: each request a SERVER span continuing the caller's W3C `traceparent`
(HTTP header, gRPC metadata), with a child span per stage it passed: admission, tokenization,
queue wait, each batch it rode in, the answer.

Recorded cheaply, emitted late: a traced request carries a Recorder (gate.Caller.trace, then
queues.PendingRequest.trace) that each stage stamps with time.monotonic() and a few facts as the
request passes; the child spans are made from those stamps once the request has ended, with
explicit start and end times. No stage imports OpenTelemetry, or this module: they only call the
Recorder they are handed, when there is one. With FRONTENDS > 1 the request span lives in the
front end and admission, queue and batches happen in the model process: that process stamps a
Recorder of its own for a request that asks (the `trace` flag of its IPC header) and sends the
stamps back with the answer (Recorder.to_wire, merge). time.monotonic() is CLOCK_MONOTONIC, one
clock for every process on a host, so the two processes' stamps compare directly.

Off (no OTLP endpoint: config.Settings.tracing), `tracer` stays None: nothing here imports
OpenTelemetry, no Recorder is made, and what a request pays is a check of `caller.trace` or
`request.trace` against None where a stage would stamp.

Trace ids for log lines: `trace_id` (a traced request's span), else `traceparent_trace_id` (the
caller's header, read only on a refused or failed request).

The caller's side: `injector` (embedserve.client) is what writes the caller's current context
into a call's metadata, with the OpenTelemetry API alone."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

log = logging.getLogger(__name__)

tracer = None  # the SDK's Tracer once setup() ran with tracing on; None: off
_sdk = None  # what begin and finish use of OpenTelemetry, bound once by setup (_Sdk)
_epoch_offset_ns = 0  # time.time_ns() - time.monotonic_ns(), taken once at setup
SCOPE_KEY = "embedfleet.trace"  # where an HTTP request's Recorder waits for its route (ASGI scope)
REASON_CHARS = 512  # a span's status description, a log line's reason: bounded, whatever a message echoes


class _Sdk:
    """The OpenTelemetry pieces a request's spans are made with, imported only by setup()."""

    def __init__(self, provider, processor, propagator, scope):
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

        self.provider, self.processor, self.propagator, self.scope = provider, processor, propagator, scope
        self.ReadableSpan, self.SpanContext, self.SERVER, self.INTERNAL = ReadableSpan, SpanContext, SpanKind.SERVER, SpanKind.INTERNAL
        self.Status, self.ERROR, self.UNSET = Status, StatusCode.ERROR, Status(StatusCode.UNSET)
        self.ERROR_STATUS = Status(StatusCode.ERROR)


def setup(settings, service_version: str = "") -> bool:
    """Start exporting spans when the settings say tracing is on (an OTLP endpoint is set):
    the SDK's TracerProvider, its OTEL_* variables (service name, resource attributes, sampler,
    batch processor, exporter headers, timeout, compression) as the SDK reads them, and the
    OTLP/HTTP protobuf exporter. → whether tracing is on."""
    global tracer, _sdk, _epoch_offset_ns
    if not settings.tracing:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import (SERVICE_INSTANCE_ID, SERVICE_NAME, SERVICE_VERSION, OTELResourceDetector,
                                             Resource)
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    class HashedOnce(Resource):
        """The SDK's Resource, its hash computed once: the OTLP encoder hashes every span's
        resource, and Resource hashes by json.dumps of its attributes each time (~30% of the
        exporting thread's time, all of it holding the GIL the event loop needs)."""

        def __init__(self, resource: Resource):
            super().__init__(resource.attributes, resource.schema_url)
            self._hash = super().__hash__()

        def __hash__(self) -> int:
            return self._hash

    resource = Resource.create({SERVICE_VERSION: service_version} if service_version else {})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):  # OTEL_SERVICE_NAME unset
        resource = resource.merge(Resource({SERVICE_NAME: "embedserve"}))
    if SERVICE_INSTANCE_ID not in OTELResourceDetector().detect().attributes:  # OTEL_RESOURCE_ATTRIBUTES
        # The host name: in Kubernetes the pod's name, so a trace names the replica that served it
        # (the SDK's default is a random id per process: front ends of one pod would differ).
        resource = resource.merge(Resource({SERVICE_INSTANCE_ID: socket.gethostname()}))
    resource = HashedOnce(resource)
    # Sampler: OTEL_TRACES_SAMPLER (parent-based, always on). Not shut down at exit by the SDK
    # (up to 30 s against a collector that does not answer): `shutdown` flushes, bounded.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    exporter = OTLPSpanExporter()
    # Exports run on the processor's own thread, in batches (OTEL_BSP_*): a request never waits
    # for the collector, and a full queue drops spans rather than growing.
    processor = BatchSpanProcessor(exporter)
    provider.add_span_processor(processor)
    _epoch_offset_ns = time.time_ns() - time.monotonic_ns()
    tracer = provider.get_tracer("embedserve", service_version or None)
    _sdk = _Sdk(provider, processor, TraceContextTextMapPropagator(), InstrumentationScope("embedserve", service_version or None))
    log.info("tracing: spans to %s as %s", getattr(exporter, "_endpoint", "the OTLP endpoint"),
             resource.attributes.get(SERVICE_NAME))
    return True


FLUSH_S = 2.0  # the most a graceful stop waits for queued spans to be exported


def shutdown(timeout_s: float = FLUSH_S) -> None:
    """At a graceful stop: export what is still queued, waiting at most `timeout_s` (a collector
    that does not answer must not hold the pod's exit; the exporting thread is a daemon)."""
    global tracer
    if _sdk is None:
        return
    tracer = None
    # The SDK's flush ignores its timeout (it waits out the export's retries): waited for on a
    # daemon thread, bounded here.
    flusher = threading.Thread(target=_sdk.provider.force_flush, name="otel-flush", daemon=True)
    flusher.start()
    flusher.join(timeout_s)
    if flusher.is_alive():
        log.warning("tracing: spans not exported within %.0f s of the stop are dropped", timeout_s)


def _ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _epoch_offset_ns


class Recorder:
    """One traced request's moments (time.monotonic() seconds) and facts, stamped by each stage
    as it passes; spans are made from them once the request ends (`finish`)."""

    __slots__ = ("span", "started", "admission", "decision", "booked_ms", "tokenization", "queued", "batches",
                 "result")

    def __init__(self, span=None, started: float = 0.0):
        self.span = span  # the request's span; None in the model process (it is the front end's)
        self.started = started
        self.admission: list[float] | None = None  # [start, end]; no end: refused (or still held when it ended)
        self.decision = ""  # admission's: "" (admitted), "held", "claimed" (a retry at its booked moment)
        self.booked_ms: float | None = None  # the room booked for it (held, or told retry-after)
        self.tokenization: tuple | None = None  # (start, end, requests tokenized in the same call, waited_s)
        self.queued: float | None = None  # when its rows joined the bucket queues
        self.batches: list[list] = []  # [id, rows, real tokens, padded tokens, formed, device start, device s, delivered, its rows]
        self.result: float | None = None  # when its rows were back where the transport answers

    # -- stamped by the stages (admission, batching, service, front end)

    def admitting(self) -> None:
        self.admission = [time.monotonic()]

    def admitted(self) -> None:
        self.admission.append(time.monotonic())

    def tokenized(self, start: float, requests: int = 1, waited_s: float = 0.0) -> None:
        self.tokenization = (start, time.monotonic(), requests, waited_s)

    def queued_now(self) -> None:
        self.queued = time.monotonic()

    def batch_ran(self, batch, rows: int, device_s: float) -> None:
        """A batch holding `rows` of this request's rows ran (once per batch: a packed batch may
        route several of its chunks)."""
        if self.batches and self.batches[-1][0] == batch.id:
            self.batches[-1][8] += rows
            return
        self.batches.append([batch.id, batch.rows, batch.real_tokens, batch.padded_tokens, batch.formed, batch.started,
                             device_s, time.monotonic(), rows])

    def answered(self) -> None:
        self.result = time.monotonic()

    # -- across the IPC link (FRONTENDS > 1): the model process's stamps

    def to_wire(self) -> dict:
        admission, decision = self.admission, self.decision
        if admission is not None and len(admission) == 1:  # refused (or cancelled while held): ended now
            admission, decision = [admission[0], time.monotonic()], decision or "refused"
        return {"admission": admission, "decision": decision, "booked_ms": self.booked_ms,
                "queued": self.queued, "batches": self.batches}

    def merge(self, wire: dict) -> None:
        self.admission, self.decision, self.booked_ms = wire["admission"], wire["decision"], wire["booked_ms"]
        self.queued, self.batches = wire["queued"], wire["batches"]


def stages(rec: Recorder, end: float) -> list[tuple[str, float, float, dict, bool]]:
    """A request's child spans from its Recorder: (name, start, end, attributes, error). Pure."""
    out = []
    if rec.admission is not None:
        shut = len(rec.admission) == 1  # refused (or cancelled while held): ended with the request
        start, stop = rec.admission[0], end if shut else rec.admission[1]
        decision = rec.decision or ("refused" if shut else "admitted")
        attrs = {"embedfleet.admission.decision": decision,
                 "embedfleet.admission.held_ms": (stop - start) * 1000 if decision == "held" else 0.0}
        if rec.booked_ms is not None:
            attrs["embedfleet.admission.booked_ms"] = rec.booked_ms
        # A refusal is the caller's outcome, not an error (outcomes._outcome): said by `decision`.
        out.append(("admission", start, stop, attrs, False))
    if rec.tokenization is not None:
        start, stop, requests, waited_s = rec.tokenization
        out.append(("tokenization", start, stop, {"embedfleet.tokenization.requests": requests,
                                                  "embedfleet.tokenization.waited_ms": waited_s * 1000}, False))
    if rec.queued is not None:
        taken = min((b[4] for b in rec.batches), default=end)
        out.append(("queue wait", rec.queued, max(rec.queued, taken), {}, False))
    for batch_id, rows, real, padded, formed, started, device_s, delivered, mine in rec.batches:
        out.append(("batch", formed, delivered, {
            "embedfleet.batch.id": batch_id, "embedfleet.batch.rows": rows, "embedfleet.batch.real_tokens": real,
            "embedfleet.batch.padded_tokens": padded, "embedfleet.batch.device_ms": device_s * 1000,
            "embedfleet.batch.waited_ms": max(0.0, started - formed) * 1000, "embedfleet.batch.request_rows": mine,
        }, False))
    if rec.result is not None:
        out.append(("answer", rec.result, end, {}, False))
    return out


def begin(name: str, carrier, attributes: dict) -> Recorder | None:
    """The request span, started now under the caller's context (`carrier`: anything with
    .get("traceparent"), e.g. HTTP headers, or a dict of gRPC metadata), and the Recorder its
    stages stamp; None when the sampler (OTEL_TRACES_SAMPLER; by default the caller's sampled
    flag) leaves it out: it then costs nothing more."""
    started = time.monotonic()
    span = tracer.start_span(name, context=_sdk.propagator.extract(carrier), kind=_sdk.SERVER,
                             attributes=attributes, start_time=_ns(started))
    if not span.is_recording():
        return None
    return Recorder(span, started)


def finish(rec: Recorder, attributes: dict, error: str | None) -> None:
    """End the request span (with its outcome's `attributes`; `error`: why it was refused or
    failed, None when served) and emit its children from the stamps.

    The children are handed to the span processor finished (ReadableSpan, as a span's end
    hands it), not started and ended through the Tracer: their times are known only now, their
    sampling is their parent's (recorded, or there would be no Recorder), and the Tracer's
    path per span (sampler, attribute checks, locks) tripled what tracing cost the event loop
    (measured: ~160 against ~50 us per request of six spans)."""
    sdk, end = _sdk, time.monotonic()
    span = rec.span
    parent = span.get_span_context()
    new_id = sdk.provider.id_generator.generate_span_id
    for name, start, stop, attrs, failed in stages(rec, end):
        context = sdk.SpanContext(parent.trace_id, new_id(), False, parent.trace_flags, parent.trace_state)
        sdk.processor.on_end(sdk.ReadableSpan(
            name, context, parent, span.resource, attrs, kind=sdk.INTERNAL, instrumentation_scope=sdk.scope,
            status=sdk.ERROR_STATUS if failed else sdk.UNSET, start_time=_ns(start), end_time=_ns(max(start, stop))))
    span.set_attributes(attributes)
    if error is not None:
        span.set_status(sdk.Status(sdk.ERROR, error[:REASON_CHARS]))
    span.end(end_time=_ns(end))


def trace_id(rec: Recorder | None) -> str:
    """The trace id (32 hex digits) of a traced request; "" when it is not traced."""
    if rec is None or rec.span is None:
        return ""
    return format(rec.span.get_span_context().trace_id, "032x")


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


def traceparent_trace_id(header: str | None) -> str:
    """The trace id of a W3C traceparent header ("" when absent or malformed, or all zeros, which
    W3C says is invalid). For the log line of a request not traced here."""
    if not header:
        return ""
    m = _TRACEPARENT.match(header.strip().lower())
    if m is None or m.group(1) == "0" * 32:
        return ""
    return m.group(1)


_inject = None  # opentelemetry.propagate.inject once looked up; False: not to be used (not installed, or broken)


def injector():
    """The caller's side (embedserve.client): OpenTelemetry's `propagate.inject`, which writes the
    current context (the caller's span) into a carrier as its propagators do (W3C `traceparent`,
    `tracestate`, `baggage` by default; OTEL_PROPAGATORS), so the server's span continues the
    caller's trace. The API only (opentelemetry-api; no SDK, no exporter). Looked up once per
    process, by the first Client made (importing it loads the propagators: not on a call's
    path). None: not installed, or its propagators fail to load (a bad OTEL_PROPAGATORS raises
    at import): one warning, and no Client sends a trace context."""
    global _inject
    if _inject is None:
        try:
            from opentelemetry.propagate import inject
        except ImportError:
            inject = False
        except Exception as e:  # noqa: BLE001 - a misconfigured OTEL_PROPAGATORS must not fail every call
            log.warning("trace context: not sent by embedserve.client: the OpenTelemetry API's propagators do not "
                        "load (%s: %s); check OTEL_PROPAGATORS", type(e).__name__, e)
            inject = False
        _inject = inject
    return _inject or None
