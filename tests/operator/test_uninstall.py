"""`python -m embedop.uninstall`, the chart's pre-delete hook, against the emulator: it deletes
every EmbeddingService with foreground propagation and waits until they are gone, failing with
their names at its timeout. The emulator has no garbage collector and does not hold an object for
foreground deletion (kmock deletes at once): a finalizer of the test's stands in for dependents
still being deleted. tests/cluster/test_lifecycle_on_cluster.py runs a real helm uninstall."""

import os
import subprocess
import sys

import pytest

from embedop import uninstall
from tests.operator import emulator as em
from tests.operator.emulator import Emulator, new_service, service_path


@pytest.fixture(scope="module")
def emulator():
    with Emulator(subject="uninstall") as e:
        yield e


def run(emulator, tmp_path, *args):
    env = {**os.environ, "KUBECONFIG": str(emulator.kubeconfig(tmp_path / "kubeconfig"))}
    return subprocess.run([sys.executable, "-m", "embedop.uninstall", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def names(emulator, ns):
    return sorted(o["metadata"]["name"] for o in emulator.get(service_path(ns))["items"])


def test_every_service_is_deleted_in_the_foreground_and_waited_for(emulator, tmp_path):
    for ns, name in (("default", "a"), ("default", "b"), ("search", "c")):
        emulator.request("POST", service_path(ns), new_service(name, {"model": "m"}, ns))
    held = new_service("held", {"model": "m"}, "search")
    held["metadata"]["finalizers"] = ["example.com/dependents"]  # its pods are still terminating
    emulator.request("POST", service_path("search"), held)

    out = run(emulator, tmp_path, "--timeout", "2")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "search/held" in out.stderr and names(emulator, "default") == [] and names(emulator, "search") == ["held"]
    deleted = {(ns, name): params for subject, plural, ns, name, params in em.deletes
               if subject == "uninstall" and plural == "embeddingservices"}
    assert set(deleted) == {("default", "a"), ("default", "b"), ("search", "c"), ("search", "held")}
    assert all(p.get("propagationPolicy") == "Foreground" for p in deleted.values())

    emulator.merge_patch(service_path("search", "held"), {"metadata": {"finalizers": []}})  # the pods are gone
    out = run(emulator, tmp_path, "--timeout", "10")
    assert out.returncode == 0 and "no EmbeddingService left" in out.stdout, out.stdout + out.stderr


def test_a_namespace_limits_it(emulator, tmp_path):
    emulator.request("POST", service_path("default"), new_service("mine", {"model": "m"}, "default"))
    emulator.request("POST", service_path("other"), new_service("theirs", {"model": "m"}, "other"))
    assert run(emulator, tmp_path, "--namespace", "default").returncode == 0
    assert names(emulator, "default") == [] and names(emulator, "other") == ["theirs"]


def test_without_the_crd_there_is_nothing_to_delete_and_it_succeeds(tmp_path):
    """--skip-crds, or the CRD deleted first: the API answers 404 for the resource. That is
    "nothing left", not a failure that would fail helm uninstall."""
    with Emulator(subject="uninstall", with_crd=False) as bare:
        assert bare.get(service_path("default")) is None  # 404, as a real API server answers
        out = run(bare, tmp_path)
        assert out.returncode == 0 and "no EmbeddingService left" in out.stdout, out.stdout + out.stderr
        out = run(bare, tmp_path, "--namespace", "search")
        assert out.returncode == 0, out.stdout + out.stderr


def test_its_calls_are_what_the_hook_role_grants():
    calls = em.recorded["uninstall"]
    assert calls and calls <= uninstall.CALLS, calls - uninstall.CALLS
