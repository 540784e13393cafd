"""uvicorn's HTTP/1.1 protocol (h11), fed what a connection sends a slice at a time.

asyncio hands a protocol up to 256 KiB a read, and h11 parses all of it before the loop runs
anything else: an event per chunk of a chunked body, ~20 µs each. A body sent in 16-byte chunks
was 12 k events, 1-byte chunks 43 k: a quarter to half a second a read during which no probe,
scrape or other request was answered, from any caller, key or none. Fed SLICE bytes at a time,
about TURN_S of them a turn of the loop (the connection paused meanwhile, so what waits is at
most one read): bench/http_parse measures the longest stall under 16-byte chunks at ~20 ms
against ~400 ms stock, and a body with a Content-Length as fast as stock. While a request read whole waits for its answer, nothing more
is fed: h11 would hold what follows (pipelined requests) and parse all of it in one go once the
answer is sent. Everything else is uvicorn's own protocol."""

from __future__ import annotations

import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

SLICE = 4 * 1024
MAX_SLICE = 32 * 1024  # a slice of 1-byte chunks this long: ~5.5 k events, ~0.1 s of h11
TURN_S = 0.005  # parsing per turn of the loop, at most this and a slice


class SlicedH11Protocol(H11Protocol):
    """H11Protocol whose reads are parsed in SLICE pieces, about TURN_S per turn of the event loop."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._backlog = bytearray()
        self._feeding = False  # a _feed is scheduled
        self._slice = SLICE

    def data_received(self, data: bytes) -> None:
        if not self._backlog and len(data) <= SLICE and not self._answering():
            return super().data_received(data)
        self._backlog += data
        self.transport.pause_reading()  # until the backlog is parsed (resumed there)
        self._schedule()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._schedule()  # what came after the request answered

    def _answering(self) -> bool:
        """A request read whole and its answer not yet sent: what follows waits in the backlog."""
        return self.conn.their_state is h11.DONE and self.conn.our_state is not h11.DONE

    def _schedule(self) -> None:
        if self._backlog and not self._feeding and not self._answering():
            self._feeding = True
            self.loop.call_soon(self._feed)

    def _feed(self) -> None:
        """Slices until the backlog is parsed or TURN_S has passed, each twice the last while they
        parse fast, up to MAX_SLICE (4 KiB slices had made an 8 MiB body 2.5-3× slower than
        stock: bench/http_parse); tiny chunks stay at SLICE and stop after about TURN_S."""
        self._feeding = False
        deadline = time.perf_counter() + TURN_S
        try:
            while self._backlog and not self._answering() and not self.transport.is_closing():
                piece = bytes(self._backlog[:self._slice])
                del self._backlog[:self._slice]
                began = time.perf_counter()
                super().data_received(piece)
                ended = time.perf_counter()
                # Cheap to parse (a body with a Content-Length: one event a slice), larger slices:
                # uvicorn copies the body it holds on every event. Dear (tiny chunks), back to SLICE.
                self._slice = min(2 * self._slice, MAX_SLICE) if ended - began < TURN_S / 8 else SLICE
                if ended >= deadline:
                    break
        except BaseException:
            # As asyncio does when a protocol's data_received raises (here it runs as a callback
            # of the loop, which would only log it): the connection is dropped, not left paused.
            self._backlog.clear()
            self.transport.abort()
            raise
        if self.transport.is_closing():
            self._backlog.clear()
        elif self._backlog:
            self._schedule()
        elif not self.flow.read_paused and not self.transport.is_closing():
            # uvicorn's own pause (a body the app has not read yet, a pipelined request) stands;
            # it resumes reading itself when it lifts that pause.
            self.transport.resume_reading()
