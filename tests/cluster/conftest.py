"""The operator scenarios on a real cluster: runs only when KUBECONFIG names a kubeconfig file and
EMBEDFLEET_CLUSTER_TESTS=1 (so a developer's production context is never touched by accident).
It installs the CRD, works in a fresh namespace it deletes afterwards, and runs the operator
locally with `--namespace` against that cluster (test_uninstall_on_cluster.py installs the chart
instead). Here a real API server judges what the emulator cannot: server-side apply's field
ownership, garbage collection, foreground deletion, controllers, admission. See docs/testing.md
("Tests on a real cluster") for kind."""

import json
import os
import uuid
from pathlib import Path

import pytest
import yaml

from tests.operator.conftest import OperatorProcess, eventually

ROOT = Path(__file__).resolve().parents[2]
ENABLED = bool(os.environ.get("KUBECONFIG")) and os.environ.get("EMBEDFLEET_CLUSTER_TESTS") == "1"
# Images loaded into the cluster (kind load docker-image): the servers' (optional: pods that cannot
# pull still count as replicas), and the operator's for the helm install test.
SERVER_IMAGE = os.environ.get("EMBEDFLEET_SERVER_IMAGE")
OPERATOR_IMAGE = os.environ.get("EMBEDFLEET_OPERATOR_IMAGE")


def pytest_collection_modifyitems(config, items):
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="needs a real cluster: set KUBECONFIG and EMBEDFLEET_CLUSTER_TESTS=1")
    for item in items:
        if "tests/cluster" in str(item.fspath):
            item.add_marker(skip)


class RealCluster:
    """The same small interface as tests.operator.emulator.Emulator, over a real API server
    (lightkube's configured HTTP client: KUBECONFIG, its credentials, its CA)."""

    subject = "cluster"

    def __init__(self):
        from lightkube.config.client_adapter import Client, ConnectionParams
        from lightkube.config.kubeconfig import KubeConfig

        self.http = Client(KubeConfig.from_env().get(), ConnectionParams())

    def _send(self, method, path, body, content_type="application/json"):
        return self.http.request(method, path, content=None if body is None else json.dumps(body),
                                 headers={"Content-Type": content_type, "Accept": "application/json"})

    def request(self, method, path, body=None, content_type="application/json"):
        r = self._send(method, path, body, content_type)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json() if r.content else {}

    def attempt(self, method, path, body=None) -> tuple[int, str]:
        """A request whose refusal is the point: (status code, body text), never raising."""
        r = self._send(method, path, body)
        return r.status_code, r.text

    def get(self, path):
        return self.request("GET", path)

    def merge_patch(self, path, body):
        return self.request("PATCH", path, body, "application/merge-patch+json")

    def kubeconfig(self, path: Path) -> Path:
        return Path(os.environ["KUBECONFIG"])


@pytest.fixture(scope="module")
def controllers_are_emulated():
    return False


@pytest.fixture(scope="module")
def emulator():
    if not ENABLED:
        pytest.skip("no cluster")
    cluster = RealCluster()
    crd = yaml.safe_load((ROOT / "crds" / "embeddingservice.yaml").read_text())
    path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
    # Applied (not only created): a CRD left by an earlier run gets this checkout's schema.
    cluster.request("PATCH", f"{path}?fieldManager=embedfleet-tests&force=true", crd, "application/apply-patch+yaml")
    eventually(lambda: any(c["type"] == "Established" and c["status"] == "True"
                           for c in (cluster.get(path).get("status") or {}).get("conditions", [])))
    yield cluster


@pytest.fixture(scope="module")
def namespace(emulator):
    ns = f"embedfleet-test-{uuid.uuid4().hex[:6]}"
    emulator.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    yield ns
    emulator.request("DELETE", f"/api/v1/namespaces/{ns}")


def operator_env(namespace: str, **extra) -> dict:
    """An operator's environment on the cluster: its Lease in the test's namespace (operators of one
    test elect one leader among them; none is left in `default`), the server image when given."""
    return {"EMBEDOP_LEASE_NAMESPACE": namespace, **({"EMBEDOP_SERVER_IMAGE": SERVER_IMAGE} if SERVER_IMAGE else {}),
            **extra}


@pytest.fixture(scope="module")
def operator(emulator, namespace, tmp_path_factory):
    d = tmp_path_factory.mktemp("operator")
    op = OperatorProcess(Path(os.environ["KUBECONFIG"]), d / "operator.log", namespace=namespace, env=operator_env(namespace))
    yield op
    op.stop()
