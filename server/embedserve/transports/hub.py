"""What the transports serve from: a Hub. In one process it is the Server that wires the stages
(embedserve.app); in a front end (FRONTENDS > 1), the front end's link to the model process
(embedserve.frontends.frontend). The transports know only this: what they read and call, no more."""

from __future__ import annotations

from typing import Any, Protocol

from embedserve.config import Settings
from embedserve.metrics import Metrics
from embedserve.model.declared import Head


class Hub(Protocol):
    settings: Settings
    service: Any  # what the RPCs and routes call (embedserve.service, or a front end's proxy); None until ready
    metrics: Metrics
    draining: bool  # SIGTERM received: answers close their connections
    served_name: str  # the model's id in the OpenAI API
    task: str  # embed or classify
    labels: list[str]  # a classifier's, in output order
    head: Head | None  # how the model is served (prompts, normalize), once known
    started_at: float  # monotonic

    @property
    def healthy(self) -> bool: ...

    def health_fields(self) -> dict: ...

    async def refresh(self) -> None:
        """Bring the state /health and /metrics answer with up to date (a front end asks the model
        process for it)."""
