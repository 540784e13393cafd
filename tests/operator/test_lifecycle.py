"""Deletion never waits for the operator, a service being deleted is left alone, and an operator
upgrade with a new default server image does not roll existing fleets (it says so in an Event).

The emulator has no garbage collector: where a real cluster's would delete a service's owned
objects, the test does; tests/cluster/test_lifecycle_on_cluster.py checks the real one."""

import pytest

from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path

NS = "default"
DEPLOY = f"/apis/apps/v1/namespaces/{NS}/deployments"
OLD, NEW = "registry.example/embedserve:1.0", "registry.example/embedserve:2.0"


class Operators:
    """Operator processes started one after another (an upgrade is a restart with a new image)."""

    def __init__(self, emulator, d):
        self.emulator, self.dir, self.procs = emulator, d, []

    def start(self, image=OLD) -> OperatorProcess:
        self.stop()
        op = OperatorProcess(self.emulator.kubeconfig(self.dir / "kubeconfig"), self.dir / f"operator{len(self.procs)}.log",
                             env={"EMBEDOP_SERVER_IMAGE": image})
        self.procs.append(op)
        return op

    def stop(self) -> None:
        for op in self.procs:
            if op.proc.poll() is None:
                op.stop()


@pytest.fixture(scope="module")
def operators(emulator, tmp_path_factory):
    ops = Operators(emulator, tmp_path_factory.mktemp("lifecycle"))
    yield ops
    ops.stop()


def image(emulator, name):
    return emulator.get(f"{DEPLOY}/{name}")["spec"]["template"]["spec"]["containers"][0]["image"]


def svc(name, **spec):
    return new_service(name, {"model": "m", "resources": {"gpu": 0}, **spec}, NS)


def test_deleting_a_service_needs_no_operator(emulator, operators):
    """The operator puts no finalizer on a service (and writes nothing to the object itself: its
    RBAC has no patch of EmbeddingServices, tests/charts)."""
    operators.start()
    emulator.request("POST", service_path(NS), svc("plain"))
    eventually(lambda: emulator.get(f"{DEPLOY}/plain"))
    assert not emulator.get(service_path(NS, "plain"))["metadata"].get("finalizers")
    operators.stop()  # as after helm uninstall --no-hooks, or a crash
    emulator.request("DELETE", service_path(NS, "plain"))
    assert emulator.get(service_path(NS, "plain")) is None  # not stuck in Terminating


def test_a_service_being_deleted_is_not_reconciled(emulator, operators):
    operators.start()
    body = svc("leaving")
    body["metadata"]["finalizers"] = ["example.com/hold"]  # someone else's: deletion waits for it
    emulator.request("POST", service_path(NS), body)
    eventually(lambda: emulator.get(f"{DEPLOY}/leaving"))
    emulator.request("DELETE", service_path(NS, "leaving"))
    assert emulator.get(service_path(NS, "leaving"))["metadata"]["deletionTimestamp"]
    op = operators.procs[-1]
    mark = len(op.log())
    emulator.request("DELETE", f"{DEPLOY}/leaving")  # as the garbage collector would
    # The absence of a write is the point. What could write has to have acted, as the operator's
    # log shows: it has seen the Deployment's deletion (the way a live service's Deployment,
    # deleted by hand, comes back at once), and the service's own loop (reconciles, periodic
    # checks, autoscaler) has ended, which it does when it sees the deletion.
    eventually(lambda: "followed Deployment default/leaving (DELETED)" in op.log()[mark:])
    eventually(lambda: "default/leaving: loop ended" in op.log())
    assert emulator.get(f"{DEPLOY}/leaving") is None
    emulator.merge_patch(service_path(NS, "leaving"), {"metadata": {"finalizers": []}})
    eventually(lambda: emulator.get(service_path(NS, "leaving")) is None)


def events_of(emulator, name, reason):
    return [e for e in emulator.get(f"/api/v1/namespaces/{NS}/events")["items"]
            if e.get("involvedObject", {}).get("name") == name and e.get("reason") == reason]


def test_a_new_default_image_does_not_roll_existing_services(emulator, operators):
    emulator.request("POST", service_path(NS), svc("steady"))
    eventually(lambda: image(emulator, "steady") == OLD)
    operators.start(NEW)  # the operator upgrade
    emulator.request("POST", service_path(NS), svc("fresh"))
    eventually(lambda: image(emulator, "fresh") == NEW)  # new services get the new default
    (event,) = eventually(lambda: events_of(emulator, "steady", "DefaultImageChanged"))
    assert NEW in event["message"] and "spec.image" in event["message"]
    assert image(emulator, "steady") == OLD
    # Moving to it is the user's choice: spec.image. Removing it again follows today's default.
    emulator.merge_patch(service_path(NS, "steady"), {"spec": {"image": NEW}})
    eventually(lambda: image(emulator, "steady") == NEW)
    emulator.merge_patch(service_path(NS, "steady"), {"spec": {"image": None}})
    eventually(lambda: emulator.get(f"{DEPLOY}/steady")["metadata"]["annotations"]["embedfleet.dev/default-server-image"] == NEW)
    assert image(emulator, "steady") == NEW


def test_the_default_image_a_service_runs_outlives_its_deployment(emulator, operators):
    """Kept in status.defaultImage: a Deployment deleted by hand (or lost to a restore) comes back
    with the image the service ran, not the newer default of an upgraded operator."""
    operators.start(OLD)
    emulator.request("POST", service_path(NS), svc("kept"))
    eventually(lambda: emulator.get(service_path(NS, "kept")).get("status", {}).get("defaultImage") == OLD)
    operators.start(NEW)
    emulator.request("DELETE", f"{DEPLOY}/kept")
    eventually(lambda: emulator.get(f"{DEPLOY}/kept") and image(emulator, "kept"))
    assert image(emulator, "kept") == OLD
