"""Errors the core raises; each transport maps them to its own status codes."""


class InvalidInput(ValueError):
    """The request is malformed; the message names the problem (INVALID_ARGUMENT / HTTP 400)."""


class Overloaded(RuntimeError):
    """Admission refused the request (RESOURCE_EXHAUSTED / HTTP 429)."""

    def __init__(self, reason: str, retry_after_ms: int):
        super().__init__(f"server overloaded ({reason}); retry after {retry_after_ms} ms")
        self.reason = reason
        self.retry_after_ms = retry_after_ms


class NotReady(RuntimeError):
    """The server is warming up or shutting down (UNAVAILABLE / HTTP 503)."""


class ModelFailure(RuntimeError):
    """The forward pass of the batch holding this request failed (INTERNAL / HTTP 500)."""


class WrongTask(RuntimeError):
    """The request needs the other task (embed vs classify) (FAILED_PRECONDITION / HTTP 400)."""


class DeviceUnresponsive(NotReady):
    """A batch outran the watchdog: the device is lost until the pod restarts (UNAVAILABLE / HTTP
    503; clients retry on another pod)."""
