"""embedserve.logs: LOG_FORMAT=json makes every line of a process JSON, a library's own handler
and Python's warnings included; the default (text, no ACCESS_LOG) logs a refused request once,
with the trace id of the caller's traceparent, and a served one not at all; levels say refused
(INFO) from failed (WARNING). JSON lines of real servers in both modes: test_traces_and_logs.py."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve import logs


def test_json_makes_every_line_of_the_process_json():
    """A library that logs through a handler of its own (transformers' does not propagate), a
    warning, an exception's traceback, a request line's fields: each one JSON object a line."""
    script = textwrap.dedent("""
        import logging, warnings
        from embedserve import logs
        logs.configure("json", "INFO", process="frontend")
        library = logging.getLogger("library")
        library.propagate = False
        library.addHandler(logging.StreamHandler())
        library.warning("from a handler of its own: %d", 1)
        warnings.warn("a warning")
        try:
            1 / 0
        except ZeroDivisionError:
            logging.getLogger("embedserve.x").exception("it failed")
        logs.request_line({"rpc": "Embed"}, "RESOURCE_EXHAUSTED", 0.0012, "overloaded " * 100, "ab" * 16, logging.INFO)
        logging.getLogger("embedserve.x").debug("below the level")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines()]  # each line JSON, or this fails
    assert [(x["logger"], x["level"]) for x in lines] == [
        ("library", "WARNING"), ("py.warnings", "WARNING"), ("embedserve.x", "ERROR"), ("embedserve.requests", "INFO")]
    assert lines[0]["message"] == "from a handler of its own: 1" and lines[0]["process"] == "frontend"
    assert "ZeroDivisionError" in lines[2]["exc"] and lines[2]["message"] == "it failed"
    request = lines[3]
    assert (request["rpc"], request["status"], request["trace_id"], request["duration_ms"]) == (
        "Embed", "RESOURCE_EXHAUSTED", "ab" * 16, 1.2)
    assert len(request["reason"]) == logs.REASON_CHARS  # bounded, whatever a message echoes
    assert request["time"].endswith("Z") and "T" in request["time"]


@pytest.mark.parametrize("status, level", [(200, None), (404, logging.INFO), (422, logging.INFO), (429, logging.INFO),
                                           (500, logging.WARNING), (503, logging.WARNING)])
def test_http_levels(status, level, monkeypatch):
    monkeypatch.setattr(logs, "access", False)
    assert logs.http_level(status) == level
    assert logs.http_level(500, bug=True) == logging.ERROR
    monkeypatch.setattr(logs, "access", True)
    assert logs.http_level(200) == logging.INFO


@pytest.mark.parametrize("code, level", [("OK", None), ("CANCELLED", None), ("INVALID_ARGUMENT", logging.INFO),
                                         ("RESOURCE_EXHAUSTED", logging.INFO), ("UNAUTHENTICATED", logging.INFO),
                                         ("FAILED_PRECONDITION", logging.INFO), ("UNAVAILABLE", logging.WARNING),
                                         ("INTERNAL", logging.WARNING)])
def test_grpc_levels(code, level, monkeypatch):
    monkeypatch.setattr(logs, "access", False)
    assert logs.grpc_level(code) == level


def test_by_default_a_refusal_logs_one_text_line_with_the_callers_trace_id_and_a_served_request_none(default_server):
    trace_id = "5ce0e9a56015fec5aadfa328ae398115"
    metadata = (("traceparent", f"00-{trace_id}-7f2c1a0b3d4e5f60-01"),)
    with grpc.insecure_channel(default_server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        stub.Embed(pb.EmbedRequest(texts=["served, not logged"]), metadata=metadata)
        with pytest.raises(grpc.RpcError):
            stub.Embed(pb.EmbedRequest(texts=["refused", ""]), metadata=metadata)
    deadline = time.monotonic() + 10
    while not (lines := [x for x in default_server.log().splitlines() if trace_id in x]):
        assert time.monotonic() < deadline, "no line for the refused request"
        time.sleep(0.05)
    assert len(lines) == 1, lines  # the served request (answered first) wrote none
    assert " INFO embedserve.requests: Embed INVALID_ARGUMENT in " in lines[0]
    assert lines[0].endswith(f"texts[1] is empty or whitespace only (trace {trace_id})")


def test_json_holds_from_the_first_line_with_keys_and_tls_and_a_plain_text_caller(tmp_path):
    """The start-up's own file checks warn in JSON (they once ran before the format was set up),
    and gRPC's C core, which writes past our handler, writes nothing for a plain-text caller at
    the TLS port (it had written one line per failed handshake)."""
    import socket

    from tests.conftest import ServerProcess
    from tests.server.mounted_secret import Pki

    files = Pki(tmp_path).server_files()
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_bytes(files[name])
    (tmp_path / "keys").write_text("key-one,key-two\n")  # one key with a comma: warned of, by line
    server = ServerProcess({"MODEL_PATH": "sim:50000", "LOG_FORMAT": "json", "API_KEYS_FILE": str(tmp_path / "keys"),
                            "TLS_CERT_FILE": str(tmp_path / "tls.crt"), "TLS_KEY_FILE": str(tmp_path / "tls.key")})
    try:
        server.wait_ready()
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5) as plain:
                plain.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0" * 64)
                plain.settimeout(5)
                try:
                    plain.recv(100)  # the server's TLS alert, or its close
                except OSError:
                    pass
    finally:
        assert server.stop() == 0
    lines = [line for line in server.log().splitlines() if line.strip()]
    not_json = [line for line in lines if not line.startswith("{")]
    assert not not_json, not_json[:5]
    records = [json.loads(line) for line in lines]
    assert any(re.search(r"API_KEYS_FILE .*lines? 1\b.*comma", r["message"]) for r in records), records[:5]
    assert not any("key-one" in line or "key-two" in line for line in lines)


def test_refusal_lines_are_bounded_per_second_and_what_is_left_out_is_counted(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(logs, "refusals", logs.PerSecond(3, clock=lambda: now[0]))
    caplog.set_level(logging.INFO, logger="embedserve.requests")
    refuse = lambda: logs.request_line({"rpc": "Embed"}, "RESOURCE_EXHAUSTED", 0.001, "overloaded", "", logging.INFO)
    for _ in range(10):
        refuse()
    logs.request_line({"rpc": "Embed"}, "INTERNAL", 0.001, "model failed", "", logging.WARNING)  # failures: always
    assert [r.levelno for r in caplog.records] == [logging.INFO] * 3 + [logging.WARNING]
    now[0] += 1.0
    refuse()
    assert caplog.records[-2].getMessage().startswith("7 more refused requests were not logged")
    assert "overloaded" in caplog.records[-1].getMessage()


# A forged record: what a caller would make a reader see as a line of its own.
FORGED = "2026-01-01 00:00:00,000 ERROR embedserve: forged by the caller"
BREAKS = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


def record_starts(text: str) -> list[str]:
    """The lines a reader takes for records: every line (as str.splitlines splits, which breaks at
    more than a newline) that does not start with the text format's continuation indent."""
    return [line for line in text.splitlines() if not line.startswith(logs.CONTINUATION)]


def test_no_caller_string_breaks_a_text_or_json_line_apart():
    """A path, a message echoing input, an exception message: each line break escaped in the text
    format (a traceback's further lines indented), and none left raw in JSON."""
    script = textwrap.dedent("""
        import logging, sys
        from embedserve import logs
        logs.configure(sys.argv[1], "INFO")
        breaks, forged = sys.argv[2].split("|"), sys.argv[3]
        for b in breaks:
            logs.request_line({"method": "GET", "route": "/x" + b + forged}, 404, 0.001, "Not Found", "", logging.WARNING)
            logging.getLogger("embedserve.x").warning("model %r, text %s", "m" + b + forged, "t" + b + forged)
            try:
                raise ValueError("bad input" + b + forged)
            except ValueError:
                logging.getLogger("embedserve.x").exception("failed on %s", b + forged)
    """)
    for fmt in ("text", "json"):
        out = subprocess.run([sys.executable, "-c", script, fmt, "|".join(BREAKS), FORGED], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        if fmt == "json":
            lines = out.stderr.splitlines()
            records = [json.loads(line) for line in lines]  # each line a whole object
            assert len(records) == 3 * len(BREAKS)
            assert [r["route"] for r in records[::3]] == ["/x" + b + FORGED for b in BREAKS]  # the data kept as sent
            continue
        starts = record_starts(out.stderr)
        assert len(starts) == 3 * len(BREAKS), starts
        assert not [line for line in out.stderr.splitlines() if line.startswith(FORGED)]
        assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (WARNING|ERROR) embedserve", s) for s in starts)
        assert f"GET /x\\n{FORGED} 404 in" in starts[0]  # escaped, readable
        assert f"'m\\\\u2028{FORGED}'" in out.stderr  # repr escapes it (its backslash doubled); the formatter the rest


def test_a_request_line_bounds_the_callers_path_and_method(caplog):
    caplog.set_level(logging.INFO, logger="embedserve.requests")
    logs.request_line({"method": "M" * 1000, "route": "/" + "p" * 10_000}, 404, 0.001, "", "", logging.WARNING)
    (record,) = caplog.records
    assert len(record.route) == logs.ROUTE_CHARS and len(record.method) == logs.METHOD_CHARS


@pytest.mark.parametrize("frontends", ["1", "2"])
def test_a_path_with_a_line_break_is_one_line_in_a_real_servers_log(frontends):
    """The text format (the default) on a real server, one process and FRONTENDS=2: a 404's path
    and, behind API keys, a 401's hold an encoded line break (uvicorn decodes %0A); neither
    starts a line of the log."""
    import urllib.error
    import urllib.request

    from tests.conftest import ServerProcess
    from tests.server.frontends.test_frontend import children, kill_front_ends

    server = ServerProcess({"MODEL_PATH": "sim:50000", "FRONTENDS": frontends, "API_KEYS": "right-key"}).wait_ready()
    fronts = children(server.proc.pid)
    forged = FORGED.replace(" ", "%20")
    try:
        for key, status in (("right-key", 404), ("wrong-key", 401)):
            request = urllib.request.Request(f"{server.http}/nowhere%0A{forged}%E2%80%A8{forged}",
                                             headers={"Authorization": f"Bearer {key}"})
            with pytest.raises(urllib.error.HTTPError) as answered:
                urllib.request.urlopen(request, timeout=10)
            assert answered.value.code == status
        deadline = time.monotonic() + 10
        while len(lines := [x for x in server.log().splitlines() if "/nowhere" in x]) < 2:
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.05)
    finally:
        server.stop()
        kill_front_ends(fronts)
    assert not [line for line in server.log().splitlines() if "forged by the caller" in line and not "/nowhere" in line]
    assert sorted(line.split(" /nowhere")[0].rsplit(" ", 1)[-1] for line in lines) == ["GET", "GET"]
    # Escaped where it reaches the line (the routed 404's path, read through Starlette's URL, has
    # lost its newline to urllib's parsing; the 401's is the path as uvicorn decoded it).
    assert all(f"{FORGED}\\u2028{FORGED} 40" in line for line in lines), lines
    assert any(f"/nowhere\\n{FORGED}" in line for line in lines), lines


def test_an_exception_message_stays_one_line_and_a_typed_backslash_is_not_an_escape():
    """The text format: an exception's message that echoes input (a line break and a fake frame
    in it) stays the exception's one line of the traceback, escaped, instead of adding indented
    lines a reader takes for the traceback's; and a backslash a caller typed is doubled, so
    `\\n` in the log is always an escaped newline, never the two characters typed."""
    import io

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.TextFormatter(logs.TEXT_FORMAT.format(process="")))
    logger = logging.getLogger("embedserve.test-one-line")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise ValueError('bad input\n  File "forged.py", line 1, in <module>\\n')
        except ValueError:
            logger.exception("typed %s, broken %s", "a\\nb", "a\nb")
    finally:
        logger.removeHandler(handler)
    first, *rest = out.getvalue().splitlines()
    assert first.endswith("typed a\\\\nb, broken a\\nb")
    assert rest[0] == logs.CONTINUATION + "Traceback (most recent call last):"
    assert rest[-1] == logs.CONTINUATION + 'ValueError: bad input\\n  File "forged.py", line 1, in <module>\\\\n'
    assert not [line for line in rest if line.lstrip().startswith('File "forged.py"')]  # no frame of its own
