"""What every transport calls: validate → admit → tokenize → engine → result. Transports only
translate wire formats and map the errors of embedserve.errors to their status codes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from concurrent.futures import Executor
from typing import Callable, NamedTuple

import numpy as np

from embedserve import admission
from embedserve.declared import Head
from embedserve.engine import Engine
from embedserve.errors import DeviceUnresponsive, InvalidInput, NotReady, WrongTask
from embedserve.estimator import Estimator
from embedserve.gate import Caller, Gate, Observer
from embedserve.infer_decode import decode
from embedserve.tokenization import TextTokenizer, validate_texts

# The latest rejection keeps /health "overloaded" this long.
OVERLOADED_HOLD_S = 1.0
# Requests with at most this many characters are tokenized on the event loop (~20 us for a
# query, ~200 us at the bound): handing them to a tokenizer thread costs more, since the thread
# then waits for the GIL the busy loop holds (up to the 5 ms switch interval). Longer ones go to
# the tokenizer threads, which release the GIL while the Rust tokenizer runs.
INLINE_CHARS = 512


class _NoObserver:
    def rejected(self, reason: str) -> None:
        pass

    def held(self) -> None:
        pass


class Result(NamedTuple):
    rows: np.ndarray  # [n, dim] float32: embeddings, or logits when the task is classify
    tokens: int  # real tokens computed (usage)


@dataclasses.dataclass
class Limits:
    max_texts: int
    max_length: int  # tokens per text: the model's max_seq_length, capped by the largest bucket
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
        head: Head | None = None,
    ):
        self.engine, self.tokenizer, self.estimator = engine, tokenizer, estimator
        self.policy, self.limits, self.executor = policy, limits, executor
        self.gate = Gate(estimator, policy, observer or _NoObserver(), draw)
        self.task = task
        self.head = head  # prompts (None: the simulated device's tests, no prompts)
        self.draining = False
        self.in_flight = 0  # admitted requests not yet answered: what a graceful stop waits for
        self._idle = asyncio.Event()
        self._idle.set()
        self.started_at = time.monotonic()

    @property
    def ready(self) -> bool:
        return self.engine.ready and not self.draining and not self.engine.hung

    def status(self) -> str:
        snap = self.estimator.snapshot()
        rejecting = self.estimator.clock() - self.gate.last_rejection < OVERLOADED_HOLD_S
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
            if self.engine.hung:
                raise DeviceUnresponsive("the model's device stopped responding; this server will be restarted")
            raise NotReady("server is shutting down" if self.draining else "server is warming up")
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def embed_texts(self, texts, caller: Caller = Caller(), truncate: bool | None = None,
                          prompt_name: str | None = None) -> Result:
        """Texts → one output row per text, in order. `truncate` overrides TRUNCATE;
        `prompt_name` picks one of the model's declared prompts (default: its default prompt)."""
        with self._tracked():
            return await self._embed_texts(texts, caller, truncate, prompt_name)

    async def _embed_texts(self, texts, caller: Caller, truncate: bool | None, prompt_name: str | None) -> Result:
        t0 = self.estimator.clock()
        truncate = self.limits.truncate if truncate is None else truncate
        texts = validate_texts(texts, self.limits.max_texts)
        try:
            prompt = self.head.prompt(prompt_name) if self.head else ""
        except KeyError as e:
            raise InvalidInput(e.args[0]) from None
        # Admission is decided on an estimate (characters / learned characters-per-token), so a
        # refused request costs no tokenization. The prompt's tokens are the request's too.
        per_text_cap, max_chars = self.limits.max_length, self.tokenizer.max_chars
        cpt, specials = self.estimator.chars_per_token, self.tokenizer.specials
        estimate = sum(min(per_text_cap, (len(prompt) + min(len(t), max_chars)) / cpt + specials) for t in texts)
        await self.gate.admit(hash((truncate, prompt, *texts)), estimate, caller)
        # The estimate stays in the backlog until the real rows replace it, so requests admitted
        # while this one is being tokenized see it.
        self.estimator.enqueued(round(estimate))
        try:
            if sum(map(len, texts)) <= INLINE_CHARS:  # a thread hop costs more than the work
                ids, lengths = self.tokenizer.encode(texts, truncate, prompt)
            else:
                loop = asyncio.get_running_loop()
                ids, lengths = await loop.run_in_executor(self.executor, self.tokenizer.encode, texts, truncate, prompt)
            request = self.engine.submit(ids, lengths)
        finally:
            self.estimator.dequeued(round(estimate))
        chars = sum(len(prompt) + min(len(t), max_chars) for t in texts)
        self.estimator.learn_chars_per_token(chars, int(lengths.sum()) - specials * len(texts))
        return Result(await self._wait(request, t0), int(lengths.sum()))

    async def infer(self, input_ids: bytes, attention_mask: bytes, shape, caller: Caller = Caller()) -> Result:
        """Pre-tokenized rows (int32 LE bytes, right-padded) → one output row per row."""
        t0 = self.estimator.clock()
        with self._tracked():
            ids, lengths = decode(input_ids, attention_mask, shape, self.tokenizer.vocab_size, self.limits.max_texts)
            key = hash((input_ids, attention_mask, *shape))
            return await self._infer_rows(ids, lengths, key, caller, t0)

    async def infer_ids(self, rows: list[list[int]], caller: Caller = Caller()) -> Result:
        """Token id lists (HTTP input) → the same path as Infer."""
        t0 = self.estimator.clock()
        with self._tracked():
            key = hash(tuple(map(tuple, rows)))
            return await self._infer_rows(*self._id_lists(rows), key, caller, t0)

    def _id_lists(self, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        if not rows or len(rows) > self.limits.max_texts:
            raise InvalidInput(f"send 1 to {self.limits.max_texts} token lists, got {len(rows)}")
        if any(len(r) == 0 for r in rows):
            raise InvalidInput("token lists must not be empty")
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        ids = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)  # checked before narrowing
        bad = f"token ids must be in [0, {self.tokenizer.vocab_size}) (the model's vocabulary)"
        try:
            for i, r in enumerate(rows):
                ids[i, : len(r)] = r
        except OverflowError:
            raise InvalidInput(bad) from None
        if ids.min() < 0 or ids.max() >= self.tokenizer.vocab_size:
            raise InvalidInput(bad)
        return ids.astype(np.int32), lengths

    async def _infer_rows(self, ids: np.ndarray, lengths: np.ndarray, key: int, caller: Caller, t0: float) -> Result:
        top = self.limits.max_length
        if ids.shape[1] > top:
            if not self.limits.truncate and (lengths > top).any():
                row = int(np.flatnonzero(lengths > top)[0])
                raise InvalidInput(f"row {row} has {int(lengths[row])} tokens, more than {top} (the largest bucket), and TRUNCATE is off")
            ids, lengths = ids[:, :top], np.minimum(lengths, top)
        await self.gate.admit(key, float(lengths.sum()), caller)
        # The request's bytes are a read-only view: batch assembly copies the rows out of them.
        return Result(await self._wait(self.engine.submit(ids, lengths), t0), int(lengths.sum()))

    def require_task(self, task: str) -> None:
        if task != self.task:
            other = "POST /classify" if self.task == "classify" else "Embed or /v1/embeddings"
            raise WrongTask(f"this server's model does {self.task} (TASK={self.task}), not {task}: use {other}")

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
