"""Python client for embedfleet servers, and `python -m embedserve.client TEXT...`.

In a cluster, target the headless Service as `dns:///NAME:50051`. Routing (`routing=`):

- "least-drain" (the default): one channel per pod address the name resolves to (one address
  family), resolved again every 5 s and whenever a pod's connection closes (servers close theirs
  after MAX_CONNECTION_AGE_S), so pods added by a scale-up get calls at the next connection
  age-out or within about 5 s of DNS naming them (CoreDNS may itself cache a headless Service's
  answer up to 30 s), and pods gone from DNS get none (the calls already there finish). Every
  answer, refusals included, carries its pod's backlog (`embedfleet-drain-ms`, model time queued
  ahead there); each call goes to the better of two pods drawn at random by that estimate, aged
  (halved every second without news, forgotten after 5 s, so a pod left alone because it was slow
  is tried again) but never below how long this client's oldest unanswered call there is overdue,
  with this client's own calls in flight there deciding between near-equal ones; round robin
  while no pod's estimate is known. Pods whose connection is not READY (connecting, failed) get
  no call while another's is. A try that outlives its pod's estimate twice over plus what this
  client's calls there usually take (smoothed latency and deviation; at least 0.25 s) is sent
  once more to another pod (a hedge, marked embedfleet-hedge: the calls are idempotent, and
  servers count it as no new demand) when the deadline leaves room; the first answer wins and the
  other try is cancelled. Hedges spend the retry budget (below): a fleet slow everywhere is
  not sent twice its load. Decisions: embedserve.client_routing; tries: embedserve.client_calls;
  pods and resolution: embedserve.client_pods; retry decisions: embedserve.client_retries.
- "round-robin": one gRPC channel, its round_robin policy over the resolved addresses (what the
  Client did before; servers' connection ages make it resolve again).

A call the server cannot start within its drain budget waits on the server for the room booked
for it (metadata embedfleet-queue: wait), as long as that moment lies within the reservation
horizon and the call's deadline (`timeout_s`). Within that deadline the call retries
RESOURCE_EXHAUSTED after the server's retry-after-ms (least-drain: on the pod that booked the
room); a refusal for sustained overload (`grpc-retry-pushback-ms` negative) only once, at once, on
another pod; and UNAVAILABLE or CANCELLED (a pod draining or gone) at once on another pod, with a
short backoff if every pod says so. A pod that stops answering without closing its connection
(frozen, partitioned) is noticed by keepalive within about 10 s, and its calls end UNAVAILABLE and
are retried likewise; least-drain's hedges move them sooner, and its picks leave that pod alone
(its calls there unanswered, then its connection not READY) while it is still in DNS.
Retries after a refusal are marked so servers do not count them as new demand.

The retries that multiply load on a fleet slow or failing everywhere (those after a backoff, the
one after negative pushback) and hedges are held to a tenth of successful calls (10 at once), by
one budget per target shared by every Client of the process (client_routing.RetryBudget,
modelled on gRPC's retry throttling): code that makes a Client per request is held as one that
keeps one. A call whose retry the budget refuses ends with its last error. Two retries are never
charged (client_retries.spends_budget): the first one at once on another pod after UNAVAILABLE or
CANCELLED (a pod draining or killed answers none of its calls: a pod killed with hundreds of
calls in flight loses none), and one onto room the server booked (retry-after-ms), which the
server schedules and bounds itself.

Every call sends the caller's OpenTelemetry context (W3C `traceparent`, with the OpenTelemetry API
installed and a span current: the server's span is its child; `propagate_trace=False`: never), the
Client's `metadata=` and the call's own `metadata=` (the call's replace the Client's of the same
key; embedserve.client_metadata).

A server with API keys takes `api_key=` (sent as `authorization: Bearer <key>` metadata on every
call); one with TLS takes `ca_file=` (the PEM bundle its certificate is verified against; `tls=True`
alone: the system's roots), and one that asks for client certificates `client_cert_file=` and
`client_key_file=`. The CLI reads the key from EMBEDFLEET_API_KEY or --api-key.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import NamedTuple

import grpc
import numpy as np

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve import client_metadata, tracing
from embedserve.client_calls import Failed, Router
from embedserve.client_pods import Pod, Pods, Target, channel_target, parse_target
from embedserve.client_retries import ELSEWHERE, is_final, spends_budget, wait_before_retry
from embedserve.client_routing import RetryBudget, budget_for

# A dead pod costs a call at most about KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS (10 s) before it
# is retried elsewhere, a third of the default 30 s deadline. 5 s for the answer is generous:
# gRPC core answers pings on its own threads, not on the server's (possibly busy) event loop.
KEEPALIVE_TIME_MS = 5000
KEEPALIVE_TIMEOUT_MS = 5000
CHANNEL_OPTIONS = [
    ("grpc.lb_policy_name", "round_robin"),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),  # we retry ourselves, honouring retry-after-ms
    # A channel asks DNS again when a connection closes (servers age them out), but by default
    # not within 30 s of the last answer: new pods would wait that long for a share.
    ("grpc.dns_min_time_between_resolutions_ms", 1000),
    # Keepalive (off in gRPC by default). A pod that stops answering without closing anything
    # (SIGSTOP, a hung node, a partition) keeps its connection READY, and round robin hands it
    # every caller in turn, each waiting out its deadline. A connection silent for
    # KEEPALIVE_TIME_MS is pinged and closed when no answer comes within KEEPALIVE_TIMEOUT_MS:
    # its calls end UNAVAILABLE, retried at once on the next pod (ELSEWHERE), and round robin
    # stops picking it (a frozen process's kernel still accepts the reconnect, but the HTTP/2
    # handshake does not complete: not READY until the pod answers again). Any byte received
    # resets the timer, so a busy connection is never pinged.
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # ... which grpcio 1.85's transport does not apply (it arms that timer only when one is
    # already armed): what closes the connection is the timeout of any unanswered ping, 1 minute
    # by default once keepalive is on (measured without it: every caller still stuck 18 s on).
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # Idle connections too, so a pod that froze between calls is dropped before one lands there;
    # and without gRPC's limit of 2 pings until the client sends data (an idle channel, a call
    # held on the server for its booked room), after which it would stop watching. Servers
    # accept this (grpc_server.py); a default gRPC server would answer GOAWAY too_many_pings.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
WAIT_FOR_BOOKED_ROOM = client_metadata.WAIT_FOR_BOOKED_ROOM  # embedfleet-queue: wait (client_metadata says why)
# A quantized encoding's numpy dtype, and whether it packs 8 dimensions to a byte (as
# sentence-transformers' quantize_embeddings returns them).
_QUANTIZED = {pb.INT8: (np.int8, False), pb.UINT8: (np.uint8, False), pb.BINARY: (np.int8, True),
              pb.UBINARY: (np.uint8, True)}


def decode_embeddings(response: pb.EmbedResponse) -> np.ndarray:
    """float32 [rows, dimensions]; quantized: int8/uint8 [rows, dimensions], or binary/ubinary
    [rows, ceil(dimensions / 8)] (bits packed, as quantize_embeddings packs them)."""
    rows, dims = tuple(response.shape)
    if response.encoding == pb.FLOAT:
        return np.frombuffer(response.embeddings, dtype="<f4").reshape(rows, dims)
    dtype, packed = _QUANTIZED[response.encoding]
    return np.frombuffer(response.quantized, dtype=dtype).reshape(rows, (dims + 7) // 8 if packed else dims)


def _encoding(name: str) -> int:
    try:
        return pb.Encoding.Value(name.upper())
    except ValueError:
        raise ValueError(f"encoding {name!r}: expected one of {', '.join(k.lower() for k in pb.Encoding.keys())}") from None


def decode_sparse(response: pb.EmbedSparseResponse) -> list[tuple[np.ndarray, np.ndarray]]:
    """EmbedSparseResponse (CSR) → per text (vocabulary ids int32, ascending; weights float32)."""
    indices = np.frombuffer(response.indices, dtype="<i4")
    values = np.frombuffer(response.values, dtype="<f4")
    bounds = list(response.offsets)
    return [(indices[a:b], values[a:b]) for a, b in zip(bounds, bounds[1:])]


class M3Result(NamedTuple):
    """Client.embed_m3: each output asked, None where not asked."""
    dense: np.ndarray | None  # [texts, dimensions]
    sparse: list[tuple[np.ndarray, np.ndarray]] | None  # per text (vocabulary ids, weights)
    colbert: list[np.ndarray] | None  # per text [tokens, dim]



def decode_multivector(response: pb.MultiVectorResponse) -> list[np.ndarray]:
    """MultiVectorResponse → per text, its [tokens, dimension] matrix: float32, or the encoding's
    bytes (int8, uint8: [tokens, dimension]; binary (int8), ubinary (uint8): [tokens, ceil(dimension / 8)])."""
    dim, bounds = int(response.dimension), list(response.offsets)
    if response.quantized or response.encoding != pb.FLOAT:
        dtype, packed = _QUANTIZED[response.encoding]
        flat = np.frombuffer(response.quantized, dtype=dtype).reshape(-1, (dim + 7) // 8 if packed else dim)
    else:
        flat = np.frombuffer(response.vectors, dtype="<f4").reshape(-1, dim)
    return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


def _pem(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def credentials(tls: bool = False, ca_file: str | None = None, client_cert_file: str | None = None,
                client_key_file: str | None = None) -> grpc.ChannelCredentials | None:
    """TLS when `tls`, a CA file or a client certificate is given (verified against `ca_file`,
    else the system's roots); None: plain text."""
    if (client_cert_file is None) != (client_key_file is None):
        raise ValueError("give client_cert_file and client_key_file together")
    if not (tls or ca_file or client_cert_file):
        return None
    return grpc.ssl_channel_credentials(root_certificates=_pem(ca_file), private_key=_pem(client_key_file),
                                        certificate_chain=_pem(client_cert_file))


def channel(target: str, tls: bool = False, ca_file: str | None = None, client_cert_file: str | None = None,
            client_key_file: str | None = None, options=CHANNEL_OPTIONS) -> grpc.aio.Channel:
    """A channel with the Client's options (round robin over what `target` resolves to), TLS as
    `credentials` says."""
    creds = credentials(tls, ca_file, client_cert_file, client_key_file)
    if creds is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, creds, options=options)


def pod_channel(target: Target, address: str, creds: grpc.ChannelCredentials | None,
                authority: str | None = None) -> grpc.aio.Channel:
    """One pod's channel (least-drain): the Client's options, one address, and the target's own
    name (or `authority`) as :authority, and the target's as the name its TLS certificate is verified for."""
    options = [o for o in CHANNEL_OPTIONS if o[0] != "grpc.lb_policy_name"] + [
        ("grpc.default_authority", authority or target.authority)]
    if creds is None:
        return grpc.aio.insecure_channel(channel_target(address, target.port), options=options)
    name = target.name or target.addresses[0]
    return grpc.aio.secure_channel(channel_target(address, target.port), creds,
                                   options=options + [("grpc.ssl_target_name_override", name)])


def _parsed_or_none(target: str) -> Target | None:
    """The target as parsed (a round-robin Client's budget key), None where gRPC alone reads it."""
    try:
        return parse_target(target)
    except ValueError:
        return None


class QuantizationRanges(NamedTuple):
    """What Client.quantization answers (rpc Quantization)."""

    ranges: np.ndarray  # float32 [2, dimensions]: each dimension's start, then each one's end
    calibration: str  # the calibration's digest (HealthCheck's quantize_calibration); "": a fixed range
    quantize_range: float  # r of the fixed range [-r, r]; 0 when calibrated
    dimensions: int
    normalized: bool


ROUTINGS = ("least-drain", "round-robin")
class Client:
    """Async client. `timeout_s` is each call's deadline, retries (and hedges) included (None: no
    deadline); `max_attempts` optionally bounds the tries too (None: as many as the deadline
    allows). `routing`: "least-drain" (default) or "round-robin" (the module's docstring; a
    target of another scheme than dns:, ipv4:, ipv6: or host:port is one channel either way).
    `api_key`: sent on every call (servers with API_KEYS / API_KEYS_FILE); `tls`, `ca_file`,
    `client_cert_file`, `client_key_file`: see `credentials`. A wrong or missing key ends a call
    UNAUTHENTICATED, which is never retried. `metadata`: sent on every call (each call's own
    `metadata=` replaces it key by key, an `authorization` there the api_key's).
    `propagate_trace`: send the caller's OpenTelemetry context (False: never). `retry_budget`:
    what charged retries and hedges spend; default the process's one for `target`
    (client_routing.budget_for; `x:50051` and `dns:///x:50051` are one target). `authority`: the
    :authority every call carries instead of the target's name: a service that scales to zero
    is reached through KEDA's HTTP add-on, whose interceptor routes by it (docs/autoscaling.md).
    A target with no pod behind it (a headless name at zero, or while its pods start) is asked
    again until one answers, within the deadline (client_calls.Router.live_pods)."""

    def __init__(self, target: str, timeout_s: float | None = 30.0, max_attempts: int | None = None, *,
                 api_key: str | None = None, tls: bool = False, ca_file: str | None = None,
                 client_cert_file: str | None = None, client_key_file: str | None = None,
                 routing: str = "least-drain", metadata=None, retry_budget: RetryBudget | None = None,
                 propagate_trace: bool = True, model: str = "", authority: str | None = None):
        if timeout_s is None and max_attempts is None:
            raise ValueError("give a deadline (timeout_s) or max_attempts: retries must end")
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r}: expected one of {', '.join(ROUTINGS)}")
        self.target = target
        self.model = model  # the served model every call names unless it names its own (MODELS; "": the default)
        parsed = parse_target(target) if routing == "least-drain" else None
        self.routing = routing if routing == "round-robin" or parsed is not None else "round-robin"
        creds = credentials(tls, ca_file, client_cert_file, client_key_file)
        self.retry_budget = retry_budget or budget_for(parsed or _parsed_or_none(target) or target)
        self.pods: Pods | None = None
        self.stub = None
        self._router: Router | None = None
        if parsed is not None:
            self.pods = Pods(parsed, lambda address: pod_channel(parsed, address, creds, authority))
            self._router = Router(self.pods, target, self.retry_budget)
        else:
            self.channel = channel(target, tls, ca_file, client_cert_file, client_key_file,
                                   CHANNEL_OPTIONS + ([("grpc.default_authority", authority)] if authority else []))
            self.stub = pb_grpc.InferenceStub(self.channel)
        self.timeout_s, self.max_attempts = timeout_s, max_attempts
        auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._metadata = client_metadata.merged(auth, client_metadata.pairs(metadata, "Client(metadata=)"))
        self._inject = tracing.injector() if propagate_trace else None  # here, not on a call's path

    @property
    def hedges(self) -> int:
        """Tries sent as hedges since start (least-drain; tests and benches read it)."""
        return 0 if self._router is None else self._router.hedges

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self.pods is not None:
            await self.pods.close()
        else:
            await self.channel.close()

    async def embed(self, texts: list[str], dimensions: int = 0, encoding: str = "float",
                    prompt_name: str = "", metadata=None, model: str = "", long_text: str = "",
                    truncate: bool | None = None) -> np.ndarray:
        """→ float32 [rows, dimensions] (0: the model's default), or quantized (`encoding` int8,
        uint8: [rows, dimensions] of that dtype; binary (int8), ubinary (uint8): [rows, ceil(dimensions / 8)]).
        `metadata`: this call's own, with the Client's (every call takes it); `model`: the served
        model to use (every call takes it; "": the Client's, else the server's default);
        `long_text` "window": texts over the max length embedded whole (a server with
        LONG_TEXTS=window); `truncate` None: the server's TRUNCATE."""
        request = pb.EmbedRequest(texts=texts, dimensions=dimensions, encoding=_encoding(encoding), prompt_name=prompt_name,
                                  model=model or self.model, long_text=long_text, truncate=truncate)
        return decode_embeddings(await self._call("Embed", request, metadata))

    async def embed_sparse(self, texts: list[str], prompt_name: str = "",
                           metadata=None, model: str = "") -> list[tuple[np.ndarray, np.ndarray]]:
        """A sparse (SPLADE) model: per text, its non-zero vocabulary ids and their weights."""
        request = pb.EmbedRequest(texts=texts, prompt_name=prompt_name, model=model or self.model)
        return decode_sparse(await self._call("EmbedSparse", request, metadata))

    async def embed_multivector(self, texts: list[str], is_query: bool = False, encoding: str = "float",
                                truncate: bool | None = None, metadata=None, model: str = "") -> list[np.ndarray]:
        """A multi-vector (ColBERT) model: per text, its token vectors ([tokens, dimension]), as
        queries (`is_query`: the query prefix, expanded to the query length) or documents (the
        document prefix, the skiplist's tokens left out). `encoding`: as embed's, per token vector."""
        request = pb.MultiVectorRequest(texts=texts, is_query=is_query, encoding=_encoding(encoding),
                                        model=model or self.model, truncate=truncate)
        return decode_multivector(await self._call("EmbedMultiVector", request, metadata))

    async def embed_m3(self, texts: list[str], outputs=("dense", "sparse", "colbert"), dimensions: int = 0,
                       encoding: str = "float", prompt_name: str = "", metadata=None, model: str = "") -> "M3Result":
        """A BGE-M3 model (task bgem3): the `outputs` asked ("dense", "sparse", "colbert") of one
        pass; the others None in the result. dense as `embed` returns it; sparse as `embed_sparse`;
        colbert per text its token vectors ([tokens, dim] float32, or in `encoding` as dense rows)."""
        names = {"dense": pb.DENSE, "sparse": pb.SPARSE, "colbert": pb.MULTIVECTOR}
        unknown = [o for o in outputs if o not in names]
        if unknown:
            raise ValueError(f"outputs {unknown}: expected any of {', '.join(names)}")
        request = pb.EmbedRequest(texts=texts, dimensions=dimensions, encoding=_encoding(encoding), prompt_name=prompt_name,
                                  model=model or self.model, outputs=[names[o] for o in outputs])
        response = await self._call("Embed", request, metadata)
        return M3Result(decode_embeddings(response) if "dense" in outputs else None,
                        decode_sparse(response.sparse) if "sparse" in outputs else None,
                        decode_multivector(response.multivector) if "colbert" in outputs else None)

    async def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray, dimensions: int = 0,
                    encoding: str = "float", metadata=None, model: str = "") -> np.ndarray:
        ids = np.ascontiguousarray(input_ids, dtype="<i4")
        mask = np.ascontiguousarray(attention_mask, dtype="<i4")
        request = pb.InferRequest(input_ids=ids.tobytes(), attention_mask=mask.tobytes(), shape=list(ids.shape),
                                  dimensions=dimensions, encoding=_encoding(encoding), model=model or self.model)
        return decode_embeddings(await self._call("Infer", request, metadata))

    async def rerank(self, query: str, texts: list[str], truncate: bool | None = None,
                     raw_scores: bool = False, metadata=None, model: str = "") -> np.ndarray:
        """A reranking server's score of each text against the query: float32 [len(texts)], in the
        order of texts (not sorted). `truncate` None: the server's TRUNCATE. Retried as `embed` is."""
        request = pb.RerankRequest(query=query, texts=texts, truncate=truncate, raw_scores=raw_scores,
                                   model=model or self.model)
        response = await self._call("Rerank", request, metadata)
        return np.asarray(response.scores, dtype=np.float32)

    async def quantization(self, dimensions: int = 0, normalized: bool | None = None,
                           metadata=None, model: str = "") -> QuantizationRanges:
        """The ranges a server's int8/uint8 codes of vectors `dimensions` wide use (0: the width it
        serves by default; `normalized` None: as it serves them), so that `quantize_embeddings(
        vectors, precision, ranges=q.ranges)` quantizes as it does and its codes can be
        dequantized. One pod's (pods with equal `calibration` digests use equal ranges)."""
        request = pb.QuantizationRequest(dimensions=dimensions, normalized=normalized, model=model or self.model)
        r = await self._call("Quantization", request, metadata)
        return QuantizationRanges(np.frombuffer(r.ranges, dtype="<f4").reshape(2, r.dimensions), r.calibration,
                                  r.quantize_range, r.dimensions, r.normalized)

    async def health(self, metadata=None, model: str = "") -> pb.HealthCheckResponse:
        """One pod's health (least-drain: the pod a call would go to now), with `model`'s fields."""
        sent, request = self._call_metadata(metadata), pb.HealthCheckRequest(model=model or self.model)
        if self._router is None:
            return await self.stub.HealthCheck(request, timeout=self.timeout_s, metadata=sent)
        try:
            return await self._router.health(request, self.timeout_s, sent)
        except Failed as f:
            raise f.error from None

    def _call_metadata(self, metadata) -> tuple:
        return client_metadata.for_call(self._metadata, metadata, self._inject)

    async def _call(self, rpc: str, request, call_metadata=None):
        sent = self._call_metadata(call_metadata)
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        refused = unavailable = final = attempt = 0
        last: tuple[grpc.StatusCode, Pod | None] | None = None  # the last try's error, and its pod
        while True:
            attempt += 1
            remaining = None if deadline is None else deadline - time.monotonic()
            # embedfleet-attempt counts admission's refusals: a request refused before is not new
            # demand; one that a draining pod turned away was never counted, and is.
            metadata = (("embedfleet-attempt", str(refused + 1)), WAIT_FOR_BOOKED_ROOM, *sent)
            try:
                if self._router is None:
                    response = await getattr(self.stub, rpc)(request, timeout=remaining, metadata=metadata)
                else:
                    response = await self._router.call(rpc, request, remaining, metadata, last)
                self.retry_budget.succeeded()
                return response
            except (grpc.aio.AioRpcError, Failed) as caught:
                e, pod = (caught.error, caught.pod) if isinstance(caught, Failed) else (caught, None)
                wait = wait_before_retry(e, unavailable, final)
                if e.code() in ELSEWHERE:
                    unavailable += 1
                elif e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused += 1
                    final += is_final(e)
                out_of_time = deadline is not None and time.monotonic() + (wait or 0.0) >= deadline
                # The budget last: a retry that would not be sent anyway spends nothing.
                if wait is None or out_of_time or attempt == self.max_attempts or (
                        spends_budget(e, unavailable) and not self.retry_budget.spend()):
                    raise e from None
                last = (e.code(), pod) if not is_final(e) else (grpc.StatusCode.UNAVAILABLE, pod)
                await asyncio.sleep(wait)


async def _cli(args) -> int:
    texts = list(args.texts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            texts += [line.rstrip("\n") for line in f if line.strip()]
    if not texts:
        print("no texts given", file=sys.stderr)
        return 2
    async with Client(args.target, timeout_s=args.timeout, api_key=args.api_key or None, tls=args.tls,
                      ca_file=args.ca_file) as client:
        t0 = time.perf_counter()
        try:
            out = await client.embed(texts)
        except grpc.aio.AioRpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        ms = (time.perf_counter() - t0) * 1000
    print(f"{out.shape[0]} embeddings, dimension {out.shape[1]}, {ms:.1f} ms")
    for text, row in zip(texts, out):
        head = ", ".join(f"{v:+.4f}" for v in row[:5])
        print(f"  [{head}, ...]  {text[:60]!r}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m embedserve.client", description="Embed texts with an embedfleet server.")
    p.add_argument("texts", nargs="*", help="texts to embed")
    p.add_argument("--file", help="a file with one text per line")
    p.add_argument("--target", default="localhost:50051", help="host:port or dns:///name:port")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    p.add_argument("--api-key", default=os.environ.get("EMBEDFLEET_API_KEY"),
                   help="the server's API key (default: $EMBEDFLEET_API_KEY)")
    p.add_argument("--tls", action="store_true", help="TLS, verified against the system's roots")
    p.add_argument("--ca-file", help="TLS, verified against this PEM bundle")
    return asyncio.run(_cli(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
