"""Tokenization of admitted requests, many at a time: the stage between admission and the bucket
queues.

A short request (at most shaping.INLINE_CHARS characters) is not tokenized when it arrives but
when the batcher next looks at the queues, together with every other request admitted
meanwhile: one call of the Rust tokenizer for all of them. gRPC hands the event loop about one
request per turn, so tokenizing each on arrival ran the tokenizer with its tables out of the
CPU's caches, ~40 us for a short query inside a busy server against ~12 us in a loop
(bench/RESULTS.md, "Host path"). The batcher looks when an arrival can change what it does, when
a batch finishes and at the oldest row's deadline (Engine.arriving); while the worker is full,
1 ms after the first arrival. Rows keep their admission time in the queues, so waiting here
never makes a row look younger to the drain. Longer requests are tokenized on the tokenizer
threads as they arrive (the Rust tokenizer releases the GIL there).

Admission counted each request's estimated tokens into the backlog; the estimate stays there
until its real rows are queued, so requests admitted meanwhile see it. Texts the tokenizer cannot
read fail their own request only (the call is then made request by request)."""

from __future__ import annotations

import logging
import time

from embedserve.batching.engine import Engine
from embedserve.errors import InvalidInput, ModelFailure
from embedserve.admission.estimator import Estimator
from embedserve.batching.queues import PendingRequest
from embedserve.batching.shaping import Texts
from embedserve.batching.tokenization import TextTokenizer, unreadable

log = logging.getLogger(__name__)


class Intake:
    def __init__(self, tokenizer: TextTokenizer, engine: Engine, estimator: Estimator):
        self.tokenizer, self.engine, self.estimator = tokenizer, engine, estimator
        self.waiting: list[tuple[Texts, PendingRequest, int, float]] = []  # ..., estimate, admitted at
        engine.feed = self.flush

    def put(self, r: Texts, estimate: int, trace=None) -> PendingRequest:
        """Queue an admitted request for tokenization with the others; await the returned
        request's `.future` for its rows (or the InvalidInput its texts deserve). `trace`: its
        stamps (a traced request)."""
        request = self.engine.new_request(len(r.texts), trace)
        self.estimator.enqueued(estimate)
        self.waiting.append((r, request, estimate, self.engine.clock()))
        self.engine.arriving(len(r.texts), estimate)
        return request

    def flush(self) -> None:
        """Tokenize every waiting request in one call and queue their rows (the engine calls
        this before it forms a batch, and meanwhile when no batch can be formed)."""
        if not self.waiting:
            return
        waiting, self.waiting = self.waiting, []
        chars = tokens = 0
        try:
            live = [w for w in waiting if not w[1].done]  # cancelled meanwhile: dropped
            started = time.monotonic()
            for (r, request, _, admitted), rows in zip(live, self._encoded([w[0] for w in live])):
                if request.trace is not None:  # waited: from admission to this call of the tokenizer
                    request.trace.tokenized(started, len(live), started - request.trace.admission[-1])
                if isinstance(rows, Exception):
                    request.fail(rows)
                    continue
                try:
                    self.engine.enqueue(request, *rows, admitted)
                except Exception as e:  # a bug: this request fails, the others go on
                    log.exception("queuing a request's rows failed")
                    request.fail(ModelFailure(f"the server could not queue this request: {e!r}"))
                    continue
                c, t = self.tokenizer.sample(r.texts, r.prompt, rows[1], r.query)
                chars, tokens = chars + c, tokens + t
        finally:  # the estimates leave the backlog whatever happened (the rows are in it now)
            self.estimator.dequeued(sum(w[2] for w in waiting))
        self.estimator.learn_chars_per_token(chars, tokens)

    def _encoded(self, requests: list[Texts]) -> list:
        batch = [(r.texts, r.truncate, r.prompt, r.query, r.side) for r in requests]
        try:
            return self.tokenizer.encode_each(batch)
        except Exception:  # texts the tokenizer cannot read broke the whole call: each alone
            log.warning("tokenizing %d requests together failed; tokenizing each alone", len(batch), exc_info=True)
            return [self._alone(one) for one in batch]

    def _alone(self, one: tuple):
        try:
            return self.tokenizer.encode(*one)
        except InvalidInput as e:
            return e
        except Exception as e:  # whatever else it raises fails this request only
            return unreadable(e)
