"""What every transport calls: validate → admit → tokenize → engine → result. Transports only
translate wire formats and map the errors of embedserve.errors to their status codes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Executor
from typing import Callable

import numpy as np

from embedserve.admission import policy as admission
from embedserve.model.declared import Head
from embedserve.batching.engine import Engine
from embedserve.errors import NotReady, ReplyTooLarge
from embedserve.model.states_rows import asked
from embedserve.admission.estimator import Estimator
from embedserve.admission.gate import Caller, Gate, Observer
from embedserve.batching.intake import Intake
from embedserve.batching.shaping import (INLINE_CHARS, Limits, PreTokenized, Result, Texts, chars, cut, require_task,
                                         tokenize)
from embedserve.batching.tokenization import TextTokenizer
from embedserve.batching import windows
from embedserve.config import CHARS_PER_TOKEN_BOUND

# The latest rejection keeps /health "overloaded" this long.
OVERLOADED_HOLD_S = 1.0


class _NoObserver:
    def rejected(self, reason: str) -> None:
        pass

    def held(self) -> None:
        pass


class EmbeddingService(PreTokenized):
    def __init__(
        self,
        engine: Engine,
        tokenizer: TextTokenizer,
        estimator: Estimator,
        policy: admission.Policy,
        limits: Limits,
        executor: Executor | None = None,
        observer: Observer | None = None,
        draw: Callable[[], float] = admission.uniform,
        task: str = "embed",
        head: Head | None = None,
        activation: str = "",
    ):
        super().__init__()
        self.engine, self.tokenizer, self.estimator = engine, tokenizer, estimator
        self.policy, self.limits, self.executor = policy, limits, executor
        self.gate = Gate(estimator, policy, observer or _NoObserver(), draw)
        self.intake = Intake(tokenizer, engine, estimator)
        self.task, self.activation = task, activation
        self.head = head  # prompts (None: the simulated device's tests, no prompts)
        self.started_at = time.monotonic()
        self.admitted = 0  # requests past admission and not yet answered (`requests`)

    def refusal(self) -> Exception | None:
        if (error := self.engine.lost) is not None:  # for good: a hung device, the batcher or worker gone
            return error
        if self.draining or not self.engine.ready:
            return NotReady("server is shutting down" if self.draining else "server is warming up")
        return None

    def status(self) -> str:
        snap = self.estimator.snapshot()
        rejecting = self.estimator.clock() - self.gate.last_rejection < OVERLOADED_HOLD_S
        if self.engine.failing:
            return "degraded"
        return admission.status(snap, self.policy, self.ready, rejecting)

    async def _texts(self, r: Texts, caller: Caller) -> Result:
        """Texts, or a Rerank request's pairs (rerank: shaping.PreTokenized), → rows."""
        t0 = self.estimator.clock()
        # Admission is decided on an estimate (characters / learned characters-per-token), so a
        # refused request costs no tokenization. The prompt's tokens are the request's too, and
        # a pair's query is in each of its rows.
        per_text_cap, max_chars = self.limits.max_length, self.tokenizer.max_chars
        cpt = self.estimator.chars_per_token
        before = len(r.prompt) if r.query is None else min(len(r.query), max_chars)
        specials = self.tokenizer.specials if r.query is None else self.tokenizer.pair_specials
        if r.window:  # every window's tokens (windows.estimate), read up to MAX_TOKENS_PER_TEXT
            most = max(self.limits.text_tokens, per_text_cap)
            reads = most * CHARS_PER_TOKEN_BOUND
            estimate = sum(windows.estimate(min(most, (before + min(len(t), reads)) / cpt), before / cpt, specials,
                                            per_text_cap) for t in r.texts)
        else:
            estimate = sum(min(per_text_cap, (before + min(len(t), max_chars)) / cpt + specials) for t in r.texts)
        trace = caller.trace
        if trace is not None:
            trace.admitting()
        await self.gate.admit(r.key, estimate, caller)
        if trace is not None:
            trace.admitted()
        with self._admitted():
            if chars(r) <= INLINE_CHARS and not r.window:  # tokenized with the others admitted meanwhile
                request = self.intake.put(r, round(estimate), trace)
                return Result(await self._wait(request, t0), request.tokens)
            # The estimate stays in the backlog until the real rows replace it, so requests admitted
            # while this one is being tokenized see it.
            self.estimator.enqueued(round(estimate))
            try:
                started = time.monotonic() if trace is not None else 0.0
                if r.window:
                    rows = await windows.tokenize(self.tokenizer, self.executor, r.texts, r.prompt, r.truncate,
                                                  max(self.limits.text_tokens, per_text_cap))
                    ids, lengths = rows.ids, rows.lengths
                else:
                    ids, lengths = await tokenize(self.tokenizer, self.executor, r)  # on a tokenizer thread
                    self.states_fit(ids, lengths)
                if trace is not None:
                    trace.tokenized(started)
                request = self.engine.submit(ids, lengths, trace)
            finally:
                self.estimator.dequeued(round(estimate))
            if r.window:
                return await self._pooled(request, t0, lengths, rows.owners, len(r.texts))
            self.estimator.learn_chars_per_token(*self.tokenizer.sample(r.texts, r.prompt, lengths, r.query))
            return Result(await self._wait(request, t0), request.tokens)

    async def _pooled(self, request, t0: float, lengths: np.ndarray, owners: np.ndarray, texts: int) -> Result:
        """A windowed request's rows, computed with each row's norm before Normalize (the
        engine fills `norms` where the model reports them) → one vector per text."""
        request.norms = np.ones(len(lengths), dtype=np.float32)
        out = await self._wait(request, t0)
        normalize = self.head.normalize if self.head else True  # the simulated device normalizes
        args = (out, request.norms, lengths, owners, texts, normalize)
        if len(lengths) <= windows.INLINE_ROWS:
            return Result(windows.pool(*args), request.tokens)
        # Thousands of windows (512 texts of MAX_TOKENS_PER_TEXT): numpy off the loop (it drops the GIL).
        loop = asyncio.get_running_loop()
        return Result(await loop.run_in_executor(self.executor, windows.pool, *args), request.tokens)

    async def rows(self, ids: np.ndarray, lengths: np.ndarray, key: int, caller: Caller,
                   owners: np.ndarray | None = None) -> Result:
        """Token rows a front end prepared (FRONTENDS > 1): admitted on their real tokens.
        `owners`: a windowed request's, the text of each row (pooled here, where the norms are)."""
        with self._tracked():
            return await self._rows(ids, lengths, key, caller, owners)

    async def _rows(self, ids: np.ndarray, lengths: np.ndarray, key: int, caller: Caller,
                    owners: np.ndarray | None = None) -> Result:
        t0 = self.estimator.clock()
        ids, lengths = cut(ids, lengths, self.limits)
        self.states_fit(ids, lengths)
        trace = caller.trace
        if trace is not None:
            trace.admitting()
        await self.gate.admit(key, float(lengths.sum()), caller)
        if trace is not None:
            trace.admitted()
        with self._admitted():
            # The request's bytes are a read-only view: batch assembly copies the rows out of them.
            request = self.engine.submit(ids, lengths, trace)
            if owners is not None:
                return await self._pooled(request, t0, lengths, owners, int(owners[-1]) + 1)
            return Result(await self._wait(request, t0), request.tokens)

    def states_fit(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Rows asking for their token states (embed_all) hold as many as the JSON answer can
        (Limits.max_states, from the bound http_embed_all checks once the answer is written):
        refused here, once tokenized, before the model runs. A request of at most INLINE_CHARS
        characters, tokenized with the others, is not looked at: its few states are, once
        written."""
        if self.engine.states_dim and len(ids) and asked(ids[0, 0]) and int(lengths.sum()) > self.limits.max_states:
            raise ReplyTooLarge(f"the answer's {int(lengths.sum())} token states of {self.engine.states_dim} dimensions "
                                f"are over the {self.limits.max_states} that MAX_REPLY_BYTES allows: send fewer or "
                                "shorter texts")

    @contextlib.contextmanager
    def _admitted(self):
        """Around a request from its admission to its answer: what the request gauges count."""
        self.admitted += 1
        try:
            yield
        finally:
            self.admitted -= 1

    def requests(self) -> tuple[int, int]:
        """(queued, running), the Inference Extension's model-server gauges
        (TotalQueuedRequests, TotalRunningRequests): running, the requests with a row in the batch
        on the device now; queued, every other admitted request not yet answered (waiting to be
        tokenized, in the buckets, in a batch the worker has not started, or with rows computed
        and others still waiting). Read from the engine's own state at the moment asked, never a
        copy: the device runs one batch at a time (the worker thread), so `worker.running` is
        exactly what is being computed. A request held for booked room is not admitted yet (it
        shows in reserved_tokens)."""
        on_device = self.engine.worker.running
        running = len({id(r) for r, _, _ in on_device[0].routes if not r.done}) if on_device else 0
        return max(0, self.admitted - running), running

    def require_task(self, task: str) -> None:
        require_task(self.task, task)

    async def _wait(self, request, t0: float) -> np.ndarray:
        try:
            out = await request.future
        finally:
            if not request.future.done() or request.future.cancelled():
                request.future.cancel()
            if request.future.cancelled() or request.future.exception() is not None:
                self.engine.drop(request)
        self.estimator.latency(self.estimator.clock() - t0)
        if request.trace is not None:
            request.trace.answered()
        return out
