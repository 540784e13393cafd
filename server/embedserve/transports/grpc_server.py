"""gRPC transport: embedfleet.v1.Inference, grpc.health.v1 and server reflection."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve import logs, tracing
from embedserve.errors import InvalidInput, ModelFailure, NotReady, Overloaded, ReplyTooLarge, UnknownModel, WrongTask
from embedserve.admission.gate import Caller
from embedserve.transports import addresses, drain, encodings, grpc_budget, m3_reply, multivector_wire, outcomes

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
_HEALTH_FIELDS = set(pb.HealthCheckResponse.DESCRIPTOR.fields_by_name)


def is_retry(metadata) -> bool:
    """Our client sends embedfleet-attempt=N (N>1 on retries); gRPC's own retry sends
    grpc-previous-rpc-attempts."""
    for key, value in metadata or ():
        if key == "embedfleet-attempt" and value not in ("", "0", "1"):
            return True
        if key == "grpc-previous-rpc-attempts" and value not in ("", "0"):
            return True
    return False


def caller(context, trace: tracing.Recorder | None = None) -> Caller:
    metadata = tuple(context.invocation_metadata() or ())
    return Caller(is_retry(metadata), context.time_remaining(), ("embedfleet-queue", "wait") in metadata, trace,
                  hedge=("embedfleet-hedge", "1") in metadata)


_STATUS = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (ModelFailure, grpc.StatusCode.INTERNAL),
    (WrongTask, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownModel, grpc.StatusCode.NOT_FOUND),
)


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, get_model: Callable, health_fields: Callable[[], dict], observe: Callable[..., None],
                 drain_s: Callable[[], float] = lambda: 0.0, max_reply_bytes: int = 64 * 2**20):
        """`get_model(name)`: the hub's model of that name (empty: the default; hub.Hub.model),
        its service None until start-up has built it."""
        self._model = get_model
        self._drain_s = drain_s  # the pod's backlog in seconds of device time, as it is now (drain.py)
        self._health_fields = health_fields
        self._observe = observe
        self._max_reply_bytes = max_reply_bytes  # MAX_REPLY_BYTES

    async def Embed(self, request, context):
        truncate = request.truncate if request.HasField("truncate") else None
        return await self._call(
            "Embed", request, context,
            lambda s, who: s.embed_texts(request.texts, who, truncate, prompt_name=request.prompt_name or None,
                                         long_text=request.long_text, outputs=m3_reply.wanted(request.outputs, s.task)),
            lambda m: self._embedding(request, m, len(request.texts), m3_reply.wanted(request.outputs, m.task)),
        )

    async def Infer(self, request, context):
        return await self._call(
            "Infer", request, context,
            lambda s, who: s.infer(request.input_ids, request.attention_mask, request.shape, who),
            lambda m: self._embedding(request, m, request.shape[0] if len(request.shape) == 2 else 0),
        )

    async def EmbedSparse(self, request, context):
        def run(s, who):
            if request.dimensions or request.encoding != pb.FLOAT:
                raise InvalidInput("dimensions and encoding do not apply to EmbedSparse (sparse rows over the vocabulary)")
            return s.embed_sparse(request.texts, who, request.truncate if request.HasField("truncate") else None,
                                  prompt_name=request.prompt_name or None, long_text=request.long_text)

        return await self._call("EmbedSparse", request, context, run, lambda m: self._sparse_response, task="sparse")

    async def EmbedMultiVector(self, request, context):
        """A multi-vector (ColBERT) model's token vectors, of queries or documents (is_query)."""
        truncate = request.truncate if request.HasField("truncate") else None

        def respond(model):
            encoding = _encoding(request.encoding)
            multivector_wire.check_encoding(encoding, json_text=False)
            normalized = bool(model.service.head and model.service.head.normalize)
            return lambda rows: multivector_wire.multivector_response(rows, encoding, model.quantization, normalized,
                                                                      self._max_reply_bytes)

        return await self._call(
            "EmbedMultiVector", request, context,
            lambda s, who: s.embed_multivector(request.texts, request.is_query, who, truncate), respond,
            task="multivector")

    async def Rerank(self, request, context):
        truncate = request.truncate if request.HasField("truncate") else None
        return await self._call(
            "Rerank", request, context,
            lambda s, who: s.rerank(request.query, request.texts, who, truncate, request.raw_scores),
            lambda m: lambda out: pb.RerankResponse(scores=out.tolist()), task="rerank",
        )

    async def Quantization(self, request, context):
        """The int8/uint8 ranges for vectors of `dimensions` (HTTP GET /quantization's): no model
        time, no admission."""
        t0, code, name = time.perf_counter(), grpc.StatusCode.OK, ""
        try:
            model = self._model(request.model)
            name, service = model.served_name, model.service
            if service is None:
                raise NotReady("server is warming up")
            service.require_task("embed")
            head, model_dim = service.head, model.model_dimension
            encodings.check_dimensions(request.dimensions, model_dim)
            dims = encodings.output_dimensions(request.dimensions, head.truncate_dim if head else None, model_dim)
            normalized = request.normalized if request.HasField("normalized") else bool(head.normalize if head else True)
            q = model.quantization
            ranges = q.ranges(dims, normalized)
        except (InvalidInput, NotReady, WrongTask, UnknownModel) as e:
            code = next(c for t, c in _STATUS if isinstance(e, t))
            context.set_trailing_metadata(self._drain())
            await context.abort(code, str(e))
        finally:
            self._observe("Quantization", code.name, time.perf_counter() - t0, name)
        context.set_trailing_metadata(self._drain())
        return pb.QuantizationResponse(quantize_range=q.health()["quantize_range"], calibration=q.digest,
                                       dimensions=dims, normalized=normalized,
                                       ranges=ranges.astype("<f4", copy=False).tobytes())

    async def HealthCheck(self, request, context):
        fields = self._health_fields()
        if request.model:  # that model's fields, the pod's status
            try:
                name = self._model(request.model).served_name
            except UnknownModel as e:
                context.set_trailing_metadata(self._drain())
                await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            fields = {**fields, **next((m for m in fields.get("models", ()) if m["name"] == name), {}),
                      "status": fields["status"]}
        context.set_trailing_metadata(self._drain())
        return pb.HealthCheckResponse(**{k: v for k, v in fields.items() if k in _HEALTH_FIELDS and k != "models"},
                                      models=[m["name"] for m in fields.get("models", ())])

    async def _call(self, rpc: str, request, context, run, respond, task: str = "embed"):
        """`run(service, caller)` → the rows; `respond(model)` checks what the request asks of
        them before any work, and → how they become the response."""
        t0 = time.perf_counter()
        code, name = grpc.StatusCode.OK, ""
        reason, bug = "", False  # the message a refusal or failure answers with (its log line, its span)
        trace = outcomes.grpc_begin(SERVICE_NAME, rpc, context.invocation_metadata()) \
            if tracing.tracer is not None else None
        try:
            model = self._model(request.model)
            name, service = model.served_name, model.service
            if service is None:
                raise NotReady("server is warming up")
            service.require_task(task)
            finish = respond(model)
            out = (await run(service, caller(context, trace))).rows
            context.set_trailing_metadata((("embedfleet-server-ms", f"{(time.perf_counter() - t0) * 1000:.3f}"),
                                           *self._drain()))
            return finish(out)
        except tuple(e for e, _ in _STATUS) as e:
            code, reason = next(c for t, c in _STATUS if isinstance(e, t)), str(e)
            if isinstance(e, Overloaded):
                # Ours, and gRPC's standard server pushback: a channel whose retry policy covers
                # RESOURCE_EXHAUSTED retries by itself at the booked moment. Sustained overload
                # sends a negative pushback: gRPC's (and our Client's) "do not retry".
                pushback = "-1" if e.final else str(e.retry_after_ms)
                context.set_trailing_metadata((("retry-after-ms", str(e.retry_after_ms)),
                                               ("grpc-retry-pushback-ms", pushback), *self._drain()))
            else:
                context.set_trailing_metadata(self._drain())
            await context.abort(code, str(e))
        except asyncio.CancelledError:
            code, reason = grpc.StatusCode.CANCELLED, "cancelled by the caller"
            raise
        except Exception as e:
            code, reason, bug = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}", True
            context.set_trailing_metadata(self._drain())
            raise
        finally:
            elapsed = time.perf_counter() - t0
            self._observe(rpc, code.name, elapsed, name)
            if trace is not None or code is not grpc.StatusCode.OK or logs.access:
                outcomes.grpc_end(rpc, code, elapsed, reason, trace, context.invocation_metadata(), bug)

    def _drain(self) -> tuple[tuple[str, str], ...]:
        """The pod's backlog as the answer leaves, for the caller's balancing (drain.py)."""
        return ((drain.HEADER, drain.drain_ms(self._drain_s())),)

    def _embedding(self, request, model, rows: int, asked: tuple[str, ...] = ("dense",)) -> Callable:
        """Embed's and Infer's rows → response; the encoding, the dimensions and the answer's size
        (MAX_REPLY_BYTES) refused before any work. `asked`: a bgem3 model's outputs (m3_reply)."""
        encoding = _encoding(request.encoding)
        model_dim, head = model.model_dimension, model.service.head
        encodings.check_dimensions(request.dimensions, model_dim)
        if model_dim:
            dims = encodings.output_dimensions(request.dimensions, head.truncate_dim if head else None, model_dim)
            encodings.check_reply(rows, dims, encoding, False, self._max_reply_bytes)
        return m3_reply.grpc_finish(asked, lambda out: self._response(out, head, request.dimensions, encoding,
                                                                      model.quantization),
                                    encoding, model.quantization, self._max_reply_bytes)

    def _sparse_response(self, rows) -> pb.EmbedSparseResponse:
        """The sparse rows, once their size is known: within MAX_REPLY_BYTES, else refused."""
        size = 8 * len(rows.values) + 10 * len(rows.offsets) + 64
        if size > self._max_reply_bytes:
            raise ReplyTooLarge(f"the answer's {len(rows.values)} non-zero entries would be {size} bytes, over "
                                f"MAX_REPLY_BYTES={self._max_reply_bytes}: send fewer texts")
        return sparse_response(rows)

    def _response(self, out, head, dimensions: int, encoding: str, quantization) -> pb.EmbedResponse:
        """The rows cut to `dimensions` (re-normalized where the model normalizes), as float32 in
        `embeddings` or, quantized, in `quantized`; `shape` is [rows, dimensions] either way."""
        dims = encodings.output_dimensions(dimensions, head.truncate_dim if head else None, out.shape[1])
        out = encodings.truncated(out, dims, bool(head and head.normalize))
        if encoding == encodings.FLOAT:
            return pb.EmbedResponse(embeddings=out.astype("<f4", copy=False).tobytes(), shape=out.shape)
        quantized = encodings.quantize(out, encoding, quantization, bool(head and head.normalize))
        return pb.EmbedResponse(quantized=quantized.tobytes(), shape=out.shape, encoding=pb.Encoding.Value(encoding.upper()))


def _encoding(value: int) -> str:
    """The proto's Encoding as encodings names it (an open enum: any int can arrive)."""
    if value not in pb.Encoding.values():
        names = ", ".join(pb.Encoding.keys())
        raise InvalidInput(f"encoding={value} is not an Encoding ({names})")
    return pb.Encoding.Name(value).lower()


def sparse_response(rows) -> pb.EmbedSparseResponse:
    """SparseRows (embedserve.model.sparse_rows) → EmbedSparseResponse: the same CSR arrays, as bytes."""
    return pb.EmbedSparseResponse(indices=rows.indices.astype("<i4", copy=False).tobytes(),
                                  values=rows.values.astype("<f4", copy=False).tobytes(),
                                  offsets=rows.offsets.tolist(), dimension=rows.dim)


# The most often a client may ping. One second is gRPC core's own floor for a client's pings, so
# no gRPC client's keepalive (ours: every 5 s on a silent connection) is refused; a faster flood
# still earns GOAWAY after gRPC's default 2 strikes.
MIN_PING_INTERVAL_MS = 1000


def build_server(servicer: InferenceServicer, host: str, port: int, max_message_bytes: int,
                 max_connection_age_s: float = 0.0, max_connection_age_grace_s: float = 15.0,
                 reuse_port: bool = False, interceptors=None, credentials: grpc.ServerCredentials | None = None,
                 max_reply_bytes: int = 64 * 2**20, max_concurrent: int = 1024, max_fields: int = 576):
    """→ (server, health servicer, bound port). Health starts NOT_SERVING. `reuse_port`: front
    ends share the port (one process alone must not: a second server on it would be an error).
    `interceptors`: the API key's check (auth.py), only when keys are configured; `credentials`:
    TLS only on the port (tls.py), else plain. `max_concurrent` (MAX_CONCURRENT_REQUESTS): calls
    in progress at once past which gRPC answers RESOURCE_EXHAUSTED, and streams one connection
    may open; `max_fields`: a request's top-level fields (grpc_budget.py)."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_reply_bytes),  # MAX_REPLY_BYTES: checked before the work
        # One connection's calls at once: as many as the process's. Fewer refused a client's
        # streams past them (RST_STREAM REFUSED_STREAM: UNAVAILABLE, not queued) while it had not
        # yet read the server's settings: 500 concurrent calls on our Client's one connection had
        # failed. The streams that hold a call open without a key are bounded apart (grpc_budget).
        ("grpc.max_concurrent_streams", max_concurrent),
        ("grpc.so_reuseport", int(reuse_port)),
        # Our Client pings connections silent for 5 s, calls or none, to notice a frozen pod.
        # gRPC servers by default accept no ping on a connection without calls and one per
        # 5 minutes otherwise, and after 2 more ("strikes") close it with GOAWAY too_many_pings.
        ("grpc.keepalive_permit_without_calls", 1),
        # (C core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS; a misspelt name is
        # ignored without a word.)
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ]
    if max_connection_age_s > 0:
        # A client keeps its HTTP/2 connections and only re-resolves when one closes: without an
        # age, pods added by a scale-up never see traffic from clients already connected. The
        # close is a GOAWAY: calls in flight finish within the grace, new ones go elsewhere.
        options += [("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(max_connection_age_grace_s * 1000))]
    # The key's check first (a refused call is never decoded), then the fields' count.
    interceptors = [*(interceptors or ()), grpc_budget.WireBudget(max_fields)]
    server = grpc.aio.server(options=options, interceptors=interceptors, maximum_concurrent_rpcs=max_concurrent)
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    address = addresses.grpc_address(host, port)
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port}")
    return server, health_servicer, bound


async def set_serving(health_servicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)
