"""Least-drain's tries (embedserve.client): which pod a try goes to, the try itself, and its hedge.
The decisions are embedserve.client_routing's (pure); the pods and their channels
embedserve.client_pods'. What is gRPC's own here: a pod's channel state.

A pod is picked among those whose connection is READY (or IDLE: not connected, nothing known
against it) whenever one is READY: a channel CONNECTING or in TRANSIENT_FAILURE queues or fails a
call sent without wait_for_ready. A frozen pod (SIGSTOP, a hung node) left in DNS ends that way:
keepalive closes its connection, and the reconnect's TCP handshake succeeds (the kernel answers
it) but HTTP/2's never completes, so its channel stays CONNECTING up to gRPC's 20 s connect
deadline, then fails, then tries again. Before keepalive's verdict its connection is READY, and
client_routing.load_ms makes this client's unanswered calls there count against it.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc

from embedserve import client_routing
from embedserve.client_pods import Pod, Pods

# Sent with a hedge: the second try of a call already sent to another pod. Servers count it as no
# new demand (admission's arrival rate, the autoscaler's offered tokens), as they do a retry.
HEDGE_MARK = ("embedfleet-hedge", "1")
# No pod behind the target's name: how often it is asked again, and for how long when the call has
# no deadline (a scale from zero takes a pod start; a deadline bounds the wait).
NO_POD_POLL_S = 0.5
NO_POD_WAIT_S = 30.0
_READY, _IDLE = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.IDLE
_FAILED = grpc.ChannelConnectivity.TRANSIENT_FAILURE


class Failed(Exception):
    """A try's error and the pod it came from (least-drain's retry avoids, or returns to, it)."""

    def __init__(self, error: grpc.aio.AioRpcError, pod: Pod | None):
        super().__init__(error)
        self.error, self.pod = error, pod


def no_pod(target: str, cause: Exception | None) -> grpc.aio.AioRpcError:
    """No pod resolved (DNS has none, or no answer): UNAVAILABLE, as gRPC's channel says it."""
    details = f"no pod resolved for {target}" + (f": {cause}" if cause else "")
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def reachable(pods: list[Pod]) -> list[Pod]:
    """The pods a try may go to by their channels' states: READY and IDLE ones while any is
    READY; else all but those in TRANSIENT_FAILURE (all, if every one is)."""
    states = [p.channel.get_state() for p in pods]
    if _READY in states:
        return [p for p, s in zip(pods, states) if s in (_READY, _IDLE)]
    return [p for p, s in zip(pods, states) if s != _FAILED] or pods


class Router:
    """Least-drain tries over `pods`; `target` names them in errors."""

    def __init__(self, pods: Pods, target: str, budget: client_routing.RetryBudget):
        self.pods, self.target = pods, target
        self.budget = budget  # hedges spend it (shared with retries, and with the process's other Clients)
        self._turn = 0  # picks so far: round robin's position while no pod's estimate is known
        self._rng = random.Random()
        self.hedges = 0  # tries sent as hedges, since start (tests and benches read it)

    async def live_pods(self, remaining: float | None = None) -> list[Pod]:
        """The pods to call. None behind the name (a service at zero that KEDA is waking, pods
        all starting): asked again every NO_POD_POLL_S until one answers, within `remaining` (the
        call's deadline; None: NO_POD_WAIT_S), not failed at once: nothing was sent, so waiting
        costs no server anything."""
        pods = await self.pods.current()
        end = time.monotonic() + (NO_POD_WAIT_S if remaining is None else remaining)
        while not pods and (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(NO_POD_POLL_S, left))
            try:  # one lookup shared by every call waiting; never past the deadline
                pods = await asyncio.wait_for(self.pods.resolved_again(), max(0.0, end - time.monotonic()))
            except asyncio.TimeoutError:
                break
        if not pods:
            raise Failed(no_pod(self.target, self.pods.error), None)
        return pods

    def pick(self, pods: list[Pod], avoid: Pod | None) -> Pod:
        """Least-drain's choice (client_routing.pick), away from `avoid` and among `reachable`
        pods while there are others."""
        choices = reachable([p for p in pods if p is not avoid] or pods)
        now = time.monotonic()
        self._turn += 1
        return choices[client_routing.pick([p.view(now) for p in choices], self._turn, self._rng)]

    async def health(self, request, timeout: float | None, metadata):
        started = time.monotonic()
        pod = self.pick(await self.live_pods(timeout), None)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        return await self._start(pod, "HealthCheck", request, left, metadata)

    async def call(self, rpc: str, request, remaining: float | None, metadata, last):
        """One try on the pod least-drain picks (after a refusal with booked room: the pod that
        booked it; after a pod said go elsewhere: another), hedged on a second pod when it is late."""
        started = time.monotonic()
        pods = await self.live_pods(remaining)
        code, was = last or (None, None)
        remaining = None if remaining is None else remaining - (time.monotonic() - started)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and was in pods:
            pod = was
        else:
            pod = self.pick(pods, was)
        now = time.monotonic()
        delay = client_routing.hedge_delay_s(pod.view(now), pod.latency, remaining) \
            if len(pods) > 1 and self.budget.allows() else None
        first = self._start(pod, rpc, request, remaining, metadata)
        tries = {first}
        try:
            if delay is not None:
                await asyncio.wait(tries, timeout=delay)
                others = [p for p in await self.pods.current() if p is not pod]
                if not first.done() and others and self.budget.spend():
                    self.hedges += 1
                    second = self.pick(others, None)
                    left = None if remaining is None else remaining - (time.monotonic() - now)
                    tries.add(self._start(second, rpc, request, left, (*metadata, HEDGE_MARK)))
            pending = set(tries)
            while pending:  # the first success; if every try fails, the first try's error
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        return task.result()
            return first.result()
        finally:
            for task in tries:
                task.cancel()  # the slower try: the server drops its rows from the queue
            await asyncio.gather(*tries, return_exceptions=True)

    def _start(self, pod: Pod, rpc: str, request, timeout: float | None, metadata) -> asyncio.Task:
        """One call on one pod, as a task, counted in flight there from now (not from when the
        task first runs: a resolution in between must not close the pod's channel under it)."""
        sent = time.monotonic()
        task = asyncio.ensure_future(self._send(pod, rpc, request, timeout, metadata, sent))
        pod.sent(task, sent)
        task.add_done_callback(lambda _: self._ended(pod, task))  # runs even if cancelled before it started
        return task

    def _ended(self, pod: Pod, task: asyncio.Task) -> None:
        pod.ended(task)
        self.pods.settled(pod)

    @staticmethod
    async def _send(pod: Pod, rpc: str, request, timeout: float | None, metadata, sent: float):
        """The call; its answer's drain estimate and latency noted, or, cancelled unanswered,
        how long the pod kept it."""
        try:
            call = getattr(pod.stub, rpc)(request, timeout=timeout, metadata=metadata)
            response = await call
            now = time.monotonic()
            pod.heard(client_routing.drain_ms(await call.trailing_metadata()), now)
            pod.answered(now - sent)
            return response
        except grpc.aio.AioRpcError as e:
            now = time.monotonic()
            drain = client_routing.drain_ms(e.trailing_metadata())
            pod.heard(drain, now)
            if drain is None and e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                # Ended by the clock (or the transport) with no word from the pod: a frozen one's
                # calls end so, and its last estimate (from before it froze) must not make it look
                # idle again once nothing of ours is in flight there.
                pod.unanswered(now - sent, now)
            raise Failed(e, pod) from None
        except asyncio.CancelledError:
            now = time.monotonic()
            pod.unanswered(now - sent, now)
            raise
