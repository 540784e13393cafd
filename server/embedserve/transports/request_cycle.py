"""An HTTP request's life on the API port, around the app (pure ASGI, in front of the routes):
timed and counted, its span begun and ended and its line written (outcomes.py), 503 while the
model warms up (its routes do not exist yet), and cancelled when its caller goes away.

Why cancel. gRPC cancels a call whose client went (its deadline, a closed channel); HTTP had
not: five /embed calls whose sockets closed after 50 ms still had all their 20,200 tokens
computed. An HTTP client's timeout and retry (the openai client's default) then doubles the
device's work exactly under overload. So once a request's body is read, its connection is
watched: a disconnect before the answer starts cancels the request where it is (its rows leave
the bucket queues: service._wait → engine.drop; with FRONTENDS > 1 the front end's cancel
reaches the model process over IPC), and it is counted with status 499 (nginx's "client closed
request": no answer was sent). An answer already being written is left to finish.

Requests in progress are counted here too: past MAX_CONCURRENT_REQUESTS a request is answered
429 at once, in the API's error shape with Retry-After, and counted as any refusal. uvicorn's own
limit (limit_concurrency) counted idle connections with requests: a client's keep-alive pool, or
a few idle sockets opened on purpose, answered every request of the pod 503, probes included."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from starlette.requests import Request

from embedserve import tracing
from embedserve.transports import outcomes

CLIENT_GONE = 499
GONE_REASON = "the caller disconnected before the answer"


class RequestCycle:
    """ASGI middleware. `starting(request)`: the answer while the model warms up, or None;
    `finished(path, status, seconds)`: the request metrics (for paths in `observed`); spans
    only for `api_paths` (a path is the caller's choice, span names must not be)."""

    def __init__(self, app, starting: Callable, finished: Callable[[str, str, float, str], None],
                 api_paths: frozenset[str], observed: frozenset[str], busy: Callable, most: int,
                 model_of: Callable[[dict], str] = lambda scope: ""):
        """`busy(request)`: the answer past `most` requests in progress (MAX_CONCURRENT_REQUESTS);
        `model_of(scope)`: the model the request was served by, its metrics' label (http_models)."""
        self.app, self.starting, self.finished, self.model_of = app, starting, finished, model_of
        self.api_paths, self.observed = api_paths, observed
        self.busy, self.most = busy, most
        self.in_progress = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        path = scope["path"]
        request = Request(scope)
        trace = outcomes.http_begin(request, path) if tracing.tracer is not None and path in self.api_paths else None
        status: int | None = None

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        me, gone, left = asyncio.current_task(), False, False
        watcher: asyncio.Task | None = None

        async def watch():
            """After the body: the next message is the disconnect (the caller left, or the
            answer is complete)."""
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if status is None:
                gone = True
                me.cancel()

        async def receiving():
            nonlocal watcher, left
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False) and watcher is None:
                watcher = asyncio.ensure_future(watch())
            elif message["type"] == "http.disconnect":  # gone while its body was still arriving
                left = True
            return message

        self.in_progress += 1
        try:
            early = self.starting(request) or (self.busy(request) if self.in_progress > self.most
                                               and path not in outcomes.QUIET_PATHS else None)  # probes always answered
            if early is not None:
                await early(scope, receive, sending)
            else:
                await self.app(scope, receiving, sending)
        except asyncio.CancelledError:
            if not gone or me.uncancel() > 0:  # a stop's cancellation, not ours
                raise
            status = CLIENT_GONE
            outcomes.note(request, GONE_REASON)
        except Exception as e:  # no handler maps it: Starlette's error middleware answers 500 (and logs it)
            self._end(request, path, 500, t0, trace, bug=e)
            raise
        finally:
            self.in_progress -= 1
            if watcher is not None:
                watcher.cancel()
        if status is None and left:
            status = CLIENT_GONE
            outcomes.note(request, GONE_REASON)
        self._end(request, path, status or 500, t0, trace)

    def _end(self, request, path: str, status: int, t0: float, trace, bug: BaseException | None = None) -> None:
        elapsed = time.perf_counter() - t0
        if path in self.observed:
            self.finished(f"HTTP {path}", str(status), elapsed, self.model_of(request.scope))
        if trace is not None or status >= 400 or bug is not None or outcomes.logs.access:  # its span, its line
            outcomes.http_end(request, path, status, elapsed, trace, bug=bug)
