"""The fleet's connections on a real cluster: kube-proxy balancing a ClusterIP Service per
connection, endpoints leaving the Service as a pod terminates, preStop, a rolling replacement.
tests/server/test_fleet.py stands in a DNS server and a kube-proxy double on loopback; here the
cluster's own. Needs the server image in the cluster (EMBEDFLEET_SERVER_IMAGE); the servers run
the simulated device (`model: sim:20000`), so no model or GPU is needed."""

import pytest

from embedop.render import HTTP_PORT, selector_string
from tests.cluster.conftest import SERVER_IMAGE
from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path

pytestmark = pytest.mark.skipif(not SERVER_IMAGE, reason="needs EMBEDFLEET_SERVER_IMAGE in the cluster")

MODEL = "sim:20000"
# One keep-alive HTTP connection through the Service, retrying as the openai client does with its
# defaults (2 retries, honouring Retry-After; a new connection when told to close or cut off).
# Prints its tally every 2 s until the pod is deleted.
CLIENT = r"""
import http.client, json, sys, time
host, port, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
conn = http.client.HTTPConnection(host, port, timeout=30)
ok = failed = 0
shown = time.monotonic()
while True:
    for attempt in range(3):
        try:
            conn.request("POST", "/v1/embeddings", json.dumps({"model": model, "input": ["hello"]}),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            status, wait = r.status, float(r.getheader("retry-after") or 0.5)
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            status, wait = repr(e), 0.5
        if status == 200:
            ok += 1
            break
        time.sleep(min(wait, 8))
    else:
        failed += 1
        print("failed:", status, flush=True)
    if time.monotonic() - shown >= 2:
        print(f"ok={ok} failed={failed}", flush=True)
        shown = time.monotonic()
"""


def tally(log: str) -> tuple[int, int]:
    """The client's last (ok, failed) line."""
    last = [line for line in log.splitlines() if line.startswith("ok=")][-1]
    ok, failed = (int(part.split("=")[1]) for part in last.split())
    return ok, failed


@pytest.mark.timeout(1800)
def test_an_http_client_keeps_working_while_every_pod_is_replaced(emulator, operator, namespace):
    """Each server pod in turn is deleted (preStop, SIGTERM, drain) under a keep-alive client:
    whichever pod holds its connection, the client's retry reaches a pod still in the Service."""
    name = "drain"
    emulator.request("POST", service_path(namespace), new_service(name, {
        "model": MODEL, "replicas": 2, "autoscaling": {"mode": "off"},
        "resources": {"gpu": 0, "cpu": "250m", "memory": "1Gi"}}, namespace))
    pods = f"/api/v1/namespaces/{namespace}/pods"

    def ready() -> list[str]:
        """Server pods that are Ready and not terminating: a replacement counts once it is Ready."""
        items = emulator.get(f"{pods}?labelSelector={selector_string(name)}")["items"]
        return [p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp")
                and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]

    def log() -> str:
        return emulator.http.request("GET", f"{pods}/client/log").text

    try:
        first_pair = eventually(lambda: len(ready()) == 2 and ready(), timeout=300)
        emulator.request("POST", pods, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client"}, "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "client", "image": SERVER_IMAGE, "imagePullPolicy": "IfNotPresent",
                            "command": ["python", "-c", CLIENT, name, str(HTTP_PORT), MODEL]}]}})
        eventually(lambda: "ok=" in log() and tally(log())[0] > 0, timeout=120)
        for victim in first_pair:  # one at a time, each replaced before the next goes
            emulator.request("DELETE", f"{pods}/{victim}")
            eventually(lambda: len(ready()) == 2, timeout=300)  # its replacement is Ready
        after = tally(log())[0]
        eventually(lambda: tally(log())[0] > after + 10, timeout=60)  # still served after the last replacement
        assert emulator.get(f"{pods}/client")["status"]["phase"] == "Running", log()
        assert tally(log())[1] == 0, log()
    finally:
        emulator.request("DELETE", f"{pods}/client")
        emulator.request("DELETE", service_path(namespace, name))
