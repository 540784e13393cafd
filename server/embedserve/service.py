"""What every transport calls: validate → admit → tokenize → engine → result. Transports only
translate wire formats and map the errors of embedserve.errors to their status codes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
import warnings
from concurrent.futures import Executor
from typing import Callable, NamedTuple, Protocol

import numpy as np
import torch

from embedserve import admission
from embedserve.engine import Engine
from embedserve.errors import InvalidInput, NotReady, Overloaded, WrongTask
from embedserve.estimator import Estimator
from embedserve.infer_decode import decode
from embedserve.reservations import ReservationBook
from embedserve.tokenization import TextTokenizer, validate_texts

# The latest rejection keeps /health "overloaded" this long.
OVERLOADED_HOLD_S = 1.0


class Observer(Protocol):
    """Where the service reports what happened (the metrics module implements it)."""

    def rejected(self, reason: str) -> None: ...


class _NoObserver:
    def rejected(self, reason: str) -> None:
        pass


class Result(NamedTuple):
    rows: np.ndarray  # [n, dim] float32: embeddings, or logits when the task is classify
    tokens: int  # real tokens computed (usage)


@dataclasses.dataclass
class Limits:
    max_texts: int
    max_length: int  # the largest bucket
    truncate: bool


class EmbeddingService:
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
    ):
        self.engine, self.tokenizer, self.estimator = engine, tokenizer, estimator
        self.policy, self.limits, self.executor = policy, limits, executor
        self.observer = observer or _NoObserver()
        self.draw = draw
        self.task = task
        self.draining = False
        self.book = ReservationBook()
        self.in_flight = 0  # admitted requests not yet answered: what a graceful stop waits for
        self._idle = asyncio.Event()
        self._idle.set()
        self._last_rejection = -float("inf")
        self.started_at = time.monotonic()

    @property
    def ready(self) -> bool:
        return self.engine.ready and not self.draining

    def status(self) -> str:
        snap = self.estimator.snapshot()
        rejecting = self.estimator.clock() - self._last_rejection < OVERLOADED_HOLD_S
        if self.engine.failing:
            return "degraded"
        return admission.status(snap, self.policy, self.ready, rejecting)

    async def drained(self) -> None:
        """Returns once no admitted request is left unanswered (new ones are refused while
        draining, so this only waits for the ones already inside)."""
        await self._idle.wait()

    @contextlib.contextmanager
    def _tracked(self):
        if not self.ready:
            raise NotReady("server is shutting down" if self.draining else "server is warming up")
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def embed_texts(self, texts, retry: bool = False, truncate: bool | None = None,
                          deadline_s: float | None = None) -> Result:
        """Texts → one output row per text, in order. `truncate` overrides TRUNCATE;
        `deadline_s` is the time the caller still waits (None: no deadline)."""
        with self._tracked():
            return await self._embed_texts(texts, retry, truncate, deadline_s)

    async def _embed_texts(self, texts, retry: bool, truncate: bool | None, deadline_s: float | None) -> Result:
        t0 = self.estimator.clock()
        truncate = self.limits.truncate if truncate is None else truncate
        texts = validate_texts(texts, self.limits.max_texts)
        # Admission is decided on an estimate (characters / learned characters-per-token), so a
        # refused request costs no tokenization.
        per_text_cap = self.limits.max_length
        cpt, specials = self.estimator.chars_per_token, self.tokenizer.specials
        estimate = sum(min(per_text_cap, len(t) / cpt + specials) for t in texts)
        self._admit(hash((truncate, *texts)), estimate, retry, deadline_s)
        # The estimate stays in the backlog until the real rows replace it, so requests admitted
        # while this one is being tokenized see it.
        self.estimator.enqueued(round(estimate))
        try:
            loop = asyncio.get_running_loop()
            ids, lengths = await loop.run_in_executor(self.executor, self.tokenizer.encode, texts, truncate)
            request = self.engine.submit(torch.from_numpy(ids), lengths)
        finally:
            self.estimator.dequeued(round(estimate))
        self.estimator.learn_chars_per_token(sum(map(len, texts)), int(lengths.sum()) - specials * len(texts))
        return Result(await self._wait(request, t0), int(lengths.sum()))

    async def infer(self, input_ids: bytes, attention_mask: bytes, shape, retry: bool = False,
                    deadline_s: float | None = None) -> Result:
        """Pre-tokenized rows (int32 LE bytes, right-padded) → one output row per row."""
        t0 = self.estimator.clock()
        with self._tracked():
            ids, lengths = decode(input_ids, attention_mask, shape, self.tokenizer.vocab_size, self.limits.max_texts)
            key = hash((input_ids, attention_mask, *shape))
            return await self._infer_rows(ids, lengths, key, retry, deadline_s, t0)

    async def infer_ids(self, rows: list[list[int]], retry: bool = False) -> Result:
        """Token id lists (HTTP input) → the same path as Infer."""
        t0 = self.estimator.clock()
        with self._tracked():
            key = hash(tuple(map(tuple, rows)))
            return await self._infer_rows(*self._id_lists(rows), key, retry, None, t0)

    def _id_lists(self, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        if not rows or len(rows) > self.limits.max_texts:
            raise InvalidInput(f"send 1 to {self.limits.max_texts} token lists, got {len(rows)}")
        if any(len(r) == 0 for r in rows):
            raise InvalidInput("token lists must not be empty")
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        ids = np.zeros((len(rows), int(lengths.max())), dtype=np.int32)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        if ids.min() < 0 or ids.max() >= self.tokenizer.vocab_size:
            raise InvalidInput(f"token ids must be in [0, {self.tokenizer.vocab_size})")
        return ids, lengths

    async def _infer_rows(self, ids: np.ndarray, lengths: np.ndarray, key: int, retry: bool,
                          deadline_s: float | None, t0: float) -> Result:
        top = self.limits.max_length
        if ids.shape[1] > top:
            if not self.limits.truncate and (lengths > top).any():
                row = int(np.flatnonzero(lengths > top)[0])
                raise InvalidInput(f"row {row} has {int(lengths[row])} tokens, more than {top} (the largest bucket), and TRUNCATE is off")
            ids, lengths = ids[:, :top], np.minimum(lengths, top)
        self._admit(key, float(lengths.sum()), retry, deadline_s)
        with warnings.catch_warnings():
            # The request's bytes are read-only; nothing downstream writes to them.
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(ids)
        return Result(await self._wait(self.engine.submit(tensor, lengths), t0), int(lengths.sum()))

    def require_task(self, task: str) -> None:
        if task != self.task:
            other = "POST /classify" if self.task == "classify" else "Embed or /v1/embeddings"
            raise WrongTask(f"this server's model does {self.task} (TASK={self.task}), not {task}: use {other}")

    def _admit(self, key: int, cost: float, retry: bool, deadline_s: float | None) -> None:
        """Admit (return) or refuse (raise Overloaded). `key` identifies the request's content:
        a retry finds the room booked for it by that."""
        if not retry:  # a retry is the same demand again, not new demand
            self.estimator.offered(cost)
        now = self.estimator.clock()
        if self.book.claim(key, now):
            return  # its booked moment has come: the room was kept for it
        decision = admission.decide(self.estimator.snapshot(), cost, self.policy, self.draw(), self.book.reserved_tokens)
        if decision.admit:
            return
        wait_s = decision.retry_after_ms / 1000
        if decision.book:
            done_s = wait_s + self.policy.max_drain_s  # admitted then, computed within the budget
            if deadline_s is None or deadline_s >= done_s:
                self.book.book(key, cost, now, wait_s)
            else:  # the caller will be gone by then: book nothing, and say when it could be done
                wait_s = done_s
        self._refuse(decision.reason, wait_s)

    def _refuse(self, reason: str, wait_s: float) -> None:
        self._last_rejection = self.estimator.clock()
        self.observer.rejected(reason)
        raise Overloaded(reason, max(1, math.ceil(wait_s * 1000)))

    async def _wait(self, request, t0: float) -> np.ndarray:
        try:
            out = await request.future
        finally:
            if not request.future.done() or request.future.cancelled():
                request.future.cancel()
            if request.future.cancelled() or request.future.exception() is not None:
                self.engine.drop(request)
        self.estimator.latency(self.estimator.clock() - t0)
        return out
