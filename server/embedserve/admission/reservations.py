"""Room booked for refused requests' retries, so a burst is scheduled rather than dropped.

A request that does not fit the drain budget is told when it will (`retry-after-ms`) and its
tokens are booked for that moment (within the horizon, and unless the overload is sustained:
policy.py). A retry finds its booking by the request's content (the same
texts or token ids), so it works for every client that resends the same request after the
server's delay: ours, the openai client (which honours `retry-after-ms`), gRPC's own retry
policy (which honours `grpc-retry-pushback-ms`), or a shell loop. A booking not claimed within
its grace expires, and room nobody claims is never held back from others (admission is
work-conserving): a client that gives up costs nothing.

Runs on the event loop only; times are the estimator's clock (seconds).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools

# A retry may arrive this early (clock skew, rounding of retry-after-ms to whole milliseconds).
EARLY_S = 0.02
# A booking is kept this long past its moment, plus half the wait: a retry can be late by the
# client's jitter and by two busy event loops (measured: a 2-core host running the model with 100
# concurrent openai calls beside it delays retries past half a second). Room kept for nobody
# costs only a later moment for those booked after it: admission never idles the device for it.
GRACE_S = 2.0
GRACE_OF_WAIT = 0.5


@dataclasses.dataclass(eq=False)
class Booking:
    key: int
    tokens: float
    at: float  # when the retry is admitted
    expires: float
    claimed: bool = False


class ReservationBook:
    def __init__(self):
        self._by_key: dict[int, collections.deque[Booking]] = {}
        self._expiry: list[tuple[float, int, Booking]] = []  # heap
        self._seq = itertools.count()
        self.reserved_tokens = 0.0
        self.expired_tokens = 0.0  # booked, never claimed (clients that gave up)

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_key.values())

    def book(self, key: int, tokens: float, now: float, wait_s: float) -> Booking:
        b = Booking(key, tokens, now + wait_s, now + wait_s + GRACE_S + GRACE_OF_WAIT * wait_s)
        self._by_key.setdefault(key, collections.deque()).append(b)
        heapq.heappush(self._expiry, (b.expires, next(self._seq), b))
        self.reserved_tokens += tokens
        return b

    def reserved(self, now: float) -> float:
        """Real tokens booked and not expired (for /health and /metrics)."""
        self.expire(now)
        return self.reserved_tokens

    def due_in(self, key: int, now: float) -> float | None:
        """Seconds until the first booking for this content is due (None: there is none)."""
        self.expire(now)
        queue = self._by_key.get(key)
        return queue[0].at - now if queue else None

    def take(self, booking: Booking) -> None:
        """Consume this booking (its holder is admitted now, or has gone: the room is freed the same way)."""
        if booking.claimed:
            return
        booking.claimed = True
        queue = self._by_key.get(booking.key)
        if queue and booking in queue:
            queue.remove(booking)
            if not queue:
                del self._by_key[booking.key]
        # Nothing booked is exactly 0 (estimates are floats: sums leave a residue otherwise).
        self.reserved_tokens = self.reserved_tokens - booking.tokens if self._by_key else 0.0

    def claim(self, key: int, now: float) -> bool:
        """A request with this content arrived: True when a booking for it is due (consumed:
        admit it). One that is not due yet is left alone (the gate tells a marked retry to come
        back at its moment; an unmarked request with the same texts is another caller)."""
        self.expire(now)
        queue = self._by_key.get(key)
        if not queue or now < queue[0].at - EARLY_S:
            return False
        self.take(queue[0])
        return True

    def expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, _, b = heapq.heappop(self._expiry)
            if b.claimed:
                continue
            self.take(b)
            self.expired_tokens += b.tokens
