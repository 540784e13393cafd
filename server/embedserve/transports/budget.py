"""Every HTTP route within one budget (DESIGN.md, "Every route within one budget"): what a
request body may hold, checked before anything is parsed, so that no body, with or without a
key, stalls the event loop long enough to starve the probes (kubelet: 3 s, twice) or grows the
process by much more than its own size. The replies' bound is MAX_REPLY_BYTES (json_reply.py,
encodings.reply_bytes); gRPC's requests have theirs in grpc_budget.py.

Two bounds per route, named from what the model can use:
- bytes: MAX_TEXTS_PER_REQUEST texts (and a query) of twice the model's max_length ×
  CHARS_PER_TOKEN_BOUND characters, where texts are cut before tokenizing anyway (see
  TEXT_BYTES_PER_CHAR); or, for /decode, as many token ids as a request can embed;
- JSON items (array elements and object members, counted outside strings): a route of texts uses
  a few per text; a route of token ids (/v1/embeddings, /decode) as many as a request can embed,
  MAX_TEXTS_PER_REQUEST × max_length, at most MAX_IDS. The parser makes an object per item (a
  list, an int, a string: ~60-70 bytes and 0.1-0.3 µs each, more with the collections they set
  off), and only an item count bounds that: 33 MB of `[],` had been 740 MiB and 2.3 s of the loop
  inside json.loads, before any schema could refuse it.
A path not listed (a route added without naming its own budget, another task's path, a GET)
gets DEFAULT: a short JSON body. Over either bound: 413, naming the bound, before parsing.

Counting items costs three passes of bytes.count (~1-2 ms a MB) where commas and brackets alone
stay under the bound; past it (commas inside texts) the strings are skipped exactly: escapes
removed, then quote parity in numpy, whose loops run off the GIL on a thread."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Callable

import numpy as np

from embedserve.config import CHARS_PER_TOKEN_BOUND

# Body bytes a text may take: twice the characters the tokenizer reads of it. ASCII, where a token
# spans the most characters, is a byte a character; a script of a token or two a character (CJK,
# escaped as \uXXXX: 6 bytes) is read far past what the model keeps long before this. Bytes past
# it only cost the event loop (12.7 MB at 6 bytes a character: 135 ms of json.loads on a loaded
# 2-core host, for a number of 12.7 M digits) for characters no row depends on.
TEXT_BYTES_PER_CHAR = 2
ID_BYTES = 12  # "2147483647, " : one token id as JSON writes it, a separator and a space
OVERHEAD_BYTES = 64 * 1024  # the other fields of a body, and room for whitespace
# Token ids a request may send, whatever the model's max length (a long-context model's 512 × 8,192
# would be 4.2 M: ~0.9 s of the loop in json.loads): as many as 512 rows of 512.
MAX_IDS = 512 * 512
# A refused body's remainder read and dropped before the answer, at most this much and this long: a
# server that answers and closes with the body unread has its kernel send a reset, which can reach
# the caller before the answer does, and the caller sees "connection reset", not the 413 or 404
# (nginx's lingering close, Go's net/http read the remainder for the same reason). Past either, the
# connection is closed all the same.
DISCARD_BYTES = 32 * 2**20
DISCARD_S = 10.0
THREAD_BYTES = 1 << 20  # an exact count of a longer body runs on a thread (numpy drops the GIL)
_CHUNK = 1 << 22  # the exact count's numpy pass, this much at a time (memory: ~4 bytes per byte of it)


@dataclasses.dataclass(frozen=True)
class Budget:
    body_bytes: int  # the most a body may hold (413 above)
    items: int  # the most JSON items (elements and members) outside strings (413 above)


DEFAULT = Budget(OVERHEAD_BYTES, 1024)


def route_budgets(text_paths: frozenset[str], id_paths: frozenset[str], max_texts: int, max_length: int,
                  body_cap: int, texts_and_ids: frozenset[str] = frozenset(), text_tokens: int = 0) -> dict[str, Budget]:
    """Each body route's budget: `text_paths` take texts, `id_paths` only token ids (/decode),
    `texts_and_ids` either (/v1/embeddings); `max_length` the model's (tokens per text),
    `body_cap` HTTP_MAX_BODY_BYTES, the most any route reads; `text_tokens` the most tokens a
    text is read for, when more than max_length (MAX_TOKENS_PER_TEXT, windowed texts). Pure."""
    fields = 4 * max_texts + 256  # per text a few (an object's member, a row's brackets), and the request's fields
    ids = min(max_texts * max_length, MAX_IDS)
    # A windowed text read further (MAX_TOKENS_PER_TEXT) fits a body alone; the bound stays the
    # same otherwise: bodies past it hold the loop in json.loads (TEXT_BYTES_PER_CHAR).
    text_bytes = min(body_cap, max((max_texts + 1) * max_length, text_tokens) * CHARS_PER_TOKEN_BOUND * TEXT_BYTES_PER_CHAR
                     + OVERHEAD_BYTES)
    id_bytes = min(body_cap, ids * ID_BYTES + OVERHEAD_BYTES)
    budgets = {path: Budget(text_bytes, fields) for path in text_paths}
    budgets.update({path: Budget(id_bytes, ids + fields) for path in id_paths})
    budgets.update({path: Budget(max(text_bytes, id_bytes), ids + fields) for path in texts_and_ids})
    return budgets


def json_items(body: bytes, limit: int) -> int:
    """Items (array elements and object members) of a JSON text, counted outside its strings: at
    most, and exactly once commas and brackets alone exceed `limit`. A count over `limit` may be
    returned as soon as it is known to be over. Pure; not a validator (an invalid text is the
    parser's to refuse, and it stops where it fails, before making more than this counts)."""
    rough = body.count(b",") + body.count(b"[") + body.count(b"{")  # strings' own included: an upper bound
    if rough <= limit:
        return rough
    # Escapes out (an escaped backslash first, so `\\"` stays a string's end), then every quote
    # left opens or closes a string.
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    if text.count(b'"') // 2 > 2 * limit + 1:  # every string is a member or a member's key
        return limit + 1
    codes = np.frombuffer(text, dtype=np.uint8)
    count, inside = 0, 0
    for start in range(0, len(codes), _CHUNK):
        chunk = codes[start:start + _CHUNK]
        parity = np.bitwise_xor.accumulate((chunk == ord('"')).view(np.uint8)) ^ inside
        inside = int(parity[-1])
        outside = chunk[parity == 0]
        count += int(np.count_nonzero(outside == ord(",")) + np.count_nonzero(outside == ord("["))
                     + np.count_nonzero(outside == ord("{")))
        if count > limit:
            break
    return count


def _too_large(message: str, status: int) -> bytes:
    code = "request_too_large" if status == 413 else "request_timeout"
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}}).encode()


def discardable(scope) -> bool:
    """Whether a refused request's body is worth reading to drop (DISCARD_BYTES: why): it has one;
    its caller is not waiting for a 100 Continue to send it (then little or nothing was sent, and
    reading would ask for all of it); it fits DISCARD_BYTES (past that the reset comes anyway)."""
    headers = dict(scope["headers"])
    if headers.get(b"expect", b"").lower() == b"100-continue":
        return False
    length = headers.get(b"content-length")
    if length is not None:
        return length.isdigit() and 0 < int(length) <= DISCARD_BYTES
    return b"transfer-encoding" in headers


async def discard_body(receive, most: int = DISCARD_BYTES, within_s: float = DISCARD_S) -> None:
    """Read the rest of a request's body and drop it, `most` bytes and `within_s` seconds at most
    (DISCARD_BYTES: why); memory: one chunk at a time."""
    read = 0
    try:
        async with asyncio.timeout(within_s):
            while read <= most:
                message = await receive()
                read += len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
    except TimeoutError:
        return


class BodyBudget:
    """ASGI middleware: a request's body against its route's Budget (`budgets()`: path → Budget,
    filled as the model's routes are installed; DEFAULT for any other path), read whole and
    counted before the app parses it, then handed on as one piece. A refusal is a 413 in the
    API's error shape; `refused(scope, message)` notes why (its log line and span)."""

    def __init__(self, app, budgets: Callable[[], dict[str, Budget]], refused: Callable[[dict, str], None],
                 read_s: float = 60.0, body_cap: int = DISCARD_BYTES):
        """`read_s` (HTTP_BODY_TIMEOUT_S): a body not read whole by then is refused (408).
        `body_cap` (HTTP_MAX_BODY_BYTES): the most any path reads, DEFAULT's included (the route
        budgets are cut to it already). Starlette's own limit is not used: it answers on the
        Content-Length and closes with the body unread (DISCARD_BYTES: why that loses the answer)."""
        self.app, self.budgets, self.refused, self.read_s = app, budgets, refused, read_s
        self.default = Budget(min(DEFAULT.body_bytes, body_cap), DEFAULT.items)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)  # our GET routes read no body
        budget = self.budgets().get(scope["path"], self.default)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > budget.body_bytes:
            if discardable(scope):
                await discard_body(receive)
            return await self._refuse(scope, send, f"the body has {int(length)} bytes, more than this route "
                                      f"reads ({budget.body_bytes}: docs/api.md, Limits)")
        # One growing buffer, not a list of the chunks as they came: 2-byte chunks had been an object
        # of ~40 bytes each. And a deadline: a caller trickling its body holds its slot no longer.
        data, deadline = bytearray(), asyncio.get_running_loop().time() + self.read_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                return await self._refuse(scope, send, f"the body was not sent whole within {self.read_s:g} s "
                                          "(HTTP_BODY_TIMEOUT_S)", status=408)
            if message["type"] == "http.disconnect":
                return  # gone before its body was read: nothing to answer
            data += message.get("body", b"")
            if len(data) > budget.body_bytes:
                del data
                if message.get("more_body", False):
                    await discard_body(receive)
                return await self._refuse(scope, send, f"the body has more than {budget.body_bytes} bytes, "
                                          "the most this route reads (docs/api.md, Limits)")
            if not message.get("more_body", False):
                break
        body = bytes(data)
        del data
        if len(body) > THREAD_BYTES:
            items = await asyncio.to_thread(json_items, body, budget.items)
        else:
            items = json_items(body, budget.items)
        if items > budget.items:
            return await self._refuse(scope, send, f"the body holds more than {budget.items} JSON items (array "
                                      "elements and object members outside strings), the most this route uses "
                                      "(docs/api.md, Limits)")
        if len(body) > THREAD_BYTES:
            await asyncio.sleep(0)  # the loop's turn between the count and the parse, each up to tens of ms
        handed = False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        return await self.app(scope, replay, send)

    async def _refuse(self, scope, send, message: str, status: int = 413) -> None:
        self.refused(scope, message)
        body = _too_large(message, status)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})  # a body past DISCARD_BYTES is not read whole
        await send({"type": "http.response.body", "body": body})
