"""What the transports serve from: a Hub, with its Service. In one process the Hub is the Server
that wires the stages (embedserve.app) and its Service the EmbeddingService (embedserve.service);
in a front end (FRONTENDS > 1), the front end (embedserve.frontends.frontend) and its
RemoteService, which sends rows to the model process. The transports know only this: what they
read and call, no more (tests/server/transports/test_hub.py checks that both sides have it)."""

from __future__ import annotations

from typing import Protocol

from embedserve.admission.gate import Caller
from embedserve.batching.shaping import Result
from embedserve.batching.tokenization import TextTokenizer
from embedserve.config import Settings
from embedserve.metrics import Metrics
from embedserve.model.declared import Head
from embedserve.transports.encodings import Quantization


class Service(Protocol):
    draining: bool  # refusing new requests (SIGTERM)
    in_flight: int  # admitted requests not yet answered
    head: Head | None  # how the model is served (None: the simulated device's tests)
    tokenizer: TextTokenizer  # the one the service embeds with (/tokenize, /decode)

    def require_task(self, task: str) -> None:
        """Refuse (WrongTask) a call for another task than the one served."""

    async def embed_texts(self, texts: list[str], caller: Caller = ..., truncate: bool | None = None,
                          prompt_name: str | None = None) -> Result: ...

    async def embed_sparse(self, texts: list[str], caller: Caller = ..., truncate: bool | None = None,
                           prompt_name: str | None = None) -> Result:
        """Task sparse: rows as embedserve.model.sparse_rows.SparseRows."""

    async def infer(self, input_ids: bytes, attention_mask: bytes, shape, caller: Caller = ...) -> Result: ...

    async def infer_ids(self, rows: list[list[int]], caller: Caller = ...) -> Result: ...

    async def rerank(self, query: str, texts: list[str], caller: Caller = ..., truncate: bool | None = None,
                     raw_scores: bool = False) -> Result:
        """One score per text (rows [n]), in text order."""

    async def drained(self) -> None:
        """Returns once no admitted request is left unanswered."""


class Hub(Protocol):
    settings: Settings
    service: Service | None  # None until the model is ready
    metrics: Metrics
    draining: bool  # SIGTERM received: answers close their connections
    served_name: str  # the model's id in the OpenAI API
    task: str  # embed, classify, rerank or sparse
    labels: list[str]  # a classifier's, in output order
    activation: str  # classify, rerank: the logits' activation (embedserve.model.activation)
    head: Head | None  # how the model is served (prompts, normalize), once known
    model_dimension: int  # dimensions the model computes, once known: the most `dimensions` may ask
    quantization: Quantization  # int8/uint8's ranges: QUANTIZE_RANGE's fixed one, or calibrated once loaded
    started_at: float  # monotonic

    @property
    def healthy(self) -> bool: ...

    def health_fields(self) -> dict: ...

    def drain_s(self) -> float:
        """Seconds of model time queued ahead now (queued real tokens / service rate; inf: no rate
        measured yet): every answer carries it (transports/drain.py)."""

    async def refresh(self) -> None:
        """Bring the state /health and /metrics answer with up to date (a front end asks the model
        process for it)."""
