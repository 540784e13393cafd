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
                          prompt_name: str | None = None, long_text: str = "", outputs: tuple[str, ...] = ()) -> Result:
        """`outputs`: a bgem3 model's asked outputs (rows as embedserve.model.m3_rows.M3Rows)."""

    async def embed_sparse(self, texts: list[str], caller: Caller = ..., truncate: bool | None = None,
                           prompt_name: str | None = None) -> Result:
        """Task sparse: rows as embedserve.model.sparse_rows.SparseRows."""

    async def embed_all(self, texts: list[str], caller: Caller = ..., truncate: bool | None = None,
                        prompt_name: str | None = None) -> Result:
        """Task embed: every token's hidden state (TEI's /embed_all), as TokenRows."""

    async def embed_multivector(self, texts: list[str], is_query: bool, caller: Caller = ...,
                                truncate: bool | None = None) -> Result:
        """Task multivector: rows as embedserve.model.token_rows.TokenRows."""

    async def infer(self, input_ids: bytes, attention_mask: bytes, shape, caller: Caller = ...) -> Result: ...

    async def infer_ids(self, rows: list[list[int]], caller: Caller = ..., outputs: tuple[str, ...] = ()) -> Result: ...

    async def rerank(self, query: str, texts: list[str], caller: Caller = ..., truncate: bool | None = None,
                     raw_scores: bool = False) -> Result:
        """One score per text (rows [n]), in text order."""

    async def drained(self) -> None:
        """Returns once no admitted request is left unanswered."""


class Model(Protocol):
    """One served model, as the transports address it (Hub.model): its name, task and service."""

    served_name: str  # its id on every transport (OpenAI's `model`, gRPC's `model`, /models/<name>/)
    service: Service | None  # None until the model is ready
    task: str  # embed, classify, rerank, sparse or multivector
    labels: list[str]  # a classifier's, in output order
    activation: str  # classify, rerank: the logits' activation (embedserve.model.activation)
    head: Head | None  # how the model is served (prompts, normalize), once known
    model_dimension: int  # dimensions the model computes, once known: the most `dimensions` may ask
    quantization: Quantization  # int8/uint8's ranges: QUANTIZE_RANGE's fixed one, or calibrated once loaded


class Hub(Protocol):
    settings: Settings
    models: dict[str, Model]  # by name, the default first (MODELS; one model: its own)
    metrics: Metrics
    draining: bool  # SIGTERM received: answers close their connections
    started_at: float  # monotonic
    # The default model's (what a request naming no model gets): Model's fields.
    service: Service | None
    served_name: str
    task: str
    labels: list[str]
    activation: str
    head: Head | None
    model_dimension: int
    quantization: Quantization

    def model(self, name: str | None = None) -> Model:
        """The model a request names (None or empty: the default); UnknownModel naming the served ones."""

    @property
    def healthy(self) -> bool: ...

    def health_fields(self) -> dict: ...

    def drain_s(self) -> float:
        """Seconds of device time queued ahead now, every model's (queued real tokens / service
        rate; inf: no rate measured yet): every answer carries it (transports/drain.py)."""

    async def refresh(self) -> None:
        """Bring the state /health and /metrics answer with up to date (a front end asks the model
        process for it)."""
