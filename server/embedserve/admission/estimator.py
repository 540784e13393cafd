"""The server's estimate of its own capacity and backlog: the signal admission control sheds on
and the operator scales on. Updated by the engine and the worker, read by admission, /health and
/metrics. All times come from an injected clock (seconds, monotonic)."""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Callable, NamedTuple

import numpy as np

# Characters per token is learned over about this many of the latest tokens (a decaying sum):
# weighed by tokens, a request counts for the work it brings, not one vote whatever its size.
CHARS_PER_TOKEN_HORIZON = 20_000


class DecayingRate:
    """Events per second, exponentially weighted over `tau` seconds of wall time: a steady stream
    of r/s reads r, and the rate decays towards 0 once events stop."""

    def __init__(self, tau: float):
        self.tau = tau
        self._rate = 0.0
        self._at: float | None = None

    def add(self, amount: float, now: float) -> float:
        """→ the rate just before this event."""
        before = self.read(now)
        self._rate = before + amount / self.tau
        self._at = now
        return before

    def read(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._rate * math.exp(-max(0.0, now - self._at) / self.tau)


class BusyTimeRate:
    """Tokens per second of model-busy time: a ratio of two EMAs that forget over `tau` seconds
    of busy time, so large and small batches weigh by how long they ran."""

    def __init__(self, tau: float):
        self.tau = tau
        self._tokens = 0.0
        self._busy = 0.0

    def seed(self, tokens_per_s: float, weight_s: float) -> None:
        """Start from a rate measured elsewhere, worth `weight_s` of busy time."""
        self._tokens, self._busy = tokens_per_s * weight_s, weight_s

    def add(self, tokens: float, busy_s: float) -> None:
        keep = math.exp(-busy_s / self.tau)
        self._tokens = self._tokens * keep + tokens
        self._busy = self._busy * keep + busy_s

    def read(self) -> float:
        return self._tokens / self._busy if self._busy > 0 else 0.0


class LatencyWindow:
    """Server-side latencies over the last `window` seconds; P95 cached for `refresh` seconds so
    admission can ask on every request."""

    def __init__(self, window: float, refresh: float = 0.1):
        self.window, self.refresh = window, refresh
        self._samples: collections.deque[tuple[float, float]] = collections.deque()
        self._p95 = 0.0
        self._computed_at = -math.inf

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, latency_s: float, now: float) -> None:
        """Samples past the window leave as new ones come (O(1) each): P95 may never be read
        (latency admission off, no HTTP probe) and they would pile up without end."""
        self._expire(now)
        self._samples.append((now, latency_s))

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window:
            self._samples.popleft()

    def p95(self, now: float) -> float:
        if now - self._computed_at >= self.refresh:
            self._expire(now)
            lat = [s for _, s in self._samples]
            self._p95 = float(np.percentile(lat, 95)) if lat else 0.0
            self._computed_at = now
        return self._p95


class Snapshot(NamedTuple):
    """One consistent reading of the estimator (a tuple: admission takes one per request)."""

    service_rate: float  # real tokens computed / s of model-busy time (padding lowers it)
    arrival_rate: float  # offered real tokens / s, admitted + rejected
    queued_tokens: int  # real tokens admitted, not yet computed
    p95_latency_s: float
    # Seconds of device time queued by the other models on this device (MODELS; model.device): work
    # that may run before this model's next row. 0 with one model.
    elsewhere_s: float = 0.0
    # The fraction of the device the other models' demand takes (their arrival / service rates).
    elsewhere_busy: float = 0.0

    @property
    def capacity_rate(self) -> float:
        """The tokens per second this model can have of the device beside the others' demand: its
        service rate with one model. Demand over it is the pod's demand over its device."""
        return self.service_rate * max(0.0, 1.0 - self.elsewhere_busy)

    @property
    def backlog_tokens(self) -> float:
        """What admission weighs: this model's queue plus the other models' device time, in this
        model's tokens (at its service rate), so its drain budget counts every model's work."""
        if self.elsewhere_s <= 0:
            return self.queued_tokens
        return self.queued_tokens + self.elsewhere_s * self.service_rate if self.service_rate > 0 else math.inf

    @property
    def drain_s(self) -> float:
        own = 0.0 if self.queued_tokens <= 0 else (
            self.queued_tokens / self.service_rate if self.service_rate > 0 else math.inf)
        return own + self.elsewhere_s


class Estimator:
    """Thread-safe: the worker thread reports batches, the event loop everything else.

    One unit throughout: real (unpadded) tokens. Capacity is real tokens per second of
    model-busy time, so padding shows as lower capacity, never as a second unit: the arrival
    rate over the service rate is then the busy fraction, for admission and autoscaler alike."""

    def __init__(
        self,
        latency_window_s: float = 10.0,
        arrival_tau_s: float = 5.0,
        service_tau_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        elsewhere: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0),
    ):
        self.clock = clock
        # What the other models sharing the device hold of it (MODELS; app.Server._elsewhere): the
        # device seconds they have queued, the busy fraction their demand takes.
        self.elsewhere = elsewhere
        self._lock = threading.Lock()
        self._service = BusyTimeRate(service_tau_s)
        self._arrival = DecayingRate(arrival_tau_s)
        self._latency = LatencyWindow(latency_window_s)
        self._queued = 0
        self._offered_total = 0.0  # monotonic: a scraper's rate over its own interval is exact
        self._offered_busy = 0.0  # the same, each offer in seconds of device time at the service rate then
        self.chars_per_token = 4.0  # learned: estimates a text's tokens before tokenizing it
        self._chars = self._tokens = 0.0  # the decaying sums it is learned as

    def seed_service_rate(self, tokens_per_s: float) -> None:
        """The warm-up's measurement: full rows at each bucket's cap, an upper bound that real
        traffic (shorter rows, padding, smaller batches) seldom reaches. It counts as a quarter
        of the EMA's horizon of busy time, so served batches take over within a second or two."""
        with self._lock:
            self._service.seed(tokens_per_s, self._service.tau / 4)

    def offered(self, tokens: float) -> float:
        """New demand arrived; → the arrival rate just before it (between arrivals the average only
        decays, so that is its low point: what "demand has stayed over capacity" must test)."""
        with self._lock:
            self._offered_total += tokens
            rate = self._service.read()
            self._offered_busy += tokens / rate if rate > 0 else 0.0
            return self._arrival.add(tokens, self.clock())

    @property
    def offered_total(self) -> float:
        """Tokens offered since start, admitted and rejected (the arrival rate's counter)."""
        with self._lock:
            return self._offered_total

    @property
    def offered_busy_s(self) -> float:
        """Seconds of device time offered since start (each offer at the service rate then): summed
        over a pod's models, the pod's demand in one unit (busy seconds per second as a rate)."""
        with self._lock:
            return self._offered_busy

    def busy_fraction(self) -> float:
        """The fraction of the device this model's demand takes (arrival / service rate)."""
        with self._lock:
            rate = self._service.read()
            return self._arrival.read(self.clock()) / rate if rate > 0 else 0.0

    def queued_s(self) -> float:
        """Seconds of device time this model's queue holds (the other models' `elsewhere_s`)."""
        with self._lock:
            return Snapshot(self._service.read(), 0.0, self._queued, 0.0).drain_s

    def enqueued(self, tokens: int) -> None:
        with self._lock:
            self._queued += tokens

    def dequeued(self, tokens: int) -> None:
        """Tokens left the backlog without being computed (cancelled, failed)."""
        with self._lock:
            self._queued -= tokens

    def computed(self, real_tokens: int, busy_s: float) -> None:
        """The worker finished a batch: its real tokens leave the backlog and, over the batch's
        busy time, update the service rate."""
        with self._lock:
            self._queued -= real_tokens
            if busy_s > 0:
                self._service.add(real_tokens, busy_s)

    def latency(self, seconds: float) -> None:
        with self._lock:
            self._latency.add(seconds, self.clock())

    def learn_chars_per_token(self, chars: float, tokens: int) -> None:
        """Characters and tokens of texts tokenized (TextTokenizer.sample: each text's characters
        held to what text can be): their ratio over the latest CHARS_PER_TOKEN_HORIZON tokens,
        the running ratio before (the prior of 4 is forgotten at the first sample). Offered load
        is counted from this estimate, so it must match the tokens later computed. Weighed by
        tokens, a text crafted to show 16 characters per token (4,096 spaces read as one) moves it
        by its one token: as one equal sample per request, a steady stream of them had pulled it
        to 16, and ordinary text's offered tokens, the autoscaler's demand, to a quarter."""
        if tokens > 0:
            keep = math.exp(-tokens / CHARS_PER_TOKEN_HORIZON)
            self._chars = self._chars * keep + chars
            self._tokens = self._tokens * keep + tokens
            self.chars_per_token = self._chars / self._tokens

    def drain_s(self) -> float:
        """Snapshot.drain_s alone (the queue and the service rate; no arrival rate, no P95):
        every answer carries it (transports/drain.py), so it is read once per request."""
        elsewhere_s, _ = self.elsewhere()
        with self._lock:
            return Snapshot(self._service.read(), 0.0, self._queued, 0.0, elsewhere_s).drain_s

    def snapshot(self, latency: bool = True) -> Snapshot:
        """`latency=False` leaves the P95 out (0): admission asks on every request, and needs
        it only with the latency strategy on."""
        elsewhere_s, elsewhere_busy = self.elsewhere()  # before the lock: it takes the other models' locks
        with self._lock:
            now = self.clock()
            return Snapshot(
                self._service.read(), self._arrival.read(now), self._queued,
                self._latency.p95(now) if latency else 0.0, elsewhere_s, elsewhere_busy,
            )
