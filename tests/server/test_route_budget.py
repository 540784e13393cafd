"""Every route and RPC within one budget, as a property (DESIGN.md, "Every route within one
budget"): on real processes of every task, in one process and with FRONTENDS=2, every HTTP route
of the app (walked from the app the server builds, so a route added later is covered without
being listed) and every RPC of every gRPC service (from the descriptors) is sent its worst
bodies within the limits: what its own schema allows at its largest (most rows × longest rows,
one-character texts, truncate false, the largest ids and dimensions), and what no schema allows
but a parser must read (empty containers, nesting, repeated keys, long numbers, commas in texts).
Throughout:
- the metrics port answers /health within MAX_PROBE_S (kubelet's readiness probe: 3 s, twice);
- no request stalls an event loop more than MAX_STALL_S (each serving process's own lag probe,
  embedfleet_event_loop_lag_seconds);
- the peak RSS of each process (with FRONTENDS, the front ends and the model process each) grows
  by at most 8 × the body + 2 × MAX_REPLY_BYTES + 64 MiB;
- every answer is a clear one (no 5xx, no INTERNAL or UNKNOWN), and the server serves on."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from embedfleet.v1 import inference_pb2 as pb
from embedserve.config import CHARS_PER_TOKEN_BOUND, Settings, text_tokens
from embedserve.transports import budget, http_api
from tests.conftest import ServerProcess
from tests.server.frontends.test_frontend import children, kill_front_ends
from tests.server.routes import SHARED, TASKS, Fill, api_routes, hostile_bodies, schema_bodies

MAX_PROBE_S = 1.0
MAX_STALL_S = 0.25
MIB = 2**20
MAX_REPLY = Settings().max_reply_bytes
MODES = {"one process": {}, "FRONTENDS=2": {"FRONTENDS": "2"}, "LONG_TEXTS=window": {"LONG_TEXTS": "window"}}
# Batches big enough that 512 rows do not take many turns of a 2-core CPU.
CAPS = "16:64,32:64,64:64,128:32,256:16"
CLEAR = {200, 400, 404, 405, 413, 422}  # answers that say what happened (429/503 never come: admission is out of the way)


@pytest.fixture(scope="module")
async def routes():
    return await api_routes((*TASKS, "shared"))


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_dir) -> dict[str, dict]:
    """Each task's server: the simulated device for embeddings; tiny BERTs (random weights, the
    packaged tokenizer at max length 256) for the others."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from tests.server.model.multivector_models import build_colbert
    from tests.server.model.m3_models import build_m3
    from tests.server.model.llm_reranker_models import build as build_llm_rerankers
    from tests.server.model.sparse_models import build_splade

    root = tmp_path_factory.mktemp("budget-models")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.model_max_length = 256
    torch.manual_seed(0)
    out = {"embed": {"MODEL_PATH": "sim:5000000"}}
    for task, labels in (("classify", 3), ("rerank", 1)):
        config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=256, num_labels=labels)
        BertForSequenceClassification(config).eval().save_pretrained(root / task)
        tok.save_pretrained(root / task)
        out[task] = {"MODEL_PATH": str(root / task), "TASK": task}
    out["sparse"] = {"MODEL_PATH": build_splade(root / "sparse", model_dir), "TASK": "sparse"}
    out["multivector"] = {"MODEL_PATH": build_colbert(root / "multivector", model_dir, max_seq_length=256),
                          "TASK": "multivector"}
    out["bgem3"] = {"MODEL_PATH": build_m3(root / "bgem3"), "TASK": "bgem3"}
    # An LLM reranker (rerank's routes; its pairs are chat-template prompts, tokenized in front ends)
    out["llm_rerank"] = {"MODEL_PATH": build_llm_rerankers(root / "llm")["st"]}
    (dense, _), (ranker, _) = SHARED  # the simulated embedder and the tiny reranker on one device
    out["shared"] = {"MODELS": json.dumps([{"name": dense, "model": "sim:5000000"},
                                           {"name": ranker, "model": out["rerank"]["MODEL_PATH"], "task": "rerank"}])}
    return out


PROBER = """
import sys, time, urllib.request
url, slow = sys.argv[1], []
while not sys.stdin.closed:
    t0 = time.time()
    try:
        urllib.request.urlopen(url, timeout=5).read()
        took = time.time() - t0
    except Exception as e:
        took = 99.0
    if took > 0.2:
        print(f"{t0:.3f} {took:.3f}", flush=True)
    time.sleep(0.1)
"""


class ProbeWatch:
    """/health on the metrics port every 0.1 s on a new connection, as kubelet probes, from a
    process of its own (this one's GIL is busy building bodies): the probes slower than 0.2 s,
    each with when it began, so a slow one can be laid beside the request then in flight."""

    def __init__(self, url: str):
        self.proc = subprocess.Popen([sys.executable, "-c", PROBER, url + "/health"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.slow: list[tuple[float, float]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            began, took = line.split()
            self.slow.append((float(began), float(took)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()
        self._reader.join()

    def slowest(self, log: list[tuple[float, float, str]]) -> tuple[float, str]:
        """The slowest probe, and the requests in flight while it waited."""
        if not self.slow:
            return 0.0, ""
        began, took = max(self.slow, key=lambda p: p[1])
        during = [what for start, end, what in log if start < began + took and end > began]
        return took, "; ".join(during)


def _status_field(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def lag_counts(server: ServerProcess) -> tuple[float, float]:
    """(loop-lag observations, those over MAX_STALL_S), every serving process's (multiprocess: summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(server.metrics + "/metrics", timeout=10).read().decode()
    count = under = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "embedfleet_event_loop_lag_seconds_count":
                count += sample.value
            elif sample.name == "embedfleet_event_loop_lag_seconds_bucket" and float(sample.labels["le"]) == MAX_STALL_S:
                under += sample.value
    return count, count - under


class Budget:
    """Each request measured: its processes' peak RSS from a fresh start (clear_refs 5), the loop
    stalls it caused, its answer."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.pids = [server.proc.pid, *children(server.proc.pid)]
        self.probed, self.stalls = lag_counts(server)
        self.seen: list[str] = []
        self.largest = (0.0, "")  # the largest growth over its bound, and what caused it
        self.log: list[tuple[float, float, str]] = []  # (began, ended, what): wall clock, as the prober's

    def check(self, what: str, body_bytes: int, send) -> object:
        base = {}
        for pid in self.pids:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            base[pid] = _status_field(pid, "VmRSS")
        began = time.time()
        print(f"{began:.3f} {what}", flush=True)
        answer = send()
        self.log.append((began, time.time(), what))
        allowed = 8 * body_bytes + 2 * MAX_REPLY + 64 * MIB
        for pid in self.pids:
            grew = _status_field(pid, "VmHWM") - base[pid]
            assert grew <= allowed, f"{what}: process {pid} grew {grew / MIB:.0f} MiB (bound {allowed / MIB:.0f} MiB)"
            self.largest = max(self.largest, (grew / allowed, f"{what}: {grew / MIB:.0f} MiB"))
        probed, now = lag_counts(self.server)
        assert now == self.stalls, f"{what}: the event loop stalled over {MAX_STALL_S} s ({now - self.stalls} times)"
        if time.time() - began > 0.5:  # the probe ran meanwhile (every 25 ms): its silence is no proof
            assert probed > self.probed, f"{what}: the loop-lag probe did not run"
        self.probed = probed
        self.seen.append(what)
        return answer


def post(server: ServerProcess, path: str, body: bytes, method: str = "POST", chunk: int = 0,
         port: int = 0) -> tuple[int, bytes]:
    """One request on a connection of its own; the body sent on a thread while the answer is read,
    since a route that needs no body may answer (and close) before the body is all sent. `chunk`:
    sent with chunked transfer encoding, in pieces of that many bytes (each a message to the app)."""
    sock = socket.create_connection((server.host, port or server.http_port), timeout=120)
    length = "Transfer-Encoding: chunked" if chunk else f"Content-Length: {len(body)}"
    head = (f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"{length}\r\nConnection: close\r\n\r\n").encode()

    def send():
        try:
            if not chunk:
                return sock.sendall(head + body)
            sock.sendall(head)
            for start in range(0, len(body), 64 * chunk):  # 64 pieces a write: fewer system calls
                sock.sendall(b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in
                                      (body[i:i + chunk] for i in range(start, min(start + 64 * chunk, len(body)), chunk))))
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # answered and closed before the body was all sent
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        return response.status, response.read()
    finally:
        sender.join()
        sock.close()


def http_bodies(doc: dict, path: str, method: str, served: str, max_length: int, s: Settings | None = None,
                windowed: bool = False) -> dict[str, bytes]:
    """The bodies a route is sent: its schema's worst (when it takes one), and the hostile ones
    at the size and item count of its budget (every POST route: a route that reads no body
    ignores them, one that does meets the budget). `windowed`: a long_text field asks for windows
    (the schema's first value is "", the server's way), texts as long as a windowed one is read."""
    if method != "POST":
        return {"no body": b""}
    s = s or Settings.from_env({})
    own = "/" + (path.split("/", 3) + [""])[3] if path.startswith("/models/") else path  # a model's prefix: its path's
    limit = http_api.budgets(s, max_length).get(own, budget.DEFAULT)
    max_chars = max_length * CHARS_PER_TOKEN_BOUND
    fills = [("longest rows, escaped", "é", True, max_chars, 512), ("longest rows, truncate false", "!", False, max_chars, 512),
             ("longest rows, raw UTF-8", "\U0001F600", True, max_chars, 512), ("one-character texts", "a", True, 1, 512)]
    if windowed:  # and a text as long as a windowed one is read, a token a character (the rows above, from
        # there, would be built at 32 times their size first: seconds of this process, the server starved
        # meanwhile on a 2-core host; they are windowed too: 4,096 tokens each)
        fills.append(("a text of MAX_TOKENS_PER_TEXT's characters", "!", True, text_tokens(s, max_length) * CHARS_PER_TOKEN_BOUND, 1))
    out = {}
    for name, char, flag, chars, most in fills:
        # Texts as long as the route's bytes let the most rows be: halved until the body fits;
        # where that no longer shrinks it (rows of token ids), the rows and ids per row halved.
        fill, before = Fill(chars, char, flag, served, most), 0
        while (bodies := schema_bodies(doc, path, fill)) and (largest := max(map(len, bodies))) > limit.body_bytes:
            if fill.chars > 1 and largest != before:
                fill.chars //= 2
            elif fill.most > 1:
                fill.most //= 2
            else:
                break
            before = largest
        if windowed:
            bodies = [b.replace(b'"long_text": ""', b'"long_text": "window"') for b in bodies]
        for i, body in enumerate(bodies):
            if len(body) <= limit.body_bytes:
                out[f"schema: {name} #{i}"] = body
    out.update({f"hostile: {k}": v for k, v in hostile_bodies(limit.body_bytes, limit.items).items()})
    return out


def grpc_messages(method, max_texts: int, max_chars: int, limit: int, fixed: dict | None = None,
                  fixed_chars: int = 0) -> dict[str, bytes]:
    """An RPC's worst requests, from its input message's descriptor: every repeated string at
    MAX_TEXTS_PER_REQUEST texts of max_chars characters, and at one character each up to the
    message limit; strings at max_chars; bytes up to the limit; a packed repeated number of a
    million values; and a flood of unknown fields (which any message must skip). `fixed`: fields
    set so beside the longest texts, of `fixed_chars` characters, as many as the message holds
    (long_text "window": texts read to MAX_TOKENS_PER_TEXT)."""
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(method.input_type)
    fields = method.input_type.fields
    out = {"unknown fields": b"\xa0\x06\x01" * (limit // 3 - 1)}
    strings = [f for f in fields if f.type == f.TYPE_STRING]
    repeated = [f for f in strings if f.is_repeated]
    if strings:
        full = cls(**{f.name: (["é" * max_chars] * max_texts if f in repeated else "é" * max_chars) for f in strings})
        out["longest texts"] = full.SerializeToString()
        mine = {k: v for k, v in (fixed or {}).items() if k in method.input_type.fields_by_name}
        if mine and repeated:  # the longest texts with only the fixed fields beside them (not refused on the others)
            for what, text in (("é", "é" * fixed_chars), ("words", "a " * (fixed_chars // 2))):
                most = max(1, min(max_texts, (limit - 4096) // (len(text.encode()) + 8)))  # as many as the message holds
                out[f"longest texts ({what}), " + ", ".join(mine)] = cls(**{repeated[0].name: [text] * most},
                                                                       **mine).SerializeToString()
    for f in repeated:
        out[f"one-character {f.name}"] = cls(**{f.name: ["a"] * (limit // 3 - 16)}).SerializeToString()
    for f in fields:
        if f.type == f.TYPE_BYTES:
            out[f"{f.name} at the limit"] = cls(**{f.name: b"\x01\x00\x00\x00" * (limit // 4 - 64)}).SerializeToString()
        elif f.is_repeated and f.type in (f.TYPE_INT64, f.TYPE_INT32):
            out[f"a million {f.name}"] = cls(**{f.name: [7] * 1_000_000}).SerializeToString()
    return {k: v for k, v in out.items() if len(v) <= limit}


def largest_infer(max_texts: int, max_length: int, limit: int) -> bytes:
    """The largest valid Infer: MAX_TEXTS_PER_REQUEST rows as wide as the message allows."""
    seq = min(limit // (8 * max_texts) - 16, max_length * 64)
    ids = np.full((max_texts, seq), 1000, "<i4")
    return pb.InferRequest(input_ids=ids.tobytes(), attention_mask=np.ones_like(ids).tobytes(),
                           shape=[max_texts, seq]).SerializeToString()


GRPC_CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND}  # NOT_FOUND: health's unknown service


def call(channel: grpc.Channel, name: str, data: bytes) -> grpc.StatusCode:
    method = channel.unary_unary(name, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        method(data, timeout=120)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def services() -> list:
    """The unary methods of every service the server registers (a new service must be added to
    the reflection list that test_keys_and_tls checks, and so reaches this list)."""
    health = health_pb2.DESCRIPTOR.services_by_name["Health"]
    return [m for s in (pb.DESCRIPTOR.services_by_name["Inference"], health) for m in s.methods
            if not m.client_streaming and not m.server_streaming]


# Each task's server in one process; with front ends, an embedding server, a sparse one, a
# multi-vector one and a BGE-M3 one (the shapes of answer a front end gets from the model process:
# dense rows, CSR rows, token vectors, the three outputs of bgem3).
SERVERS = [(task, "one process") for task in ("embed", "classify", "rerank", "sparse", "multivector", "bgem3")] + \
    [("embed", "FRONTENDS=2"), ("sparse", "FRONTENDS=2"), ("multivector", "FRONTENDS=2"), ("bgem3", "FRONTENDS=2"),
     ("shared", "one process")] + \
    [("embed", "LONG_TEXTS=window"), ("llm_rerank", "FRONTENDS=2")]  # windows: texts read to MAX_TOKENS_PER_TEXT
# Servers of a model kind that answers another task's routes.
ROUTES_OF = {"llm_rerank": "rerank"}
# Routes with the same handler on every task's server (the tokenizer's, the docs, another task's
# refusals): sent their bodies once per mode, on the first server of that mode that runs.
covered: set[tuple[str, str, str, str]] = set()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("task,mode", SERVERS, ids=[f"{t}-{m}" for t, m in SERVERS])
def test_every_route_and_rpc_within_the_budget(task, mode, routes, models):
    server = ServerProcess({**models[task], **MODES[mode], "BATCH_CAPS": CAPS, "MAX_DRAIN_TIME_MS": "600000",
                            "RESERVATION_HORIZON_MS": "600000"}).wait_ready()
    fronts = children(server.proc.pid)
    try:
        health = server.health()[1]
        max_length, served = health["max_length"], json.loads(urllib.request.urlopen(
            server.http + "/v1/models", timeout=10).read())["data"][0]["id"]
        doc = json.loads(urllib.request.urlopen(server.http + "/openapi.json", timeout=10).read())
        s = Settings.from_env(MODES[mode])
        windowed = mode == "LONG_TEXTS=window"
        with ProbeWatch(server.metrics) as probes:
            measure = Budget(server)
            for path, method, endpoint in sorted(routes[ROUTES_OF.get(task, task)]):
                if (mode, path, method, endpoint) in covered:  # the same handler, on a server of this mode
                    continue
                covered.add((mode, path, method, endpoint))
                # A payload's `model`: the one whose prefix the path has (http_models), else the default.
                named = path.split("/")[2] if path.startswith("/models/") else served
                bodies = http_bodies(doc, path, method, named, max_length, s, windowed)
                # One of them in 16-byte chunks: a message to the app each, ~1.5 M for this body
                if method == "POST":
                    chunked = bodies["hostile: one-character strings, at the items"]
                    bodies["hostile: one-character strings, at the items, in 16-byte chunks"] = (chunked, 16)
                for name, body in bodies.items():
                    body, chunk = body if isinstance(body, tuple) else (body, 0)
                    status, reply = measure.check(f"{method} {path} {name}", len(body),
                                                  lambda: post(server, path, body, method, chunk))
                    assert status in CLEAR, (method, path, name, status, reply[:300])
                    assert len(reply) <= MAX_REPLY, (method, path, name, len(reply))
            # The metrics port reads no body: the largest hostile ones, to both its paths and another
            for path in ("/health", "/metrics", "/embed"):
                for name, body in list(hostile_bodies(12 * MIB, 2 * MIB).items())[:3]:
                    status, _ = measure.check(f"metrics port POST {path} {name}", len(body),
                                              lambda: post(server, path, body, "POST", port=server.metrics_port))
                    assert status == 404, (path, name, status)
            limit = s.max_message_bytes
            with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", -1),
                                                               ("grpc.max_receive_message_length", -1)]) as channel:
                for method in services():
                    name = f"/{method.containing_service.full_name}/{method.name}"
                    messages = grpc_messages(method, s.max_texts_per_request, max_length * CHARS_PER_TOKEN_BOUND, limit,
                                             {"long_text": "window"} if windowed else {},
                                             text_tokens(s, max_length) * CHARS_PER_TOKEN_BOUND)
                    if method.name == "Infer":
                        messages["largest valid"] = largest_infer(s.max_texts_per_request, max_length, limit)
                    for what, data in messages.items():
                        code = measure.check(f"{name} {what}", len(data), lambda: call(channel, name, data))
                        assert code in GRPC_CLEAR, (name, what, code)
        slowest, during = probes.slowest(measure.log)
        assert slowest < MAX_PROBE_S, f"a probe took {slowest:.2f} s, while: {during}"
        assert server.health()[0] == 200
        print(f"\n{task} {mode}: {len(measure.seen)} requests, slowest probe {slowest:.3f} s ({during}), "
              f"most grown {measure.largest[0]:.2f} of the bound ({measure.largest[1]})")
    finally:
        server.stop()
        kill_front_ends(fronts)
