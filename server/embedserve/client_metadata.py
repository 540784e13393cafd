"""What a Client's call sends besides its request: the Client's own metadata (its key, its
`metadata=`), the call's `metadata=`, checked and merged (the call's replace the Client's of the
same key), and the caller's OpenTelemetry context (embedserve.tracing.injector: W3C
`traceparent`, with the OpenTelemetry API installed and a span current; keys lower-cased, pairs
gRPC would refuse left out), so the server's span is the caller's child. The Client's marks of a
try (a retry, a hedge, waiting for booked room) are its own to set, and gRPC's headers gRPC's: a
caller's metadata may not hold them. A call's `authorization` replaces the Client's api_key."""

from __future__ import annotations

import logging

from embedserve.client_calls import HEDGE_MARK

log = logging.getLogger(__name__)

# A call that does not fit a server's drain budget now waits on that server for the room booked
# for it (within the reservation horizon and its deadline), rather than coming back: the retry
# of a round-robin channel would land on another pod, where nothing is booked for it.
WAIT_FOR_BOOKED_ROOM = ("embedfleet-queue", "wait")
OWN_KEYS = frozenset(("embedfleet-attempt", WAIT_FOR_BOOKED_ROOM[0], HEDGE_MARK[0]))
KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")
# Headers gRPC and HTTP/2 set themselves: gRPC drops a caller's (grpc-timeout is the deadline,
# te and content-type the protocol's, user-agent the channel's) or fails the call on them
# (HTTP/2 forbids connection-specific headers). Keys starting "grpc-" are gRPC's own.
RESERVED = frozenset(("te", "content-type", "user-agent", "host", "connection", "keep-alive", "proxy-connection",
                      "transfer-encoding", "upgrade"))
# An ASCII value's characters (HTTP/2 header values gRPC sends as text: printable ASCII, space
# included); anything else (a line break, "é") made gRPC fail the call with its own internal error.
VALUE_CHARS = frozenset(map(chr, range(0x20, 0x7F)))


def key_problem(key: object) -> str | None:
    """Why `key` cannot be a caller's metadata key, or None."""
    if not isinstance(key, str) or not key or not all(c in KEY_CHARS for c in key):
        return "is not gRPC metadata (lower-case letters, digits, '-', '_', '.')"
    if key.startswith("grpc-") or key in RESERVED:
        return "is set by gRPC itself (a caller's would be dropped or fail the call)"
    if key in OWN_KEYS:
        return "is set by the Client itself"
    return None


def value_problem(key: str, value: object) -> str | None:
    """Why `value` cannot be `key`'s value, or None: bytes for a `-bin` key, else a str of
    printable ASCII (0x20-0x7E)."""
    if key.endswith("-bin"):
        return None if isinstance(value, bytes) else "must be bytes"
    if not isinstance(value, str):
        return "must be str"
    bad = next((c for c in value if c not in VALUE_CHARS), None)
    return None if bad is None else f"holds {bad!r}: printable ASCII only (0x20-0x7E; other bytes in a '-bin' key)"


def pairs(metadata, where: str) -> tuple[tuple[str, str | bytes], ...]:
    """A caller's metadata (a mapping or (key, value) pairs) as gRPC takes it, or ValueError naming
    what is wrong (`where` the argument): keys lower-case ASCII (digits, letters, `-_.`), none that
    gRPC or the Client sets itself; values printable ASCII str, or bytes for a key ending `-bin`."""
    if metadata is None:
        return ()
    found = tuple(metadata.items()) if hasattr(metadata, "items") else tuple(metadata)
    for pair in found:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(f"{where}: {pair!r} is not a (key, value) pair")
        key, value = pair
        if (problem := key_problem(key)) is not None:
            raise ValueError(f"{where}: key {key!r} {problem}")
        if (problem := value_problem(key, value)) is not None:
            raise ValueError(f"{where}: the value of {key!r} {problem}")
    return found


def merged(own: tuple, call: tuple) -> tuple:
    """The Client's metadata with the call's: a key the call sets replaces the Client's values."""
    keys = {k for k, _ in call}
    return (*(p for p in own if p[0] not in keys), *call)


class CheckedSetter:
    """How OpenTelemetry's propagators write into a call's metadata (their `Setter`): keys
    lower-cased (gRPC's are lower case; some propagators write `X-B3-TraceId`, and gRPC failed the
    call on it), and a pair gRPC would refuse or drop (`key_problem`, `value_problem`) left out,
    said once at WARNING."""

    warned: set[str] = set()

    def set(self, carrier: dict, key: str, value: str) -> None:
        key = key.lower() if isinstance(key, str) else key
        problem = key_problem(key) or value_problem(key, value)
        if problem is None:
            carrier[key] = value
        elif key not in self.warned:
            self.warned.add(key)
            log.warning("trace context: a propagator's %r is not sent: it %s", key, problem)


SETTER = CheckedSetter()
_inject_failed = False  # a propagator raised while injecting: said once


def for_call(own: tuple, metadata, inject=None) -> tuple:
    """What a call sends besides the Client's marks: its Client's metadata (`own`), the call's
    (checked), and the caller's trace context as `inject` writes it (embedserve.tracing.injector;
    None: none), unless the call's metadata carries a traceparent already."""
    global _inject_failed
    sent = merged(own, pairs(metadata, "metadata="))
    if inject is not None and not any(k == "traceparent" for k, _ in sent):
        context: dict[str, str] = {}
        try:
            inject(context, setter=SETTER)
        except Exception as e:  # noqa: BLE001 - a propagator's fault fails no call: sent without context
            if not _inject_failed:
                _inject_failed = True
                log.warning("trace context: not sent: a propagator failed (%s: %s)", type(e).__name__, e)
            context = {}
        sent = merged(sent, tuple(context.items()))
    return sent
