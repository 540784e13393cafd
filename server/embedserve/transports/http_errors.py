"""What an HTTP 422 answers: FastAPI's validation errors, bounded. A request's input is echoed a
little (strings cut, collections summarised), so that a hostile body cannot make the reply, or the
event loop's work on it, grow with its size."""

from __future__ import annotations

import json

from fastapi.encoders import jsonable_encoder


# What a 422 reports: the first errors, each echoing a little of its input (strings cut, lists
# and objects of more than a few items, or nested, summarised), in a reply of at most REPLY_BYTES.
REPORTED_ERRORS = 10
ECHOED_CHARS = 100
ECHOED_ITEMS = 8
# Cut inputs alone do not bound a reply: ASCII-escaped, a character outside the BMP is 12 bytes,
# and an error may echo up to 8 keys and 8 values of 100 of them.
REPLY_BYTES = 8192


def error_reply(errors: list[dict]) -> str:
    """The 422's JSON, in FastAPI's shape ({"detail": [error, ...]}, so its schema still holds):
    the first REPORTED_ERRORS errors that fit REPLY_BYTES, their inputs cut short (or, where that
    is still too long, summarised), then one entry counting the errors left out. Each error is
    serialized alone: a reply never costs the event loop much more than its own bytes."""
    listed, size = [], 0
    for e in errors[:REPORTED_ERRORS]:
        room = REPLY_BYTES - 200 - size  # 200: left for the count
        text = _serialized(e, 0)
        if len(text) > room and "input" in e:
            text = _serialized(e, 1)
        if len(text) > room:
            break
        listed.append(text)
        size += len(text) + 2
    if len(errors) > len(listed):
        listed.append(json.dumps({"type": "too_many_errors", "loc": ["body"], "input": None,
                                  "msg": f"{len(errors) - len(listed)} {'more ' if listed else ''}errors not listed"}))
    return '{"detail": [' + ", ".join(listed) + "]}"


def _serialized(error: dict, depth: int) -> str:
    return json.dumps(jsonable_encoder({**error, "input": _brief(error["input"], depth)} if "input" in error else error),
                      ensure_ascii=True)


def _brief(value, depth: int = 0):
    """A request's value as an error echoes it: strings (dict keys too: a 1 MB key had been echoed
    whole, once per member of the input's union) cut at ECHOED_CHARS; a list or object echoed
    item by item only at the top and only up to ECHOED_ITEMS items, else summarised."""
    if isinstance(value, str):
        return value if len(value) <= ECHOED_CHARS else f"{value[:ECHOED_CHARS]}... ({len(value)} characters)"
    if isinstance(value, (list, tuple, dict)):
        if depth or len(value) > ECHOED_ITEMS:
            return f"({type(value).__name__} of {len(value)} items)"
        if isinstance(value, dict):
            return {_brief(k, 1): _brief(v, 1) for k, v in value.items()}
        return [_brief(v, 1) for v in value]
    return value
