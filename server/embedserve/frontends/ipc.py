"""Front ends ↔ the model process (FRONTENDS > 1), over ZeroMQ on a Unix socket (pyzmq, as vLLM
and SGLang do). A message is two frames: a JSON header and raw bytes (token ids int32 in,
vectors float32 out): nothing is pickled, numpy reads the bytes in place.

The model process keeps every decision's one home: admission and its estimator, batching, the
device. A front end (transport, validation, tokenization) sends a request's token rows and gets
the vectors or the refusal back; it asks the model process for /health and for the shared
signal. `Door` is the model side (ROUTER), `Link` a front end's side (DEALER).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

Message = tuple[dict, bytes]
# op → handler(header, payload) → reply. A reply is the message sent back; a handler may raise
# nothing: errors are replies too (the front end maps them to the transport's status).
Handler = Callable[[dict, bytes], Awaitable[Message]]


def address(path: str) -> str:
    return f"ipc://{path}"


class _Endpoint:
    """One ZeroMQ socket and the task receiving on it."""

    def __init__(self, kind: int):
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(kind)
        # No high-water mark: at ZeroMQ's default (1000 messages) a ROUTER drops replies to a
        # busy front end without a word, and that request would never be answered. What is in
        # flight is bounded by admission, not here.
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self._receiver: asyncio.Task | None = None

    async def close(self) -> None:
        if self._receiver:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        self.socket.close(linger=0)
        self.context.term()


class Door(_Endpoint):
    """The model process's side: every request runs as its own task; a `cancel` message (the
    caller went away) cancels that task, so its rows leave the queue. `stamp()`, when given, is
    read as each reply is sent and travels with it (header "stamp"): the model process's state
    at answer time, which a front end's state copy (refreshed every STATE_EVERY_S) is not."""

    def __init__(self, path: str, handlers: dict[str, Handler], stamp: Callable[[], dict] | None = None):
        super().__init__(zmq.ROUTER)
        self.handlers = handlers
        self.stamp = stamp
        self.socket.bind(address(path))
        self._tasks: dict[tuple[bytes, int], asyncio.Task] = {}
        # Sender pid → when a message naming it (hello, state) last arrived: stamped on receipt,
        # so a request that waits, or is cancelled before it runs, still shows its sender alive.
        self.heard: dict[int, float] = {}

    def start(self) -> None:
        self._receiver = asyncio.create_task(self._receive(), name="ipc-door")

    async def _receive(self) -> None:
        while True:
            peer, header, payload = await self.socket.recv_multipart(copy=False)
            h = json.loads(header.bytes)
            if "pid" in h:
                self.heard[h["pid"]] = time.monotonic()
            key = (peer.bytes, h.get("id", 0))
            if h["op"] == "cancel":
                task = self._tasks.get(key)
                if task:
                    task.cancel()
                continue
            task = asyncio.create_task(self._serve(peer.bytes, h, payload.buffer))
            self._tasks[key] = task
            task.add_done_callback(lambda _, key=key: self._tasks.pop(key, None))

    async def _serve(self, peer: bytes, header: dict, payload) -> None:
        try:
            reply, data = await self.handlers[header["op"]](header, payload)
        except asyncio.CancelledError:
            return  # the caller went away: nobody to answer
        except Exception as e:  # noqa: BLE001 - a bug answers INTERNAL, the door stays open
            log.exception("ipc %s failed", header.get("op"))
            reply, data = {"error": "internal", "message": str(e)}, b""
        reply["id"] = header.get("id", 0)
        if self.stamp is not None:
            reply["stamp"] = self.stamp()
        await self.socket.send_multipart([peer, json.dumps(reply).encode(), data], copy=False)


class Link(_Endpoint):
    """A front end's side: `await link.call(header, payload)` → (reply header, reply bytes).
    Cancelling the await tells the model process to cancel the request."""

    def __init__(self, path: str):
        super().__init__(zmq.DEALER)
        self.socket.connect(address(path))
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._gone: Exception | None = None  # fail_all's error: every later call raises it at once
        self.stamp: dict = {}  # the latest reply's stamp (Door): replies arrive in the order sent

    async def call(self, header: dict, payload: bytes = b"") -> tuple[dict, memoryview]:
        if self._gone is not None:  # sent, it would wait in ZeroMQ's queue for a peer that never comes
            raise self._gone
        if self._receiver is None:
            self._receiver = asyncio.create_task(self._receive(), name="ipc-link")
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            await self.socket.send_multipart([json.dumps({**header, "id": request_id}).encode(), payload], copy=False)
            return await future
        except asyncio.CancelledError:
            # Unless the answer came: a task cancelled while it awaits the future cancels the future
            # too, so `not future.done()` alone was never true here, and no cancel was ever sent
            # (the model process computed every cancelled call, gRPC's and HTTP's, for nobody).
            if future.cancelled() or not future.done():
                try:
                    await self.socket.send_multipart([json.dumps({"op": "cancel", "id": request_id}).encode(), b""])
                except (Exception, asyncio.CancelledError):  # noqa: BLE001 - a closed socket, a second cancel: the first stands
                    pass
            raise
        finally:
            self._waiting.pop(request_id, None)

    @property
    def pending(self) -> int:
        return len(self._waiting)

    def fail_all(self, error: Exception) -> None:
        """The other side is gone: every call waiting, and every later one, raises `error` (no
        answer will come)."""
        self._gone = error
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(error)

    async def _receive(self) -> None:
        while True:
            header, payload = await self.socket.recv_multipart(copy=False)
            h = json.loads(header.bytes)
            if "stamp" in h:
                self.stamp = h["stamp"]
            future = self._waiting.get(h["id"])
            if future is not None and not future.done():
                future.set_result((h, payload.buffer))

