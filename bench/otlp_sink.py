"""`python -m bench.otlp_sink [PORT]`: an OTLP/HTTP trace receiver on loopback, what a collector's
port 4318 does for traces: POST /v1/traces, an ExportTraceServiceRequest (protobuf, gzip or
not) in, an empty ExportTraceServiceResponse out. It decodes every request and keeps the spans
(`Sink.spans`, for the tests), or only counts the exports and their bytes (`keep=False`, a bench's:
decoding would cost the machine's CPU beside the server it measures).

To measure a server with tracing on (bench.host_path's `--server-env`):
    python -m bench.otlp_sink 4318 &
    python -m bench.host_path --server-env OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318
The sink prints what it received when stopped (SIGTERM or Ctrl-C)."""

from __future__ import annotations

import gzip
import http.server
import signal
import sys
import threading
import time
import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """One received span, its ids as hex (as W3C traceparent writes them)."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 2 SERVER, 1 INTERNAL
    start_ns: int
    end_ns: int
    attributes: dict
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    resource: dict

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[Span]:
    """An ExportTraceServiceRequest's spans."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                                s.start_time_unix_nano, s.end_time_unix_nano, _attributes(s.attributes),
                                s.status.code, s.status.message, resource))
    return out


class Sink:
    """The receiver, on 127.0.0.1:`port` (0: any free port), in a thread of its own."""

    def __init__(self, port: int = 0, keep: bool = True):
        self.spans: list[Span] = []
        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode(body) if keep else []  # a bench's sink only counts (decoding costs its CPU)
                with sink._lock:
                    sink.requests += 1
                    sink.bytes += len(body)
                    sink.spans.extend(spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")  # an empty ExportTraceServiceResponse: all accepted
                self.end_headers()

            def log_message(self, *args):  # quiet
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_ENDPOINT says (the exporter adds /v1/traces)."""
        return f"http://127.0.0.1:{self.port}"

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, condition, timeout_s: float = 30.0, what: str = "spans"):
        """Poll until `condition(self)` returns something true; → it (TimeoutError past the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = condition(self)
            if found:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s} s; received {len(self.spans)} spans: "
                                   f"{sorted({s.name for s in self.spans})}")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def main() -> int:
    sink = Sink(int(sys.argv[1]) if len(sys.argv) > 1 else 4318, keep=False)
    print(f"OTLP/HTTP sink on {sink.endpoint}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a shell's background job ignores SIGINT
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    sink.stop()
    print(f"{sink.requests} exports, {sink.bytes / 1e6:.1f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
