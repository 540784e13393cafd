"""Errors the core raises; each transport maps them to its own status codes."""


class InvalidInput(ValueError):
    """The request is malformed; the message names the problem (INVALID_ARGUMENT / HTTP 400)."""


class ReplyTooLarge(InvalidInput):
    """The request's answer would exceed MAX_REPLY_BYTES; the message names its size and what to
    ask instead (INVALID_ARGUMENT / HTTP 400: the same request would be refused again)."""

    reason = "reply_too_large"  # HTTP's error code


class Overloaded(RuntimeError):
    """Admission refused the request (RESOURCE_EXHAUSTED / HTTP 429)."""

    def __init__(self, reason: str, retry_after_ms: int, final: bool = False):
        """`final`: sustained overload; retrying soon would only be refused again (transports
        say "do not retry", and `retry_after_ms` is a back-off for clients that retry anyway)."""
        super().__init__(
            f"server overloaded ({reason}); retry after {retry_after_ms} ms" if not final else
            f"server overloaded ({reason}): demand has exceeded capacity for longer than the reservation "
            f"horizon absorbs; do not retry (a client that must: back off {retry_after_ms} ms at least)")
        self.reason = reason
        self.retry_after_ms = retry_after_ms
        self.final = final


class NotReady(RuntimeError):
    """The server is warming up or shutting down (UNAVAILABLE / HTTP 503)."""


class ModelFailure(RuntimeError):
    """The forward pass of the batch holding this request failed (INTERNAL / HTTP 500)."""


class WrongTask(RuntimeError):
    """The request needs the other task (embed vs classify) (FAILED_PRECONDITION / HTTP 400)."""


class UnknownModel(LookupError):
    """The request names a model this server does not serve (NOT_FOUND / HTTP 404); the message
    names the served ones."""

    reason = "model_not_found"  # HTTP's error code (OpenAI's)

    def __init__(self, name: str, served: list[str]):
        # The caller's name echoed at most this long: a status message travels in gRPC's trailers.
        shown = repr(name) if len(name) <= 100 else f"{name[:100]!r}... ({len(name)} characters)"
        super().__init__(f"model {shown} is not served here; this server serves " + ", ".join(repr(n) for n in served))


class DeviceUnresponsive(NotReady):
    """A batch outran the watchdog: the device is lost until the pod restarts (UNAVAILABLE / HTTP
    503; clients retry on another pod)."""


# The errors a request can end with, by name: how they cross from the model process to a front
# end (FRONTENDS > 1), which raises them again for its transport to map.
_BY_NAME = {"invalid": InvalidInput, "reply_too_large": ReplyTooLarge, "overloaded": Overloaded, "unavailable": NotReady,
            "device": DeviceUnresponsive, "model_failure": ModelFailure, "wrong_task": WrongTask,
            "unknown_model": UnknownModel}


def to_wire(error: Exception) -> dict:
    name = next(n for n, cls in reversed(list(_BY_NAME.items())) if isinstance(error, cls))
    wire = {"error": name, "message": str(error)}
    if isinstance(error, Overloaded):
        wire.update(reason=error.reason, retry_after_ms=error.retry_after_ms, final=error.final)
    return wire


def from_wire(wire: dict) -> Exception:
    if wire["error"] == "overloaded":
        return Overloaded(wire["reason"], wire["retry_after_ms"], wire["final"])
    if wire["error"] == "unknown_model":  # its message as the model process wrote it
        error = UnknownModel.__new__(UnknownModel)
        LookupError.__init__(error, wire["message"])
        return error
    return _BY_NAME.get(wire["error"], ModelFailure)(wire["message"])


KNOWN = tuple(_BY_NAME.values())
