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
