"""Log lines: their format for every line of a process (LOG_FORMAT: text, or json, one object per
line), and the one line a request ends with: always when it was refused or failed, and when it
was served only with ACCESS_LOG.

Levels by what the operator should do: a refusal (4xx, 429, RESOURCE_EXHAUSTED, INVALID_ARGUMENT,
UNAUTHENTICATED, ...) is the server doing its job, at INFO, and under overload there may be
thousands a second (LOG_LEVEL=WARNING drops them, metrics still count them); a failure (5xx,
UNAVAILABLE, INTERNAL) at WARNING; a bug (an exception no transport maps) at ERROR. A request line
never holds a request's texts or its credentials: what it names is the route or RPC, its status,
the message the caller was answered with, and its trace id.

A line is one record, whatever a caller sent. Paths, methods, metadata, model names and messages
that echo input reach log lines, and a caller's line break would forge a record of its own. So in
the text format a record's message has every character that breaks a line (C0 and C1 controls,
U+2028, U+2029; what str.splitlines and terminals honour) escaped, `\\n` for a newline (a
backslash doubled, so what a caller typed as `\\n` reads `\\\\n`), and the lines a record needs
beyond its first (a traceback's frames; an exception's message stays one line, escaped) are
indented: a line that starts at column 0 is a record's own start. JSON escapes what json.dumps
leaves raw of those (DEL, C1, U+2028, U+2029), and is the format for a collector that parses
lines: each record one object, its strings exact."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import traceback

REQUESTS = logging.getLogger("embedserve.requests")
access = False  # ACCESS_LOG: a line per served request too
REASON_CHARS = 512  # a message may echo what the caller sent: the line stays bounded
ROUTE_CHARS = 256  # an unrouted path is the caller's choice (a 404's, a 401's), and so is its length
METHOD_CHARS = 64
# The fields a request line adds to its record (`extra`), in the order a JSON line lists them.
REQUEST_FIELDS = ("rpc", "method", "route", "status", "reason", "trace_id", "duration_ms")
_REFUSED, _FAILED = logging.INFO, logging.WARNING


# What breaks a line for some reader: C0 controls but tab, DEL, C1 controls (U+0085 is NEL), and
# the Unicode line and paragraph separators (str.splitlines splits on \x0b, \x0c, \x1c-\x1e too);
# and the backslash, escaped too, so that an escaped newline (\n) is never what a caller typed.
_BREAKING = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\\\\]")
_BREAKS_ONLY = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\\": "\\\\"}
_JSON_RAW = str.maketrans({c: f"\\u{c:04x}" for c in [*range(0x7f, 0xa0), 0x2028, 0x2029]})
CONTINUATION = "    "  # before each further line of a record (a traceback's)


def _escaped(match: re.Match) -> str:
    c = match.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def one_line(text: str) -> str:
    """`text` with every character that could break a line escaped (a newline as \\n), and each
    backslash doubled: unescaping gives the text back."""
    return _BREAKING.sub(_escaped, text) if _BREAKING.search(text) else text


class TextFormatter(logging.Formatter):
    """The text format: a record's message on its own line whatever it holds (`one_line`), and a
    traceback's lines indented by CONTINUATION. Within a traceback, the lines of an exception's
    message (and of its notes) are escaped as a message is: a caller's text echoed there stays on
    the exception's line instead of adding indented lines of its own to the traceback."""

    def formatException(self, ei) -> str:
        chunks = traceback.TracebackException(*ei[:3], compact=True).format()
        return "".join(c if _structural(c) else one_line(c[:-1] if c.endswith("\n") else c) + "\n"
                       for c in chunks).rstrip("\n")

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        record.message = one_line(message)
        try:
            return super().formatMessage(record)
        finally:
            record.message = message

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if "\n" not in text:
            return text
        first, *rest = text.split("\n")
        # The further lines' breaks but the newline (a traceback's own lines, a stack's): escaped,
        # their backslashes kept (file paths; what a caller wrote formatException escaped already).
        return "\n".join([first, *(CONTINUATION + _BREAKS_ONLY.sub(_escaped, line) for line in rest)])


def _structural(chunk: str) -> bool:
    """A chunk of traceback.TracebackException.format() that Python writes itself (its header, a
    frame with its source line, a chain's "The above exception ..."), as against an exception's
    message or note, which a caller's input may fill."""
    return chunk.startswith(("Traceback (", "  File ", "  [Previous line repeated", "\n", "    "))


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ms), level, logger, message, the request fields a
    record has, `process` ("frontend" in a front end), and `exc`, the traceback, when it has one.
    Cheap: one dict and one json.dumps a line."""

    def __init__(self, process: str = ""):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = record.__dict__
        for key in REQUEST_FIELDS:
            if key in fields:
                line[key] = fields[key]
        if self.process:
            line["process"] = self.process
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = record.stack_info
        # ensure_ascii=False keeps text readable, and leaves DEL, C1 controls (NEL), U+2028 and U+2029 raw.
        return json.dumps(line, ensure_ascii=False, default=str).translate(_JSON_RAW)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s{process}: %(message)s"


def configure(log_format: str, level: str, process: str = "") -> None:
    """Every line of this process in `log_format` ("text" or "json") at `level`; `process` names
    a front end's lines. JSON: also the lines of libraries that set up handlers of their own
    without a formatter (transformers does), and Python's warnings."""
    root = logging.getLogger()
    for handler in list(root.handlers):  # a second call (a front end's, after its start-up) replaces the first
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        formatter: logging.Formatter = JsonFormatter(process)
        # A handler without a formatter formats with the logging module's default; which has no
        # public setter. Libraries that log through a handler of their own (transformers' root
        # logger does not propagate) then write JSON too.
        logging._defaultFormatter = formatter  # type: ignore[attr-defined]
        logging.captureWarnings(True)
    else:
        formatter = TextFormatter(TEXT_FORMAT.format(process=f"[{process}]" if process else ""))
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Neither format shows where a line was logged from, or the thread and process: not looked up
    # for every record (the logging HOWTO's "Optimization"; a stack walk per line otherwise).
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False


def setup(settings, level: str, process: str = "") -> None:
    """LOG_FORMAT and ACCESS_LOG as the settings say."""
    global access
    configure(settings.log_format, level, process)
    access = settings.access_log


class PerSecond:
    """At most `limit` refusal lines a second: under overload a process refuses thousands of
    requests a second, and writing a line for each (synchronously, on the event loop that serves
    them) would cost the loop time and flood the node's log pipeline with one message. What is
    left out is counted and said in one line when the next second's first refusal is logged;
    the metrics count every refusal."""

    def __init__(self, limit: int, clock=time.monotonic):
        self.limit, self.clock = limit, clock
        self.window = -1.0
        self.logged = self.skipped = 0

    def take(self) -> int | None:
        """None: leave this line out; else how many were left out before it (0: none)."""
        now = self.clock()
        if now - self.window >= 1.0:
            self.window, self.logged = now, 0
        if self.logged >= self.limit:
            self.skipped += 1
            return None
        self.logged += 1
        skipped, self.skipped = self.skipped, 0
        return skipped


REFUSAL_LINES_PER_S = 50
refusals = PerSecond(REFUSAL_LINES_PER_S)


def request_line(what: dict, status: str | int, duration_s: float, reason: str, trace_id: str, level: int) -> None:
    """One request's line: `what` names it ({"rpc": "Embed"} or {"method": "POST", "route":
    "/v1/embeddings"}), `status` the gRPC code name or the HTTP status, `reason` the message it
    was answered with ("" when served). Refusals: at most REFUSAL_LINES_PER_S a second. The
    caller's strings in it are cut (REASON_CHARS, ROUTE_CHARS, METHOD_CHARS); the formatters keep
    them on the line."""
    if not REQUESTS.isEnabledFor(level):
        return
    if level == _REFUSED and reason:
        skipped = refusals.take()
        if skipped is None:
            return
        if skipped:
            REQUESTS.log(_REFUSED, "%d more refused requests were not logged (at most %d lines a second; "
                         "embedfleet_requests_total counts every one)", skipped, REFUSAL_LINES_PER_S)
    reason = reason[:REASON_CHARS]
    if "route" in what:
        what = {**what, "route": what["route"][:ROUTE_CHARS], "method": what.get("method", "")[:METHOD_CHARS]}
    duration_ms = round(duration_s * 1000, 3)
    name = what.get("rpc") or f"{what.get('method', '')} {what.get('route', '')}"
    text = f"{name} {status} in {duration_ms:.1f} ms"
    if reason:
        text += f": {reason}"
    if trace_id:
        text += f" (trace {trace_id})"
    REQUESTS.log(level, text, extra={**what, "status": status, "reason": reason, "trace_id": trace_id,
                                     "duration_ms": duration_ms})


# gRPC codes that say the server failed, not that it refused: WARNING.
FAILED_GRPC = frozenset(("INTERNAL", "UNKNOWN", "DATA_LOSS", "UNAVAILABLE", "DEADLINE_EXCEEDED", "UNIMPLEMENTED"))


def grpc_level(code: str, bug: bool = False) -> int | None:
    """The level of a finished RPC's line (None: no line: served, or cancelled by its caller,
    without ACCESS_LOG)."""
    if bug:
        return logging.ERROR
    if code == "OK" or code == "CANCELLED":
        return logging.INFO if access else None
    return _FAILED if code in FAILED_GRPC else _REFUSED


def http_level(status: int, bug: bool = False) -> int | None:
    """The level of a finished HTTP request's line (None: no line)."""
    if bug:
        return logging.ERROR
    if status < 400:
        return logging.INFO if access else None
    return _FAILED if status >= 500 else _REFUSED
