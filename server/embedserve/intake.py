"""Tokenization of admitted requests, many at a time: the stage between admission and the bucket
queues.

A short request (at most shaping.INLINE_CHARS characters) is not tokenized when it arrives but
when the batcher next forms a batch, together with every other request admitted meanwhile: one
call of the Rust tokenizer for all of them. gRPC hands the event loop about one request per turn,
so tokenizing each on arrival ran the tokenizer with its tables out of the CPU's caches, ~40 us
for a short query inside a busy server against ~12 us in a loop (bench/RESULTS.md, "Host path").
While the model worker is full (no batch can be formed), requests gather here; nothing waits
longer for it, since their rows could not run sooner. Longer requests are tokenized on the
tokenizer threads as they arrive (the Rust tokenizer releases the GIL there).

Admission counted each request's estimated tokens into the backlog; the estimate stays there
until its real rows are queued, so requests admitted meanwhile see it."""

from __future__ import annotations

from embedserve.engine import Engine
from embedserve.estimator import Estimator
from embedserve.queues import PendingRequest
from embedserve.shaping import Texts
from embedserve.tokenization import TextTokenizer


class Intake:
    def __init__(self, tokenizer: TextTokenizer, engine: Engine, estimator: Estimator):
        self.tokenizer, self.engine, self.estimator = tokenizer, engine, estimator
        self.waiting: list[tuple[Texts, PendingRequest, int]] = []
        engine.feed = self.flush

    def put(self, r: Texts, estimate: int) -> PendingRequest:
        """Queue an admitted request for tokenization with the others; await the returned
        request's `.future` for its rows (or the InvalidInput its texts deserve)."""
        request = self.engine.new_request(len(r.texts))
        self.estimator.enqueued(estimate)
        self.waiting.append((r, request, estimate))
        self.engine.arriving(len(r.texts), estimate)
        return request

    def flush(self) -> None:
        """Tokenize every waiting request in one call and queue their rows (the engine calls
        this before it forms a batch)."""
        if not self.waiting:
            return
        estimated = sum(estimate for _, _, estimate in self.waiting)
        waiting, self.waiting = [w for w in self.waiting if not w[1].done], []  # cancelled meanwhile: dropped
        encoded = self.tokenizer.encode_each([(r.texts, r.truncate, r.prompt) for r, _, _ in waiting])
        chars = tokens = 0
        for (r, request, _), rows in zip(waiting, encoded):
            if isinstance(rows, Exception):
                request.fail(rows)
                continue
            self.engine.enqueue(request, *rows)
            chars += sum(len(r.prompt) + min(len(t), self.tokenizer.max_chars) for t in r.texts)
            tokens += request.tokens - self.tokenizer.specials * len(r.texts)
        self.estimator.dequeued(estimated)
        self.estimator.learn_chars_per_token(chars, tokens)
