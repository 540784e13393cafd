"""Shared test helpers: the packaged model, an independent reference encoder, and real server
processes started through the real entry point."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Servers the tests build from the environment (and the processes they start) measure their own
# warm-up: a warm-up file in the shared default MODEL_CACHE_DIR would carry one test's (or
# another checkout's) measurements into the next. The warm start's own tests turn it on with a
# directory of their own.
os.environ.setdefault("WARM_START", "false")

# Fixed caps skip the warm-up sweep (seconds on this CPU); the sweep has its own tests.
TEST_BATCH_CAPS = "16:8,32:8,64:8,128:8,256:4,512:2"
# The warm-up still runs every bucket's cap at least twice: one row a batch is the shortest, for a
# server whose test sends single texts or does not look at how rows share batches.
ONE_ROW_CAPS = "16:1,32:1,64:1,128:1,256:1,512:1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pod_addresses(port: int, count: int = 1) -> list[str]:
    """`count` loopback addresses (127.a.x.y, in a random /16) on each of which `port` is free:
    stand-ins for pods, which all serve one fixed port at addresses of their own (as the API port,
    8001, where the operator reads an unguarded service's health). Random, so that tests run in
    parallel elsewhere on this machine do not meet; a port held on every address (a listener on
    0.0.0.0) fails here, saying so."""
    import random

    def free(address: str) -> bool:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            try:
                s.bind((address, port))
            except OSError:
                return False
        return True

    for _ in range(20):
        net = random.randint(1, 254)
        addresses = [f"127.{net}.{i // 250}.{1 + i % 250}" for i in range(count)]
        if all(map(free, addresses)):
            return addresses
    raise RuntimeError(f"port {port} is taken on every loopback address tried: is something listening on 0.0.0.0:{port}?")


class ServerProcess:
    """`python -m embedserve` on loopback ports; `wait_ready` polls /health (on the metrics port,
    which needs no key or TLS) until 200."""

    def __init__(self, env: dict[str, str] | None = None, log_path: Path | None = None):
        full_env = {
            **os.environ,
            "BIND_HOST": "127.0.0.1",
            "GRPC_PORT": str(free_port()),
            "HTTP_HEALTH_PORT": str(free_port()),
            "METRICS_PORT": str(free_port()),  # not its default: servers of parallel tests would share it
            "BATCH_CAPS": TEST_BATCH_CAPS,
            "WARM_START": "false",  # as above: every test server measures its own warm-up
            "LOG_LEVEL": "INFO",
            **(env or {}),
        }
        self.host = full_env["BIND_HOST"]
        self.grpc_port, self.http_port = int(full_env["GRPC_PORT"]), int(full_env["HTTP_HEALTH_PORT"])
        self.metrics_port = int(full_env["METRICS_PORT"])
        self.log_path = log_path or Path(f"/tmp/embedserve-test-{self.grpc_port}.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "embedserve"], env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    @property
    def target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def metrics(self) -> str:
        """The plain metrics port (/health, /metrics), whatever keys or TLS guard the API's."""
        return f"http://{self.host}:{self.metrics_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> tuple[int, dict]:
        import json
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.metrics + "/health", timeout=2) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if self.health()[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        # Not left running: a fixture that fails here never reaches its stop(), and a leaked server
        # (its front ends respawned) would load the rest of the run.
        self.stop()
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log()[-3000:]}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def post_json(url: str, body, timeout: float = 120) -> tuple[int, object]:
    """POST `body` as JSON → (status, the JSON answer), an error status included (not raised)."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def counter(http: str, name: str, **labels) -> float:
    """A server's /metrics sample by its exact name, summed over those carrying `labels` (and any
    others: every model's, where the series has a `model` label and none is named), 0 when absent;
    read with prometheus_client's own parser."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(http + "/metrics", timeout=10).read().decode()
    want = {k: str(v) for k, v in labels.items()}
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and want.items() <= sample.labels.items())


def rejections(http: str) -> float:
    """A server's admission refusals, every reason."""
    return sum(counter(http, "embedfleet_rejected_requests_total", reason=r)
               for r in ("drain_time", "sustained", "latency_soft", "latency_hard"))


class LoopbackDNS:
    """A real DNS server on loopback (dnslib) answering A records with a 1 s TTL: the stand-in for
    a headless Service, whose name resolves to every ready pod. gRPC targets it as
    `dns://127.0.0.1:PORT/NAME:GRPC_PORT`."""

    def __init__(self):
        from dnslib import QTYPE, RR, A
        from dnslib.server import BaseResolver, DNSLogger, DNSServer

        self.records: dict[str, list[str]] = {}
        records = self.records

        class Resolver(BaseResolver):
            def resolve(self, request, handler):
                reply = request.reply()
                name = str(request.q.qname).rstrip(".")
                if request.q.qtype == QTYPE.A:  # AAAA and the rest: an empty answer
                    for ip in records.get(name, []):
                        reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=1))
                return reply

        self.port = free_port()
        self._server = DNSServer(Resolver(), address="127.0.0.1", port=self.port,
                                 logger=DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data"))
        self._server.start_thread()

    def target(self, name: str, port: int) -> str:
        return f"dns://127.0.0.1:{self.port}/{name}:{port}"

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture(scope="session", autouse=True)
def own_model_cache(tmp_path_factory):
    """MODEL_CACHE_DIR of this test process (and the servers it starts) is a directory of its own,
    not the shared default /tmp/model_cache, where a warm-up file one test (or another checkout)
    saved would be another's start. Settings() and Settings.from_env(dict) do not read it: tests
    that start a server from those say WARM_START or MODEL_CACHE_DIR themselves."""
    if "MODEL_CACHE_DIR" not in os.environ:  # one set on purpose (a filled cache) is kept
        os.environ["MODEL_CACHE_DIR"] = str(tmp_path_factory.mktemp("model_cache"))
    yield


@pytest.fixture(autouse=True)
def fresh_retry_budgets():
    """Each test's Clients start with full retry budgets: the process keeps one per target
    (embedserve.client_routing.budget_for), which one test's failures would otherwise spend for
    the next test of the same target."""
    routing = sys.modules.get("embedserve.client_routing")  # not imported for the operator's tests
    if routing is not None:
        routing.forget_budgets()
    yield


@pytest.fixture
def dns():
    server = LoopbackDNS()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def model_dir() -> str:
    from embedserve.model.source import ModelSourceError, packaged_model_dir

    try:
        return str(packaged_model_dir())
    except ModelSourceError:
        # bench/gpu.sh's machine has no packaged model (~90 MB: more than its carry holds); its
        # CUDA tests build their own. Anywhere else the model's absence is an error.
        if os.environ.get("EMBEDFLEET_GPU_CHECK") == "1":
            pytest.skip("no packaged model on the GPU machine")
        raise


class Reference:
    """The ecosystem's reference: sentence-transformers' own `encode` of the model directory, as
    a user computes the vectors an index holds. EXCLUDE_TOKENS is our deliberate deviation, which
    sentence-transformers cannot compute: with `exclude_ids` (or another pooling) the vectors are
    pooled by hand from transformers' token states, one text at a time, at the same max_seq_length."""

    def __init__(self, model_dir: str):
        import torch
        from sentence_transformers import SentenceTransformer

        self.torch = torch
        self.st = SentenceTransformer(model_dir, device="cpu")
        self.tok = self.st.tokenizer
        self.max_length = self.st.max_seq_length
        self.model = self.st[0].model.eval()
        self._cache: dict = {}

    def embed(self, texts, exclude_ids=(), pooling=None, normalize=True) -> np.ndarray:
        if not exclude_ids and pooling is None:
            return self.st.encode(list(texts), batch_size=8, convert_to_numpy=True)
        return np.stack([self._one(t, tuple(exclude_ids), pooling or "mean", normalize) for t in texts])

    def _one(self, text, exclude_ids, pooling, normalize):
        key = (text, exclude_ids, pooling, normalize)
        if key not in self._cache:
            torch = self.torch
            enc = self.tok(text, truncation=True, max_length=self.max_length, return_tensors="pt")
            with torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state[0].double()
            ids = enc["input_ids"][0].tolist()
            if pooling == "cls":
                v = hidden[0]
            elif pooling == "last":
                v = hidden[-1]
            else:
                keep = [i for i, t in enumerate(ids) if t not in exclude_ids]
                v = hidden[keep].mean(dim=0)
            if normalize:
                v = v / v.norm()
            self._cache[key] = v.float().numpy()
        return self._cache[key]

    def tokens(self, text) -> int:
        return len(self.tok(text, truncation=True, max_length=self.max_length)["input_ids"])


@pytest.fixture(scope="session")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


WORDS = (
    "embedding vector search query passage retrieval model token batch bucket latency throughput "
    "kubernetes operator replica cluster gpu cuda graph compile tensor numpy stream request reply "
    "the a of and to in is for on with as by at from that this it be are was were not or"
).split()


def make_text(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, size=max(1, words)))


@pytest.fixture(scope="session")
def default_server():
    # Functional tests offer bursts far beyond capacity on purpose: admission stays out of the way.
    server = ServerProcess({"MAX_DRAIN_TIME_MS": "600000"}).wait_ready()
    yield server
    server.stop()
