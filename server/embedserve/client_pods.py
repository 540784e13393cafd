"""The pods behind a Client's target, one gRPC channel each (least-drain routing,
embedserve.client): the target's name is resolved again every RESOLVE_EVERY_S and whenever a
pod's connection closes (servers close theirs after MAX_CONNECTION_AGE_S, so a scale-up's pods
take their share at the next connection's age-out, or within RESOLVE_EVERY_S, plus the DNS
server's own cache: CoreDNS caches a headless Service's answer up to 30 s by default, 5 s TTL).
A pod that leaves DNS gets no new call; its channel closes once the calls on it have answered (a
draining pod finishes them), none is cut.

One address family: a dual-stack pod has an A and an AAAA record, and counting both would make
it two pods (twice the share, two channels); the resolver's first answer's family is kept, as
gRPC's pick of one address per endpoint does. An empty answer is a failed lookup, never "no
pods": a headless Service whose pods are all unready answers NXDOMAIN (gRPC keeps its addresses
then too), and retiring every pod on a DNS hiccup would fail every call.

Targets, as gRPC spells them: `dns:///NAME:PORT` and `NAME:PORT` (the system's resolver: search
domains and ndots of /etc/resolv.conf, /etc/hosts, as any program in the pod resolves a
Service's short name), `dns://SERVER[:PORT]/NAME:PORT` (that DNS server, asked with dnspython),
`ipv4:` and `ipv6:` address lists and address literals (fixed). Any other scheme (unix:, xds:)
is one channel, as gRPC resolves it: `parse_target` says None.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Callable, NamedTuple

import grpc

from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client_routing import PodView, aged_drain_ms, latency_after

log = logging.getLogger(__name__)
# CoreDNS answers a headless Service with a TTL of 5 s (and caches it up to 30 s): asking more
# often learns nothing new. Scale-ups are found sooner through connections' ages (_watch).
RESOLVE_EVERY_S = 5.0
RESOLVE_TIMEOUT_S = 2.0
GRPC_DEFAULT_PORT = 443  # gRPC's, for a name without a port


class Target(NamedTuple):
    name: str  # what is resolved (an address list: empty)
    port: int
    addresses: tuple[str, ...]  # fixed addresses (ipv4:, ipv6:, a literal); empty: resolve `name`
    dns_server: tuple[str, int] | None  # dns://SERVER/...: ask it, not the system's resolver

    @property
    def authority(self) -> str:
        """The :authority every pod's calls carry, and the name TLS verifies: the target's, as
        one channel to the target would send it (a pod's address is not in its certificate)."""
        host = self.name or self.addresses[0]
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


def _host_port(text: str, default_port: int | None = GRPC_DEFAULT_PORT) -> tuple[str, int]:
    """`host:port`, `[v6]:port`, `host` (the default port) → (host, port)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, int(port)
    if text.count(":") > 1:  # a bare IPv6 address
        return text, default_port
    return text, default_port


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def parse_target(target: str) -> Target | None:
    """The target as this module resolves it; None for a scheme it leaves to gRPC."""
    if target.startswith(("ipv4:", "ipv6:")):
        pairs = [_host_port(a) for a in target.split(":", 1)[1].split(",") if a]
        ports = {p for _, p in pairs}
        if not pairs or len(ports) != 1:  # one Target, one port: gRPC allows more, no cluster needs it
            return None
        return Target("", ports.pop(), tuple(h for h, _ in pairs), None)
    if target.startswith("dns:"):
        rest = target[len("dns:"):]
        server = None
        if rest.startswith("//"):
            authority, _, rest = rest[2:].partition("/")
            if authority:
                server = _host_port(authority, 53)
        host, port = _host_port(rest)
        return Target(host, port, (), server)
    if "://" in target or target.split(":", 1)[0] in ("unix", "unix-abstract", "vsock", "xds"):
        return None
    host, port = _host_port(target)
    if _literal(host):
        return Target("", port, (host,), None)
    return Target(host, port, (), None)


class NoAddress(LookupError):
    """The name resolved to no address (an empty answer): a failed lookup, the pods known kept."""


async def resolve(target: Target) -> list[str]:
    """The target's pod addresses now, in the resolver's order, one family (the first
    answer's), duplicates dropped; raises on no answer, an empty one included."""
    if target.addresses:
        return list(target.addresses)
    if target.dns_server is not None:
        addresses = await _ask(target.dns_server, target.name)
    else:
        # AI_ADDRCONFIG: no IPv6 addresses on a host without IPv6 (and the same for IPv4).
        infos = await asyncio.get_running_loop().getaddrinfo(target.name, target.port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_ADDRCONFIG)
        addresses = [info[4][0] for info in infos if info[0] == infos[0][0]] if infos else []
    if not addresses:
        raise NoAddress(f"{target.name}: no address")
    return list(dict.fromkeys(addresses))


async def _ask(server: tuple[str, int], name: str) -> list[str]:
    """A records, else AAAA ones (one family: see the module's docstring)."""
    import dns.asyncresolver
    import dns.exception
    import dns.resolver

    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers, resolver.port, resolver.lifetime = [server[0]], server[1], RESOLVE_TIMEOUT_S
    for kind in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(name, kind, search=False)
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            continue
        if addresses := [r.address for r in answer]:
            return addresses
    return []


def channel_target(address: str, port: int) -> str:
    return f"ipv6:[{address}]:{port}" if ":" in address else f"ipv4:{address}:{port}"


class Pod:
    """One pod: its channel, and what the client knows of it."""

    def __init__(self, address: str, channel: grpc.aio.Channel):
        self.address, self.channel = address, channel
        self.stub = pb_grpc.InferenceStub(channel)
        self.drain_ms: float | None = None  # its latest answer's embedfleet-drain-ms
        self.heard_at = 0.0  # monotonic, when that answer came
        self.latency: tuple[float, float] | None = None  # its answered calls' (mean, deviation), s
        self._sent: dict[object, float] = {}  # this client's calls there not answered yet → sent at (oldest first)
        self.retired = False  # gone from DNS: no new call; closed once in_flight is 0
        self.watcher: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        return len(self._sent)

    def sent(self, call: object, now: float) -> None:
        """A call was picked for this pod: counted at once, before it is scheduled, so that the
        pod cannot be closed under it (a resolution in between) nor picked as if idle."""
        self._sent[call] = now

    def ended(self, call: object) -> None:
        self._sent.pop(call, None)

    def heard(self, drain_ms: float | None, now: float) -> None:
        if drain_ms is not None:
            self.drain_ms, self.heard_at = drain_ms, now

    def answered(self, latency_s: float) -> None:
        self.latency = latency_after(self.latency, latency_s)

    def unanswered(self, waited_s: float, now: float) -> None:
        """A call of ours there ended unanswered after `waited_s` (cancelled: its hedge won; or
        past its deadline with no word from the pod): as
        far as this client saw, the pod was at least that far behind. Kept as its estimate (which
        fades as any does) when above what it last said, so a frozen pod is not taken for idle
        the moment its last call there is given up."""
        if waited_s * 1000 > (aged_drain_ms(self.drain_ms, now - self.heard_at) or 0.0):
            self.drain_ms, self.heard_at = waited_s * 1000, now

    def view(self, now: float) -> PodView:
        waited = now - next(iter(self._sent.values())) if self._sent else 0.0
        return PodView(self.drain_ms, now - self.heard_at, self.in_flight, waited,
                       0.0 if self.latency is None else self.latency[0])


class Pods:
    """The target's pods, resolved again every RESOLVE_EVERY_S and when a connection closes.
    `make_channel(address)` → that pod's channel."""

    def __init__(self, target: Target, make_channel: Callable[[str], grpc.aio.Channel],
                 resolve_every_s: float = RESOLVE_EVERY_S):
        self.target, self.make_channel, self.resolve_every_s = target, make_channel, resolve_every_s
        self.pods: dict[str, Pod] = {}  # by address, in DNS's order; retired ones too, until closed
        self._resolved = asyncio.Event()  # the first resolution has come (or failed)
        self._wake = asyncio.Event()  # resolve now: a connection closed
        self._round, self._answered = 0, asyncio.Event()  # lookups answered; set (and replaced) at each
        self._resolver: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()
        self._lookup: asyncio.Task | None = None  # the system resolver's thread cannot be stopped
        self._channel_failed = False  # make_channel raised once (logged at warning the first time)
        self.error: Exception | None = None  # the last resolution's failure, if it failed

    async def current(self) -> list[Pod]:
        """The pods a call may go to (resolving the first time)."""
        if self._resolver is None:
            self._resolver = asyncio.create_task(self._keep_resolving(), name="embedfleet-pods")
        await self._resolved.wait()
        return [p for p in self.pods.values() if not p.retired]

    async def resolved_again(self) -> list[Pod]:
        """Resolve now (one lookup for every caller waiting meanwhile), and → the pods once it
        has answered (or failed). Callers of `current` are not held up by it."""
        await self.current()
        round_, answered = self._round, self._answered
        self._wake.set()
        while self._round == round_:
            await answered.wait()
        return [p for p in self.pods.values() if not p.retired]

    async def _keep_resolving(self) -> None:
        while True:
            try:
                self.update(await self._ask_dns())
                self.error = None
            except Exception as e:  # noqa: BLE001 - a failed lookup keeps the pods known (as gRPC does)
                self.error = e
                log.debug("resolving %s failed: %s", self.target.name, e)
            self._resolved.set()
            self._round += 1  # resolved_again's waiters: this lookup answered
            self._answered.set()
            self._answered = asyncio.Event()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.resolve_every_s)
            except asyncio.TimeoutError:
                pass

    async def _ask_dns(self) -> list[str]:
        """One lookup's answer within RESOLVE_TIMEOUT_S. A lookup that did not answer in time
        goes on (getaddrinfo runs in a thread of the default executor, which cancelling the
        wait does not stop): it is waited on again, not doubled, so a resolver that hangs
        holds one thread, not one more per round."""
        if self._lookup is None or self._lookup.done():
            if self._lookup is not None and not self._lookup.cancelled():
                self._lookup.exception()  # a late answer from before: stale, dropped
            self._lookup = asyncio.ensure_future(resolve(self.target))
        done, _ = await asyncio.wait({self._lookup}, timeout=RESOLVE_TIMEOUT_S)
        if not done:
            raise TimeoutError(f"no answer within {RESOLVE_TIMEOUT_S} s")
        lookup, self._lookup = self._lookup, None
        return lookup.result()

    def update(self, addresses: list[str]) -> None:
        """DNS's answer: new pods get a channel; pods gone from it get no new call."""
        for address in addresses:
            pod = self.pods.get(address)
            if pod is None:
                try:
                    channel = self.make_channel(address)
                except Exception as e:  # noqa: BLE001 - one address we cannot reach is no failed lookup
                    if not self._channel_failed:
                        log.warning("no channel to %s (%s): %s", address, self.target.name, e)
                    self._channel_failed = True
                    continue
                pod = self.pods[address] = Pod(address, channel)
                pod.watcher = asyncio.create_task(self._watch(pod), name=f"embedfleet-pod-{address}")
            pod.retired = False
        for address, pod in list(self.pods.items()):
            if address not in addresses:
                pod.retired = True
                self.settled(pod)

    def settled(self, pod: Pod) -> None:
        """A call on `pod` ended (or it left DNS): a retired pod with none left closes."""
        if pod.retired and pod.in_flight == 0 and self.pods.get(pod.address) is pod:
            del self.pods[pod.address]
            task = asyncio.ensure_future(self._close(pod))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _watch(self, pod: Pod) -> None:
        """A connection that was READY and is not now closed (an aged-out connection's GOAWAY, a
        pod stopping, keepalive's verdict on a frozen one): ask DNS at once what is there now.
        And connect again at once when the channel falls IDLE: the connection attempt, not a
        caller's call, finds out whether the pod answers (a frozen one's stays CONNECTING, which
        picks avoid while another pod is READY)."""
        state = pod.channel.get_state(try_to_connect=True)
        while True:
            await pod.channel.wait_for_state_change(state)
            new = pod.channel.get_state(try_to_connect=True)
            if state == grpc.ChannelConnectivity.READY:
                self._wake.set()
            state = new

    @staticmethod
    async def _close(pod: Pod) -> None:
        if pod.watcher is not None:
            pod.watcher.cancel()
            await asyncio.gather(pod.watcher, return_exceptions=True)
        await pod.channel.close()

    async def close(self) -> None:
        if self._lookup is not None:
            self._lookup.cancel()  # the task; a thread already in getaddrinfo ends on its own
        if self._resolver is not None:
            self._resolver.cancel()
            await asyncio.gather(self._resolver, return_exceptions=True)
        for pod in list(self.pods.values()):
            await self._close(pod)
        self.pods.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
