"""How the Client (least-drain) resolves its target into pods (embedserve.client_pods), against a
real DNS server on loopback and the system's resolver: one address family, an empty answer a
failed lookup that keeps the pods known, never "no pods"."""

import asyncio
import socket
import time

import grpc
import pytest

from embedserve.client_pods import NoAddress, Pods, parse_target, resolve
from tests.conftest import free_port


class DualStackDNS:
    """A DNS server on loopback answering A and AAAA records (a dual-stack headless Service
    names each pod twice, once per family), empty answers for names it has none for."""

    def __init__(self):
        from dnslib import AAAA, QTYPE, RR, A
        from dnslib.server import BaseResolver, DNSLogger, DNSServer

        self.v4: dict[str, list[str]] = {}
        self.v6: dict[str, list[str]] = {}
        v4, v6 = self.v4, self.v6

        class Resolver(BaseResolver):
            def resolve(self, request, handler):
                reply = request.reply()
                name = str(request.q.qname).rstrip(".")
                kind, records = {QTYPE.A: (A, v4), QTYPE.AAAA: (AAAA, v6)}.get(request.q.qtype, (None, {}))
                for ip in records.get(name, []):
                    reply.add_answer(RR(request.q.qname, request.q.qtype, rdata=kind(ip), ttl=1))
                return reply

        self.port = free_port()
        self._server = DNSServer(Resolver(), address="127.0.0.1", port=self.port,
                                 logger=DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data"))
        self._server.start_thread()

    def target(self, name: str) -> str:
        return f"dns://127.0.0.1:{self.port}/{name}:50051"

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture(scope="module")
def dual():
    server = DualStackDNS()
    yield server
    server.stop()


async def test_a_dual_stack_name_is_each_pod_once_in_one_family(dual):
    dual.v4["both.test"], dual.v6["both.test"] = ["127.0.0.1", "127.0.0.2"], ["::1", "::2"]
    dual.v6["six.test"] = ["::1"]
    assert await resolve(parse_target(dual.target("both.test"))) == ["127.0.0.1", "127.0.0.2"]
    assert await resolve(parse_target(dual.target("six.test"))) == ["::1"]


async def test_the_system_resolver_gives_localhost_once():
    """`localhost` is 127.0.0.1 and ::1 in /etc/hosts: one pod, not two."""
    addresses = await resolve(parse_target("localhost:50051"))
    assert len(addresses) == 1 and addresses[0] in ("127.0.0.1", "::1"), addresses
    with pytest.raises(socket.gaierror):
        await resolve(parse_target("no-such-pod.invalid:50051"))


async def test_an_empty_answer_is_a_failed_lookup_and_the_pods_stay(dual):
    """A headless Service whose pods are all unready answers NXDOMAIN (or nothing): the pods known
    stay, as gRPC keeps its addresses, instead of every call failing "no pod"."""
    dual.v4["gone.test"] = ["127.0.0.3", "127.0.0.4"]
    with pytest.raises(NoAddress):
        await resolve(parse_target(dual.target("never.test")))
    pods = Pods(parse_target(dual.target("gone.test")), lambda a: grpc.aio.insecure_channel(f"{a}:{free_port()}"),
                resolve_every_s=0.05)
    try:
        assert [p.address for p in await pods.current()] == ["127.0.0.3", "127.0.0.4"]
        dual.v4["gone.test"] = []
        deadline = time.monotonic() + 5.0
        while not isinstance(pods.error, NoAddress):  # resolved again, and failed
            assert time.monotonic() < deadline, "not resolved again"
            await asyncio.sleep(0.02)
        assert [p.address for p in await pods.current()] == ["127.0.0.3", "127.0.0.4"]
        dual.v4["gone.test"] = ["127.0.0.4"]  # an answer again: the one gone retires
        while [p.address for p in await pods.current()] != ["127.0.0.4"]:
            assert time.monotonic() < deadline, "not resolved again"
            await asyncio.sleep(0.02)
        assert pods.error is None
    finally:
        await pods.close()


async def test_a_call_that_runs_out_its_deadline_unanswered_counts_against_its_pod():
    """A frozen pod's calls end DEADLINE_EXCEEDED with no word from it: its last estimate (idle,
    from before it froze) must not make it look idle again once nothing is in flight there."""
    from embedfleet.v1 import inference_pb2 as pb
    from embedserve.client_calls import Failed, Router
    from embedserve.client_pods import Pod
    from embedserve.client_routing import aged_drain_ms

    async def never(request, context):
        await asyncio.Event().wait()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("embedfleet.v1.Inference", {
        "Embed": grpc.unary_unary_rpc_method_handler(never, request_deserializer=pb.EmbedRequest.FromString,
                                                     response_serializer=pb.EmbedResponse.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        pod = Pod(f"127.0.0.1:{port}", channel)
        pod.heard(0.0, time.monotonic())  # it said "idle" before it stopped answering
        sent = time.monotonic()
        with pytest.raises(Failed):
            await Router._send(pod, "Embed", pb.EmbedRequest(texts=["x"]), 0.3, (), sent)
        now = time.monotonic()
        assert aged_drain_ms(pod.drain_ms, now - pod.heard_at) >= 250
    finally:
        await channel.close()
        await server.stop(None)
