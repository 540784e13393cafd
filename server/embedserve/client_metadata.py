"""What a Client's call sends besides its request: the Client's own metadata (its key, its
`metadata=`), the call's `metadata=`, checked and merged (the call's replace the Client's of the
same key), and the caller's OpenTelemetry context (embedserve.tracing.inject_current: W3C
`traceparent`, with the OpenTelemetry API installed and a span current), so the server's span is
the caller's child. The Client's marks of a try (a retry, a hedge, waiting for booked room) are
its own to set: a caller's metadata may not hold them."""

from __future__ import annotations

from embedserve import tracing
from embedserve.client_calls import HEDGE_MARK

# A call that does not fit a server's drain budget now waits on that server for the room booked
# for it (within the reservation horizon and its deadline), rather than coming back: the retry
# of a round-robin channel would land on another pod, where nothing is booked for it.
WAIT_FOR_BOOKED_ROOM = ("embedfleet-queue", "wait")
OWN_KEYS = frozenset(("embedfleet-attempt", WAIT_FOR_BOOKED_ROOM[0], HEDGE_MARK[0]))
KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")


def pairs(metadata, where: str) -> tuple[tuple[str, str | bytes], ...]:
    """A caller's metadata (a mapping or (key, value) pairs) as gRPC takes it, or ValueError naming
    what is wrong (`where` the argument): keys lower-case ASCII (digits, letters, `-_.`), not one
    the Client sets itself; values str, or bytes for a key ending `-bin`."""
    if metadata is None:
        return ()
    found = tuple(metadata.items()) if hasattr(metadata, "items") else tuple(metadata)
    for pair in found:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(f"{where}: {pair!r} is not a (key, value) pair")
        key, value = pair
        if not isinstance(key, str) or not key or not all(c in KEY_CHARS for c in key):
            raise ValueError(f"{where}: key {key!r} is not gRPC metadata (lower-case letters, digits, '-', '_', '.')")
        if key in OWN_KEYS:
            raise ValueError(f"{where}: {key!r} is set by the Client itself")
        if not isinstance(value, bytes if key.endswith("-bin") else str):
            raise ValueError(f"{where}: the value of {key!r} must be {'bytes' if key.endswith('-bin') else 'str'}")
    return found


def merged(own: tuple, call: tuple) -> tuple:
    """The Client's metadata with the call's: a key the call sets replaces the Client's values."""
    keys = {k for k, _ in call}
    return (*(p for p in own if p[0] not in keys), *call)


def for_call(own: tuple, metadata) -> tuple:
    """What a call sends besides the Client's marks: its Client's metadata (`own`), the call's
    (checked), and the caller's trace context, unless the call's metadata carries one already."""
    sent = merged(own, pairs(metadata, "metadata="))
    if not any(k == "traceparent" for k, _ in sent):
        context: dict[str, str] = {}
        tracing.inject_current(context)
        sent = merged(sent, tuple(context.items()))
    return sent
