"""The declared dependency ranges work: ./operator is installed into a fresh virtual environment
without ../constraints.txt (so pip takes the newest releases operator/pyproject.toml allows), and
the operator from there runs a scenario against the emulator. This is what notices a new release
of kopf, lightkube, aiohttp or prometheus-client that breaks the operator. Needs the package index
(CI has it); EMBEDFLEET_OFFLINE=1 skips it on a machine without one."""

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path

ROOT = Path(__file__).resolve().parents[2]
NS, NAME = "default", "fresh"
DEPLOY = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"

pytestmark = pytest.mark.skipif(os.environ.get("EMBEDFLEET_OFFLINE") == "1", reason="EMBEDFLEET_OFFLINE=1: no package index")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """→ (python of the fresh environment, what pip installed there)."""
    d = tmp_path_factory.mktemp("fresh")
    # A copy of the package: pip builds in the source tree, and the checkout stays clean.
    src = shutil.copytree(ROOT / "operator", d / "operator",
                          ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    venv.create(d / "venv", with_pip=True)
    python = str(d / "venv" / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_CONSTRAINT")}
    out = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(src)],
                         capture_output=True, text=True, env=env, timeout=540)
    assert out.returncode == 0, out.stdout + out.stderr
    freeze = subprocess.run([python, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    return python, freeze


def test_the_newest_allowed_releases_run_the_operator(emulator, fresh, tmp_path):
    python, freeze = fresh
    assert "kubernetes==" not in freeze  # the operator no longer needs the kubernetes client
    op = OperatorProcess(emulator.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator.log", python=python)
    try:
        emulator.request("POST", service_path(NS), new_service(NAME, {
            "model": "m", "resources": {"gpu": 0}, "autoscaling": {"minReplicas": 2}}))
        eventually(lambda: emulator.get(DEPLOY)["spec"]["replicas"] == 2, timeout=60)
        # The autoscaler ran (aiohttp session, decide) and recorded its count; the reconcile its status.
        eventually(lambda: emulator.get(service_path(NS, NAME)).get("status", {}).get("desiredReplicas") == 2)
        emulator.merge_patch(service_path(NS, NAME), {"spec": {"model": "m2", "autoscaling": {"minReplicas": 1}}})
        d = eventually(lambda: (d := emulator.get(DEPLOY)) and {"name": "MODEL_PATH", "value": "m2"}
                       in d["spec"]["template"]["spec"]["containers"][0]["env"] and d)
        assert d["spec"]["replicas"] == 2, freeze  # a spec edit keeps the count
    finally:
        op.stop()
    errors = [line for line in op.log().splitlines() if " ERROR " in line or "Traceback" in line]
    assert errors == [], (errors, freeze)
