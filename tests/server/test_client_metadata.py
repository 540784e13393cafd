"""What a Client's call sends besides its request (embedserve.client_metadata): the caller's
metadata checked (what gRPC would drop or fail the call on is refused, naming it) and merged with
the Client's, and the caller's OpenTelemetry context, written by its propagators through a setter
that keeps gRPC's rules, looked up once, and never a reason for a call to fail. What is sent is
read where it arrives: a gRPC server on loopback that records each call's metadata."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedserve.client import Client
from embedserve.client_metadata import merged, pairs

ROOT = Path(__file__).resolve().parents[2]


class EmbedStub:
    """A gRPC server of Inference.Embed alone, answered by the subclass's `embed`, on loopback."""

    async def embed(self, request, context):
        raise NotImplementedError

    async def __aenter__(self):
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("embedfleet.v1.Inference", {
            "Embed": grpc.unary_unary_rpc_method_handler(self.embed, pb.EmbedRequest.FromString,
                                                         pb.EmbedResponse.SerializeToString)})])
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        return self

    async def __aexit__(self, *exc):
        await self.server.stop(0)


class Recording(EmbedStub):
    """Embed answers one zero vector and keeps each call's metadata."""

    def __init__(self):
        self.calls: list[dict] = []

    async def embed(self, request, context):
        self.calls.append(dict(context.invocation_metadata()))
        return pb.EmbedResponse(embeddings=np.zeros((1, 4), "<f4").tobytes(), shape=[1, 4])


def test_a_calls_metadata_is_checked_and_merged_with_the_clients():
    assert merged((("authorization", "Bearer a"), ("x-team", "search")),
                  pairs({"authorization": "Bearer b", "x-request-id": "7"}, "metadata=")) == (
        ("x-team", "search"), ("authorization", "Bearer b"), ("x-request-id", "7"))
    for bad, says in (({"X-Upper": "v"}, "is not gRPC metadata"), ({"embedfleet-attempt": "3"}, "set by the Client"),
                      ({"x-bin": "text"}, "must be bytes"), ({"x": 1}, "must be str"), ([("x",)], "not a \\(key, value\\)")):
        with pytest.raises(ValueError, match=says):
            pairs(bad, "metadata=")
    with pytest.raises(ValueError, match="Client\\(metadata=\\)"):
        Client("127.0.0.1:1", metadata={"embedfleet-hedge": "1"})


@pytest.mark.parametrize("bad, says", [
    # gRPC failed the call with its own internal error (ExecuteBatchError) on these values ...
    ({"x-note": "v\nx"}, r"holds '\\n': printable ASCII"), ({"x-note": "é"}, "holds 'é'"),
    ({"x-note": "\x7f"}, "printable"),
    # ... and dropped these keys without a word (or fails the call on HTTP/2's connection headers).
    ({"grpc-timeout": "1S"}, "set by gRPC"), ({"grpc-previous-rpc-attempts": "1"}, "set by gRPC"),
    ({"te": "trailers"}, "set by gRPC"), ({"content-type": "text/plain"}, "set by gRPC"),
    ({"user-agent": "mine"}, "set by gRPC"), ({"connection": "close"}, "set by gRPC"),
])
def test_metadata_grpc_would_drop_or_fail_on_is_refused_naming_it(bad, says):
    with pytest.raises(ValueError, match=says):
        pairs(bad, "metadata=")


async def test_what_the_checks_allow_arrives_as_sent():
    """Printable ASCII (space and ~ included), any bytes in a -bin key; a call's `authorization`
    replaces the Client's api_key."""
    sent = {"x-note": " a b ~!", "x-raw-bin": b"\x00\n\xff", "authorization": "Bearer from-the-call"}
    async with Recording() as server, Client(server.target, api_key="k", metadata={"x-team": "search"}) as client:
        await client.embed(["checked metadata"], metadata=sent)
        await client.embed(["the Client's own"])
    first, second = server.calls
    assert {k: first[k] for k in (*sent, "x-team")} == {**sent, "x-team": "search"}
    assert second["authorization"] == "Bearer k" and "x-note" not in second


class Propagator:
    """A propagator as some write them: mixed-case keys (B3's X-B3-TraceId), and one pair gRPC
    would refuse."""

    fields = {"X-B3-TraceId", "x-odd"}

    def inject(self, carrier, context=None, setter=None):
        setter.set(carrier, "X-B3-TraceId", "463ac35c9f6413ad48485a3953bb6124")
        setter.set(carrier, "x-odd", "naïve")

    def extract(self, carrier, context=None, getter=None):
        return context


async def test_a_propagators_keys_are_lower_cased_and_pairs_grpc_refuses_left_out(caplog):
    """gRPC fails a call whose metadata has an upper-case key: every call of a process whose
    propagator writes one failed. Lower-cased, and what gRPC cannot send left out (said once)."""
    from opentelemetry import propagate

    before = propagate.get_global_textmap()
    propagate.set_global_textmap(Propagator())
    try:
        async with Recording() as server, Client(server.target) as client:
            await client.embed(["traced"])
            await client.embed(["traced again"])
    finally:
        propagate.set_global_textmap(before)
    assert all(c["x-b3-traceid"] == "463ac35c9f6413ad48485a3953bb6124" and "x-odd" not in c for c in server.calls)
    assert caplog.text.count("a propagator's 'x-odd' is not sent") == 1


async def test_propagate_trace_false_sends_no_trace_context():
    from opentelemetry.sdk.trace import TracerProvider

    async with Recording() as server:
        with TracerProvider().get_tracer("the caller").start_as_current_span("caller's work"):
            async with Client(server.target) as traced, Client(server.target, propagate_trace=False) as quiet:
                await traced.embed(["traced"])
                await quiet.embed(["not traced"])
    assert "traceparent" in server.calls[0] and "traceparent" not in server.calls[1]


BAD_PROPAGATORS = """
import asyncio, sys
from embedserve.client import Client
from tests.server.test_client_metadata import Recording

async def main():
    async with Recording() as server:
        for _ in range(3):
            async with Client(server.target) as client:
                await client.embed(["a call"])
        print(len(server.calls), all("traceparent" not in c for c in server.calls))

asyncio.run(main())
"""


def test_a_bad_otel_propagators_costs_a_warning_not_every_call():
    """A misspelled OTEL_PROPAGATORS makes importing OpenTelemetry's propagate raise ValueError:
    caught (ImportError only was), looked up once, said once, and calls go without a context."""
    out = subprocess.run([sys.executable, "-c", BAD_PROPAGATORS], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{ROOT / 'server'}:{ROOT}",
                              "OTEL_PROPAGATORS": "tracecontext,nope"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["3", "True"]
    assert out.stderr.count("trace context: not sent by embedserve.client") == 1, out.stderr[-2000:]
