"""Who may call, on real processes in one process and with FRONTENDS=2: API keys from API_KEYS and
from a Secret mounted as kubelet mounts it, TLS from cert-manager's files, and the plain metrics
port beside them.

- The metrics port answers GET /health and GET /metrics in plain text without a key, and 404 to
  any other method or path (no 405, no redirect of /health/).
- Every route of the API's route table (walked from the app as the server builds it, the
  routes installed after warm-up and every task's included) and every method of the gRPC
  service descriptors is refused without a key and with a wrong one, and served with a right
  one; grpc.health.v1 and reflection need none. Refusals are counted by reason, exactly.
- The openai client, huggingface_hub's InferenceClient and our Client work unchanged with the
  right key (and the CA) and raise their own auth errors with a wrong one.
- A rotated key file (kubelet's symlink swap) and a renewed certificate are taken without a
  restart: new key in, old key out, new handshakes on both ports see the new serial.
- Plain text to the TLS ports fails; with TLS_CLIENT_CA_FILE, a client without a certificate
  signed by it is refused in the handshake.
- No key ever appears in the server's log or its metrics."""

from __future__ import annotations

import re
import json
import secrets
import ssl
import urllib.request

import grpc
import httpx2
import numpy as np
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from embedfleet.v1 import inference_pb2 as pb
from embedserve.client import Client
from embedserve.transports import auth
from tests.conftest import ServerProcess, counter
from tests.server.routes import api_routes as all_routes
from tests.server.mounted_secret import MountedSecret, Pki, serial, served_serial

MODES = {"one process": {}, "FRONTENDS=2": {"FRONTENDS": "2"}}
SIM = {"MODEL_PATH": "sim:50000", "MAX_DRAIN_TIME_MS": "600000", "ACCESS_LOG": "true"}
INFERENCE = pb.DESCRIPTOR.services_by_name["Inference"]
# Fresh connections in a row that must agree before a change counts as taken: with FRONTENDS=2
# each front end reads the files on its own, and the kernel spreads new connections over both.
IN_A_ROW = 12


class Guarded:
    """A server with keys (API_KEYS and a mounted key file) and TLS; its keys as the test set them."""

    def __init__(self, root, mode_env: dict):
        self.pki = Pki(root)
        self.env_key, self.file_key = _key("env"), _key("file")
        self.wrong = _key("wrong")
        self.keys = MountedSecret(root / "auth", {"api-keys": f"# fleet keys\n{self.file_key}\n".encode()})
        self.tls = MountedSecret(root / "tls", self.pki.server_files())
        self.seen_keys = {self.env_key, self.file_key, self.wrong}  # never to appear in a log
        self.server = ServerProcess({**SIM, **mode_env, "API_KEYS": self.env_key,
                                     "API_KEYS_FILE": self.keys.path("api-keys"),
                                     "TLS_CERT_FILE": self.tls.path("tls.crt"), "TLS_KEY_FILE": self.tls.path("tls.key")})
        self.url = f"https://127.0.0.1:{self.server.http_port}"

    def http(self) -> httpx2.Client:
        return httpx2.Client(base_url=self.url, verify=self.pki.client_context(), timeout=10)

    def channel(self) -> grpc.Channel:
        return grpc.secure_channel(self.server.target, grpc.ssl_channel_credentials(open(self.pki.ca_file, "rb").read()))

    def refusals(self) -> dict[str, float]:
        return {r: counter(self.server.metrics, "embedfleet_auth_refusals_total", reason=r) for r in auth.MESSAGES}


def _key(kind: str) -> str:
    return f"{kind}-{secrets.token_urlsafe(18)}"


def bearer(key: str | None) -> dict:
    """HTTP's header; None: none."""
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def metadata(key: str | None) -> tuple:
    """gRPC's metadata; None: none."""
    return () if key is None else (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module", params=list(MODES), ids=list(MODES))
def guarded(request, tmp_path_factory):
    g = Guarded(tmp_path_factory.mktemp("guarded"), MODES[request.param])
    g.server.wait_ready()
    yield g
    g.server.stop()


def poll(check, what: str, timeout: float = 20.0) -> None:
    """Until `check()` is true IN_A_ROW times in a row (each on new connections), or fail."""
    import time

    deadline, streak = time.monotonic() + timeout, 0
    while streak < IN_A_ROW:
        assert time.monotonic() < deadline, what
        streak = streak + 1 if check() else 0


@pytest.fixture(scope="module")
async def api_routes() -> set[tuple[str, str]]:
    """(path, method) of every route the API port can have, every task's (tests/server/routes.py)."""
    routes = {(path, method) for task_routes in (await all_routes()).values() for path, method, _ in task_routes}
    assert {("/openapi.json", "GET"), ("/docs", "GET"), ("/v1/embeddings", "POST"), ("/rerank", "POST")} <= routes
    return routes


def test_the_metrics_port_serves_health_and_metrics_in_plain_text_and_nothing_else(guarded, api_routes):
    with urllib.request.urlopen(guarded.server.metrics + "/health", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "healthy"
    with urllib.request.urlopen(guarded.server.metrics + "/metrics", timeout=5) as r:
        assert b"embedfleet_auth_refusals_total" in r.read()
    with httpx2.Client(base_url=guarded.server.metrics, timeout=10) as plain:
        for path, method in api_routes:
            if path not in ("/health", "/metrics"):
                assert plain.request(method, path, headers=bearer(guarded.env_key)).status_code == 404, (method, path)
        for path in ("/health", "/metrics"):
            assert plain.head(path).status_code == 200  # GET without its body
            for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
                assert plain.request(method, path).status_code == 404, (method, path)
            for near in (path + "/", path.upper(), path + "/x", "/v1" + path):  # no redirect, no near match
                assert plain.get(near).status_code == 404, near


def test_every_route_and_every_method_needs_the_key(guarded, api_routes):
    before = guarded.refusals()
    sent = {"missing": 0, "invalid": 0}
    with guarded.http() as http:
        listed = set(http.get("/openapi.json", headers=bearer(guarded.file_key)).json()["paths"])
        routes = api_routes
        assert listed <= {path for path, _ in routes}  # the walk covers what this server serves
        for path, method in sorted(routes):
            body = {} if method in ("POST", "PUT", "PATCH") else None
            for key, reason in ((None, "missing"), (guarded.wrong, "invalid")):
                r = http.request(method, path, headers=bearer(key), json=body)
                assert r.status_code == 401, (method, path, key, r.status_code)
                assert r.headers["www-authenticate"] == auth.CHALLENGES[reason].decode()
                if method != "HEAD":
                    assert r.json()["error"]["message"] == auth.MESSAGES[reason]
                sent[reason] += 1
            assert http.request(method, path, headers=bearer(guarded.env_key), json=body).status_code != 401, path

    with guarded.channel() as channel:
        for method in INFERENCE.methods:
            call = channel.unary_unary(f"/{INFERENCE.full_name}/{method.name}",
                                       request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=getattr(pb, method.output_type.name).FromString)
            request = getattr(pb, method.input_type.name)()
            for key, reason in ((None, "missing"), (guarded.wrong, "invalid")):
                with pytest.raises(grpc.RpcError) as e:
                    call(request, metadata=metadata(key), timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and e.value.details() == auth.MESSAGES[reason]
                sent[reason] += 1
            try:
                call(request, metadata=metadata(guarded.file_key), timeout=10)
            except grpc.RpcError as e:  # an empty request is refused, but not for its key
                assert e.code() != grpc.StatusCode.UNAUTHENTICATED, method.name

        # Open without a key: kubelet's gRPC probe, grpc-health-probe, grpcurl.
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        assert next(health.Watch(health_pb2.HealthCheckRequest(), timeout=10)).status == health_pb2.HealthCheckResponse.SERVING
        listed = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        services = {s.name for s in listed.list_services_response.service}
        # A service added to the server must join this walk (or the open list, saying why).
        assert services == {INFERENCE.full_name, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}

    after = guarded.refusals()
    assert {r: after[r] - before[r] for r in sent} == sent


def test_the_real_clients_work_with_the_key_and_raise_their_auth_error_without(guarded, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import _http

    context = guarded.pki.client_context()
    with httpx2.Client(verify=context) as http:
        client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=guarded.file_key, http_client=http, max_retries=0)
        model = client.models.list().data[0].id
        assert len(client.embeddings.create(model=model, input=["keys and tls"]).data[0].embedding) == 384
        wrong = openai.OpenAI(base_url=guarded.url + "/v1", api_key=guarded.wrong, http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            wrong.embeddings.create(model=model, input=["keys and tls"])

    # huggingface_hub's documented way to trust a CA; it refuses any URL when HF_HUB_OFFLINE.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    huggingface_hub.set_client_factory(lambda: httpx2.Client(event_hooks={"request": [_http.hf_request_event_hook]},
                                                             verify=context, timeout=30))
    try:
        vector = huggingface_hub.InferenceClient(base_url=guarded.url, token=guarded.env_key).feature_extraction("tei")
        assert np.asarray(vector).size == 384
        with pytest.raises(HfHubHTTPError) as e:
            huggingface_hub.InferenceClient(base_url=guarded.url, token=guarded.wrong).feature_extraction("tei")
        assert e.value.response.status_code == 401
    finally:
        huggingface_hub.set_client_factory(_http.default_client_factory)


async def test_our_client_sends_the_key_and_trusts_the_ca(guarded):
    async with Client(guarded.server.target, api_key=guarded.file_key, ca_file=guarded.pki.ca_file) as client:
        assert (await client.embed(["keys and tls"])).shape == (1, 384)
        assert (await client.health()).status == "healthy"
    for key, reason in ((None, "missing"), (guarded.wrong, "invalid")):
        async with Client(guarded.server.target, api_key=key, ca_file=guarded.pki.ca_file) as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.embed(["keys and tls"])
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and e.value.details() == auth.MESSAGES[reason]


def test_plain_text_to_the_tls_ports_fails(guarded):
    with pytest.raises(httpx2.TransportError):
        httpx2.get(f"http://127.0.0.1:{guarded.server.http_port}/health", headers=bearer(guarded.env_key), timeout=5)
    with grpc.insecure_channel(guarded.server.target) as channel, pytest.raises(grpc.RpcError) as e:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_a_rotated_key_file_is_taken_without_a_restart(guarded):
    """kubelet's update of the mounted Secret: the new key in, the old one out, API_KEYS' kept."""
    old, new = guarded.file_key, _key("rotated")
    guarded.seen_keys.add(new)

    def http_takes(accepted: str, refused: str):
        def check():
            with guarded.http() as http:  # a new connection: either front end
                ok = http.get("/v1/models", headers=bearer(accepted)).status_code == 200
            with guarded.http() as http:
                return ok and http.get("/v1/models", headers=bearer(refused)).status_code == 401
        return check

    def grpc_takes(accepted: str):
        def check():
            with guarded.channel() as channel:  # a new connection
                call = channel.unary_unary(f"/{INFERENCE.full_name}/HealthCheck",
                                           request_serializer=pb.HealthCheckRequest.SerializeToString,
                                           response_deserializer=pb.HealthCheckResponse.FromString)
                return call(pb.HealthCheckRequest(), metadata=metadata(accepted), timeout=10).status == "healthy"
        return check

    guarded.keys.update({"api-keys": f"{new}\n".encode()})
    try:
        poll(http_takes(new, old), "the rotated key file was not taken")
        poll(grpc_takes(new), "gRPC does not take the rotated key")
        with guarded.http() as http:
            assert http.get("/v1/models", headers=bearer(guarded.env_key)).status_code == 200
    finally:  # back, for the module's other tests
        guarded.keys.update({"api-keys": f"{old}\n".encode()})
        poll(http_takes(old, new), "the key file rotated back was not taken")


def test_a_renewed_certificate_reaches_new_handshakes_on_both_ports(guarded):
    renewed = guarded.pki.server_files()
    before = served_serial(guarded.server.http_port, guarded.pki.client_context())
    assert before != serial(renewed["tls.crt"])
    guarded.tls.update(renewed)
    poll(lambda: served_serial(guarded.server.http_port, guarded.pki.client_context()) == serial(renewed["tls.crt"]),
         "HTTPS still hands out the old certificate")
    poll(lambda: served_serial(guarded.server.grpc_port, guarded.pki.client_context(), ["h2"]) == serial(renewed["tls.crt"]),
         "gRPC still hands out the old certificate")
    with guarded.http() as http:
        assert http.get("/v1/models", headers=bearer(guarded.env_key)).status_code == 200
    with guarded.channel() as channel:
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1


def test_no_key_is_ever_logged_or_exported(guarded):
    """Last in the module: after every key (right, wrong, rotated) went by, refused and served."""
    metrics = urllib.request.urlopen(guarded.server.metrics + "/metrics", timeout=10).read().decode()
    log = guarded.server.log()
    # The refusals were logged (a request line each: embedserve.logs), without their keys.
    assert re.search(r" 401 in [\d.]+ ms: (missing|invalid) API key", log), log[-2000:]
    assert re.search(r"UNAUTHENTICATED in [\d.]+ ms: (missing|invalid) API key", log), log[-2000:]
    for key in guarded.seen_keys:
        assert key not in log and key not in metrics


@pytest.fixture(scope="module")
def mutual(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtls")
    pki = Pki(root)
    tls = MountedSecret(root / "tls", pki.server_files())
    server = ServerProcess({**SIM, "TLS_CERT_FILE": tls.path("tls.crt"), "TLS_KEY_FILE": tls.path("tls.key"),
                            "TLS_CLIENT_CA_FILE": tls.path("ca.crt")}).wait_ready()
    yield server, pki
    server.stop()


async def test_client_certificates_are_required_when_a_client_ca_is_set(mutual, tmp_path):
    server, pki = mutual
    ours, stranger = pki.client_ca.issue_cert("client@embedfleet.test"), trustme_stranger()
    url = f"https://127.0.0.1:{server.http_port}/v1/models"
    assert httpx2.get(url, verify=pki.client_context(ours), timeout=10).status_code == 200
    for context in (pki.client_context(), pki.client_context(stranger)):
        with pytest.raises((ssl.SSLError, httpx2.TransportError)):
            httpx2.get(url, verify=context, timeout=10)
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"
    ours.cert_chain_pems[0].write_to_path(str(cert))
    ours.private_key_pem.write_to_path(str(key))
    async with Client(server.target, ca_file=pki.ca_file, client_cert_file=str(cert), client_key_file=str(key)) as client:
        assert (await client.embed(["mutual"])).shape == (1, 384)
    async with Client(server.target, ca_file=pki.ca_file, max_attempts=1) as client:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.embed(["no certificate"])
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert urllib.request.urlopen(server.metrics + "/health", timeout=5).status == 200  # plain, no certificate


def trustme_stranger():
    import trustme

    return trustme.CA().issue_cert("client@elsewhere.test")
