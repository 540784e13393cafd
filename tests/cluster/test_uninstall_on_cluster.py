"""helm install, an EmbeddingService with running server pods, helm uninstall: nothing is left
(no EmbeddingService, stuck or not; no server pod). Needs the helm CLI and the operator image in
the cluster (EMBEDFLEET_OPERATOR_IMAGE, e.g. embedop:dev after kind load docker-image); the
operator runs in the cluster here, watching a namespace of its own."""

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.cluster.conftest import OPERATOR_IMAGE, SERVER_IMAGE
from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path

CHART = Path(__file__).resolve().parents[2] / "charts" / "embedfleet"

pytestmark = pytest.mark.skipif(not (shutil.which("helm") and OPERATOR_IMAGE),
                                reason="needs the helm CLI and EMBEDFLEET_OPERATOR_IMAGE")


def helm(*args):
    out = subprocess.run(["helm", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def image_values(image: str, key: str) -> list[str]:
    repository, _, tag = image.rpartition(":")
    return ["--set", f"{key}.repository={repository}", "--set", f"{key}.tag={tag}"]


def test_uninstall_leaves_nothing_running(emulator):
    ns = f"embedfleet-helm-{uuid.uuid4().hex[:6]}"
    emulator.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    release = "ef"
    try:
        # The CRD is the test session's (conftest applied it): not this release's to own. The
        # hook is off by default: asked for here.
        helm("install", release, str(CHART), "--namespace", ns, "--set", f"watchNamespace={ns}", "--wait",
             "--set", "crds.install=false", "--set", "uninstall.deleteServices=true",
             *image_values(OPERATOR_IMAGE, "image"), *(image_values(SERVER_IMAGE, "serverImage") if SERVER_IMAGE else []))
        emulator.request("POST", service_path(ns), new_service("doomed", {
            "model": "m", "replicas": 2, "autoscaling": {"mode": "off"},
            "resources": {"gpu": 0, "cpu": "50m", "memory": "64Mi"}}, ns))
        pods = f"/api/v1/namespaces/{ns}/pods?labelSelector=app.kubernetes.io/managed-by=embedop"
        eventually(lambda: len(emulator.get(pods)["items"]) == 2, timeout=120)
        helm("uninstall", release, "--namespace", ns, "--wait", "--timeout", "5m")
        assert emulator.get(service_path(ns))["items"] == []  # none left, none Terminating
        assert emulator.get(pods)["items"] == []  # the hook waited for the pods
    finally:
        subprocess.run(["helm", "uninstall", release, "--namespace", ns, "--no-hooks"], capture_output=True)
        emulator.request("DELETE", f"/api/v1/namespaces/{ns}")
