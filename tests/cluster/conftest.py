"""The operator scenarios on a real cluster: runs only when KUBECONFIG names a kubeconfig file and
EMBEDFLEET_CLUSTER_TESTS=1 (so a developer's production context is never touched by accident).
It installs the CRD, works in a fresh namespace it deletes afterwards, and runs the operator
locally with `--namespace` against that cluster."""

import json
import os
import uuid
from pathlib import Path

import pytest
import yaml

from tests.operator.conftest import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]
ENABLED = bool(os.environ.get("KUBECONFIG")) and os.environ.get("EMBEDFLEET_CLUSTER_TESTS") == "1"


def pytest_collection_modifyitems(config, items):
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="needs a real cluster: set KUBECONFIG and EMBEDFLEET_CLUSTER_TESTS=1")
    for item in items:
        if "tests/cluster" in str(item.fspath):
            item.add_marker(skip)


class RealCluster:
    """The same small interface as tests.operator.emulator.Emulator, over a real API server."""

    def __init__(self):
        from kubernetes import client, config

        config.load_kube_config()
        self.api = client.ApiClient()

    def request(self, method, path, body=None, content_type="application/json"):
        from kubernetes.client.rest import ApiException

        try:
            r = self.api.call_api(path, method, header_params={"Content-Type": content_type, "Accept": "application/json"},
                                  body=body, auth_settings=["BearerToken"], _preload_content=False,
                                  _return_http_data_only=True)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(r.data) if r.data else {}

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
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    if cluster.get(f"{path}/{crd['metadata']['name']}") is None:
        cluster.request("POST", path, crd)
    yield cluster


@pytest.fixture(scope="module")
def namespace(emulator):
    ns = f"embedfleet-test-{uuid.uuid4().hex[:6]}"
    emulator.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    yield ns
    emulator.request("DELETE", f"/api/v1/namespaces/{ns}")


@pytest.fixture(scope="module")
def operator(emulator, namespace, tmp_path_factory):
    d = tmp_path_factory.mktemp("operator")
    op = OperatorProcess(Path(os.environ["KUBECONFIG"]), d / "operator.log", namespace=namespace)
    yield op
    op.stop()
