"""Two operator processes against one API server: only the holder of the Lease writes what the
services own (kopf's own bookkeeping on the services aside); a clean stop hands over at once, a
crash after the lease's duration. Each process calls with a token of its own, so the emulator
tells their requests apart."""

from __future__ import annotations

import signal
import time

import pytest

from embedop.kube import CALLS
from tests.operator import emulator as em
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path

NS = "default"
LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/embedop-leader"
# Every resource the operator writes (kube.CALLS, which the chart's RBAC mirrors): the services
# themselves, their scale and status, what they own, Jobs, InferencePools, pods' deletion costs,
# Events. Only the Lease is written by every candidate (to take it when it has expired).
OWNED = {resource for _, resource, verb in CALLS if verb in ("create", "patch", "update", "delete")} - {"leases"}


RUNNING: list[OperatorProcess] = []  # this test's operators, whose logs a failure shows


def logs() -> str:
    return "\n".join(f"--- {op.log_path.name}, its end:\n" + "\n".join(op.log().splitlines()[-30:]) for op in RUNNING)


@pytest.fixture
def start(emulator, tmp_path):
    procs = RUNNING
    procs.clear()

    def start(who: str) -> OperatorProcess:
        op = OperatorProcess(emulator.kubeconfig(tmp_path / f"kubeconfig-{who}", token=who),
                             tmp_path / f"operator-{who}-{len(procs)}.log", env={"EMBEDOP_IDENTITY": who})
        procs.append(op)
        # Running: it has looked at the lease.
        eventually(lambda: any(c["who"] == who and c["resource"] == "leases" for c in em.calls[-200:]), timeout=30)
        return op

    yield start
    for op in procs:
        if op.proc.poll() is None:
            op.stop()
    procs.clear()


def holder(emulator) -> str:
    return ((emulator.get(LEASE) or {}).get("spec") or {}).get("holderIdentity") or ""


def writers(since: float) -> set[str]:
    return {c["who"] for c in em.calls if c["t"] >= since and c["resource"] in OWNED
            and c["verb"] in ("create", "patch", "update", "delete")}


def deploy(name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"


def create(emulator, name: str) -> None:
    emulator.request("POST", service_path(NS), new_service(name, {"model": "m0", "resources": {"gpu": 0},
                                                                  "autoscaling": {"mode": "off"}}))
    try:
        eventually(lambda: emulator.get(deploy(name)))
    except AssertionError as e:
        raise AssertionError(f"{e}\n{logs()}") from None


def change_model(emulator, name: str, model: str) -> set[str]:
    """Roll the fleet to `model`; → who wrote anything of it meanwhile."""
    since = time.monotonic()
    emulator.merge_patch(service_path(NS, name), {"spec": {"model": model}})
    eventually(lambda: {"name": "MODEL_PATH", "value": model} in
               emulator.get(deploy(name))["spec"]["template"]["spec"]["containers"][0]["env"], timeout=30)
    eventually(lambda: (cr := emulator.get(service_path(NS, name)))["status"].get("observedGeneration")
               == cr["metadata"]["generation"])
    return writers(since)


def test_only_the_lease_holder_writes_and_a_successor_takes_over(emulator, start):
    a = start("a")
    eventually(lambda: holder(emulator).startswith("a_"))
    start("b")
    create(emulator, "led")
    assert change_model(emulator, "led", "m1") == {"a"}
    assert holder(emulator).startswith("a_")
    # A clean stop releases the lease: once a has exited, the Lease names it no more (released, or
    # taken by b already), where a crash leaves it a's until it expires. (Not timed: how long
    # the stop takes is this VM's.)
    a.stop()
    assert not holder(emulator).startswith("a_")
    eventually(lambda: holder(emulator).startswith("b_"), timeout=10)
    assert change_model(emulator, "led", "m2") == {"b"}


def test_a_crashed_leader_is_followed_after_the_lease_expires(emulator, start):
    b = start("b")
    eventually(lambda: holder(emulator).startswith("b_"), timeout=15)
    start("a")
    create(emulator, "crashed")
    assert change_model(emulator, "crashed", "m1") == {"b"}
    b.proc.send_signal(signal.SIGKILL)  # no goodbye: the lease is left to expire
    b.proc.wait(10)
    eventually(lambda: holder(emulator).startswith("a_"), timeout=15)
    assert change_model(emulator, "crashed", "m2") == {"a"}


def test_renewals_that_time_out_pause_the_leader_and_it_carries_on(emulator, start):
    """An API server too slow to answer for longer than the lease: the leader stops writing until it
    renews, then every service is served again (a loop must not end on a lapse)."""
    a = start("a")
    eventually(lambda: holder(emulator).startswith("a_"), timeout=15)
    create(emulator, "lapsed")
    em.faults[("PATCH", "leases")] = [em.TIMEOUT] * 6  # ~8 s without a renewal; the lease is 3 s
    eventually(lambda: not em.faults[("PATCH", "leases")], timeout=60)
    assert change_model(emulator, "lapsed", "m1") == {"a"}
    # A lapse that no successor took is not a loss: the service's loop, and its autoscaling
    # history, went on (closing every loop wiped every service's history).
    log = a.log()
    assert "lease of default/embedop-leader lapsed" in log and f"{NS}/lapsed: loop ended" not in log


def test_a_lapsed_leader_that_finds_a_successor_stops_for_good(emulator, start):
    """a's renewals time out (its calls alone) until b has taken the expired lease. When a's calls
    go through again, its renewal is refused (the Lease changed) and it finds b holding it: its
    term is over, its loops close, and only b writes."""
    a = start("a")
    eventually(lambda: holder(emulator).startswith("a_"), timeout=15)
    start("b")
    create(emulator, "succeeded")
    em.faults[("PATCH", "leases", "a")] = [em.TIMEOUT] * 100
    try:
        eventually(lambda: holder(emulator).startswith("b_"), timeout=30)
    finally:
        em.faults.pop(("PATCH", "leases", "a"), None)
    eventually(lambda: "lost leadership" in a.log(), timeout=30)
    assert f"{NS}/succeeded: loop ended" in a.log()
    assert change_model(emulator, "succeeded", "m1") == {"b"}


def test_an_answer_no_one_foresaw_does_not_end_the_election(emulator, start):
    """A renewal answered 200 with a proxy's HTML page: not an API error the election knows. The
    election used to end there, silently: the operator lived on, its liveness green, writing
    nothing once the lease ran out. It tries again, and the leader carries on."""
    a = start("a")
    eventually(lambda: holder(emulator).startswith("a_"), timeout=15)
    create(emulator, "proxied")
    em.faults[("PATCH", "leases")] = [em.GARBAGE] * 2
    eventually(lambda: not em.faults[("PATCH", "leases")], timeout=30)
    assert change_model(emulator, "proxied", "m1") == {"a"}
    assert "leader election: a round failed" in a.log()
