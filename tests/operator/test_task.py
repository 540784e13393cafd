"""spec.task and status.task: the spec's task is the servers' TASK (removed with the field); the
task the pods serve, from the task label of their embedfleet_model_info, is status.task (the Task
column), and a spec.task it disagrees with is the TaskMismatch condition, cleared when they agree.
Written only when it changes: a fleet at rest writes no status (bench/operator_load's figures).

Pure decisions as tables; the writes against the emulated API (the autoscaler's status writer,
as test_status.py does); the whole path with the real operator process, a Pod the test posts and
its /metrics served by the test (bench.operator_load.serve_metrics, the servers' stand-in)."""

from __future__ import annotations

import pytest
from lightkube import AsyncClient, KubeConfig

from bench.operator_load import exposition, serve_metrics
from embedop import autoscale, autoscaler, reconcile, render, spec as specs, status
from embedop.cache import Cluster
from embedop.kube import Kube
from tests.conftest import pod_addresses
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator import emulator as emulator_module
from tests.operator.emulator import new_service, service_path

NS = "default"
NOW = "2026-12-01T00:00:00Z"


@pytest.mark.parametrize("tasks, previous, served", [
    (["rerank", "rerank"], None, "rerank"),
    (["rerank", None], "embed", "rerank"),  # a pod without the label says nothing
    ([None, None], "embed", None),  # scraped, none says (an older image): unknown, not stale
    ([None], None, None),
    ([], "sparse", "sparse"),  # nothing scraped
    (["embed", "rerank"], "embed", "embed"),  # a rollout between two: as it was until it ends
])
def test_served_task(tasks, previous, served):
    assert status.served_task(tasks, previous) == served


@pytest.mark.parametrize("wanted, served, state, reason", [
    ("rerank", "embed", "True", "TaskDiffers"),
    ("rerank", "rerank", "False", "AsSpecified"),
    (None, "classify", "False", "Inferred"),
])
def test_task_mismatch(wanted, served, state, reason):
    c = status.task_mismatch(wanted, served, 4, [], NOW)
    assert (c["type"], c["status"], c["reason"], c["observedGeneration"]) == ("TaskMismatch", state, reason, 4)
    assert served in c["message"] and (wanted is None or wanted in c["message"])


def test_an_unknown_served_task_gives_no_condition():
    assert status.task_mismatch("rerank", None, 4, [], NOW) is None


@pytest.mark.parametrize("spec, wanted, problem", [
    ({"task": "rerank"}, "rerank", False),
    ({"env": [{"name": "TASK", "value": "classify"}]}, "classify", False),  # set before spec.task existed
    ({"task": "rerank", "env": [{"name": "TASK", "value": "embed"}]}, "rerank", True),  # the env would win
    ({}, None, False),
])
def test_the_task_the_pods_are_told(spec, wanted, problem):
    full = specs.defaulted({"model": "m", **spec})
    assert specs.task(full) == wanted
    assert any("TASK" in p for p in specs.problems(full)) == problem


@pytest.fixture
async def cluster(emulator, tmp_path):
    """The operator's Cluster without copies: every read goes to the API (the emulator)."""
    k = Kube(AsyncClient(config=KubeConfig.from_file(emulator.kubeconfig(tmp_path / "kubeconfig"))))
    yield Cluster(k, {})
    await k.close()


def steady() -> autoscale.Decision:
    return autoscale.Decision(desired=1, reason="steady", recommendation=1, capacity=1000.0, demand=0.0,
                              forecast=0.0, limited=False, history=autoscale.History())


def sample(task: str | None) -> autoscale.PodSample:
    return autoscale.PodSample(name="p", ready=True, scraped=True, service_rate=1000.0, arrival_rate=500.0, task=task)


async def test_status_task_is_written_when_it_changes_and_only_then(emulator, cluster):
    emulator.request("POST", service_path(NS), new_service("tasked", {"model": "m", "task": "rerank"}))
    spec = specs.defaulted({"model": "m", "task": "rerank"})

    async def write(task: str | None) -> dict:
        await autoscaler._write_status(cluster, NS, "tasked", spec, steady(), [sample(task)], 1, due=False)
        return emulator.get(service_path(NS, "tasked"))

    def mismatch(cr: dict) -> dict:
        return next(c for c in cr["status"]["conditions"] if c["type"] == "TaskMismatch")

    first = await write("embed")
    assert first["status"]["task"] == "embed" and mismatch(first)["status"] == "True"
    assert "spec.task is rerank but the pods serve embed" in mismatch(first)["message"]
    # At rest (the same task), nothing is written.
    assert (await write("embed"))["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    agreed = await write("rerank")
    assert agreed["status"]["task"] == "rerank" and mismatch(agreed)["status"] == "False"
    assert mismatch(agreed)["reason"] == "AsSpecified"
    # Pods whose servers export no task (rolled back to an older image): no task, no verdict.
    unknown = await write(None)
    assert "task" not in unknown["status"]
    assert all(c["type"] != "TaskMismatch" for c in unknown["status"]["conditions"])
    assert (await write(None))["metadata"]["resourceVersion"] == unknown["metadata"]["resourceVersion"]


async def test_a_status_field_an_older_crd_prunes_is_not_sent_again(emulator, cluster, monkeypatch):
    """An operator upgraded before its CRD: the API server prunes status.task from every write. Sent
    again, each write would differ from what is stored: a write every autoscaler step."""
    monkeypatch.setattr(emulator_module, "unknown_status", {"task"})
    monkeypatch.setattr(reconcile, "UNSTORED", set())
    emulator.request("POST", service_path(NS), new_service("old-crd", {"model": "m"}))
    spec = specs.defaulted({"model": "m"})
    versions = []
    for _ in range(4):
        await autoscaler._write_status(cluster, NS, "old-crd", spec, steady(), [sample("embed")], 1, due=False)
        versions.append(emulator.get(service_path(NS, "old-crd"))["metadata"]["resourceVersion"])
    assert "task" not in emulator.get(service_path(NS, "old-crd"))["status"]
    assert len(set(versions)) == 1, f"status written again and again: {versions}"
    assert reconcile.UNSTORED == {"task"}


def task_of(emulator, name: str) -> tuple[str | None, dict]:
    st = emulator.get(service_path(NS, name)).get("status") or {}
    return st.get("task"), next((c for c in st.get("conditions") or [] if c["type"] == "TaskMismatch"), {})


def env_of(emulator, name: str) -> dict:
    d = emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}")
    return {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_spec_task_status_task_and_the_mismatch_with_the_real_operator(emulator, tmp_path):
    """The reranker example's service: TASK=rerank on its pods; a pod still serving embed (the model
    is not a cross-encoder, or a rollout is under way) shows as status.task embed and TaskMismatch;
    once the pod serves rerank the condition clears; spec.task removed: TASK leaves the pods, the
    task the pod serves stays (inferred)."""
    name, port = "reranker", render.HTTP_PORT  # no guard: the operator reads the pods on the API port
    (ip,) = pod_addresses(port)
    served = {"task": "embed"}
    server = serve_metrics(ip, port, lambda: exposition(1000, 500, task=served["task"]))
    op = OperatorProcess(emulator.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator.log",
                         env={"EMBEDOP_SCRAPE_TIMEOUT_S": "1"})
    with op.running(server):
        emulator.request("POST", service_path(NS), new_service(name, {
            "model": "BAAI/bge-reranker-base", "task": "rerank", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
            "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 2, "intervalSeconds": 1}}))
        assert eventually(lambda: env_of(emulator, name))["TASK"] == "rerank"
        emulator.request("POST", f"/api/v1/namespaces/{NS}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-0", "namespace": NS, "labels": render.labels(name)},
            "spec": {"containers": [{"name": "server", "image": "embedserve"}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})
        _, c = eventually(lambda: (t := task_of(emulator, name))[0] == "embed" and t, timeout=30)
        assert c["status"] == "True" and c["reason"] == "TaskDiffers", c

        served["task"] = "rerank"
        _, c = eventually(lambda: (t := task_of(emulator, name))[0] == "rerank" and t[1].get("status") == "False" and t)
        assert c["reason"] == "AsSpecified", c

        emulator.merge_patch(service_path(NS, name), {"spec": {"task": None}})
        eventually(lambda: "TASK" not in env_of(emulator, name))
        _, c = eventually(lambda: (t := task_of(emulator, name))[1].get("reason") == "Inferred" and t)
        assert task_of(emulator, name)[0] == "rerank" and c["status"] == "False"

        # Mode off: nothing scrapes the pods, so the served task and its condition would go stale.
        emulator.merge_patch(service_path(NS, name), {"spec": {"autoscaling": {"mode": "off"}}})
        eventually(lambda: task_of(emulator, name) == (None, {}))
