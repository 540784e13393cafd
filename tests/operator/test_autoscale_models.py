"""Autoscaling pods that serve several models: each model's tokens over its own capacity are busy
seconds, and decide() sums them (demand, backlog, the queue a pod holds), capacity 1 per pod. A mix
of models scales as one model of the same device time; a model served by some pods only, and a
server from before the model label, read as they should. The per-model reading of a real
exposition (prometheus_client's, parsed with its parser), and what status says of the models."""

from __future__ import annotations

import dataclasses

import prometheus_client
import pytest

from bench.operator_load import serve_metrics
from embedop import autoscale, autoscaler, demand, render, scrape, spec as specs
from embedop.autoscale import History, ModelSample, PodSample, Policy, decide
from tests.conftest import free_port, pod_addresses
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path
from tests.operator.test_scrape import kubelet_pod
from tests.operator.test_task import cluster  # noqa: F401 - the fixture: the operator's Cluster on the emulator

CAP = 1000.0  # the one model's tokens per busy second
CAPS = {"dense": 2000.0, "rerank": 500.0}  # two models of other speeds
SHARE = 0.3  # the dense model's share of each pod's device time
POLICY = Policy(1, 40, 0.7, 1.0, 0, 30, max_drain_s=0.5)


def one_model(name: str, busy: float, queued_s: float, total_s: float, ready: bool = True) -> PodSample:
    """A pod of one model: `busy` device seconds wanted per second, `queued_s` queued, its offered
    counter at `total_s` device seconds' worth."""
    return PodSample(name, ready, ready, CAP, busy * CAP, queued_s * CAP, offered_total=total_s * CAP,
                     busy_seconds=300.0, backlog_limit_s=0.45)


def two_models(name: str, busy: float, queued_s: float, total_s: float, ready: bool = True) -> PodSample:
    """The same device time, SHARE of it the dense model's, the rest the reranker's."""
    def reading(model: str, share: float) -> ModelSample:
        cap = CAPS[model]
        return ModelSample(model, cap, share * busy * cap, share * queued_s * cap, share * total_s * cap, 150.0, 0.45)
    return PodSample(name, ready, ready, models=(reading("dense", SHARE), reading("rerank", 1 - SHARE)))


# A service's life, one decision per 15 s: (device seconds offered per second, per pod queue in s).
TRACE = [(1.2, 0.0), (1.2, 0.1), (3.9, 0.2), (3.9, 1.5), (3.9, 1.6), (4.4, 0.3), (4.9, 0.3), (5.6, 0.3), (6.3, 0.2),
         (6.3, 0.1), (2.0, 0.0), (2.0, 0.0), (2.0, 0.0), (1.1, 0.0), (0.4, 0.0), (0.4, 0.0), (0.4, 0.0)]


def replay(sample) -> list[autoscale.Decision]:
    history, now, current, totals, decisions = History(), 1000.0, 2, {}, []
    for fleet_busy, queued_s in TRACE:
        samples = []
        for i in range(current):
            name = f"p{i}"
            totals[name] = totals.get(name, 0.0) + fleet_busy / current * 15
            samples.append(sample(name, fleet_busy / current, queued_s, totals[name]))
        d = decide(samples, current, POLICY, history, now)
        decisions.append(d)
        history, current, now = d.history, d.desired, now + 15
    return decisions


def test_a_mix_of_models_scales_as_one_model_of_the_same_device_time():
    one, mixed = replay(one_model), replay(two_models)
    sizes = [d.desired for d in one]
    assert len(set(sizes)) > 3 and max(sizes) > 2 * min(sizes), sizes  # the trace moves the fleet
    assert [d.desired for d in mixed] == sizes
    assert [(d.recommendation, d.needed, d.limited) for d in mixed] == [(d.recommendation, d.needed, d.limited) for d in one]
    for a, b in zip(one, mixed):
        assert b.load == pytest.approx(a.load, rel=1e-9) and a.load == pytest.approx(a.demand / CAP, rel=1e-9)
        assert a.capacity == CAP and dict(b.capacities) == CAPS
    assert "busy s/s of 2 models" in next(d.reason for d in mixed if d.reason.startswith("scale up"))
    assert "tok/s" in next(d.reason for d in one if d.reason.startswith("scale up"))


def test_each_models_offered_load_is_counted_in_its_own_tokens():
    d = replay(two_models)[2]
    offered = dict(d.offered_by_model)
    assert offered["dense"] / CAPS["dense"] + offered["rerank"] / CAPS["rerank"] == pytest.approx(TRACE[2][0])
    assert d.offered == pytest.approx(sum(offered.values()))  # every model's tokens


def test_a_model_served_by_some_pods_only():
    """A rollout that adds a model: two pods serve both, the third only the first. The reranker's
    capacity is the median over the pods that serve it, its demand theirs."""
    def pod(name, dense, rerank=None):
        models = (ModelSample("dense", 1000.0, dense, busy_seconds=60.0),
                  *(() if rerank is None else (ModelSample("rerank", 500.0, rerank, busy_seconds=60.0),)))
        return PodSample(name, True, True, models=models)

    policy = Policy(1, 20, 0.5, 1.0, 0, 60)
    calm = decide([pod("a", 300, 100), pod("b", 300, 100), pod("c", 500)], 3, policy, History(), 1000.0)
    assert dict(calm.capacities) == {"dense": 1000.0, "rerank": 500.0}
    assert calm.load == pytest.approx(0.5 + 0.5 + 0.5) and calm.desired == 3  # 1.5 / 0.5
    busy = decide([pod("a", 300, 400), pod("b", 300, 100), pod("c", 500)], 3, policy, calm.history, 1015.0)
    assert busy.load == pytest.approx(0.3 + 0.8 + 0.5 + 0.5) and busy.desired == 5  # 2.1 / 0.5 → 5


def test_a_model_no_pod_has_measured_counts_nothing_until_one_does():
    pods = [PodSample(f"p{i}", True, True, models=(ModelSample("dense", 1000.0, 500.0), ModelSample("new", 0.0, 900.0)))
            for i in range(2)]
    d = decide(pods, 2, Policy(1, 20, 0.5, 1.0, 0, 60), History(), 1000.0)
    assert dict(d.capacities) == {"dense": 1000.0} and d.load == pytest.approx(1.0) and d.desired == 2


def test_an_old_server_without_the_model_label_is_one_model_named_empty():
    flat = [PodSample(f"p{i}", True, True, CAP, 700.0, 100.0, offered_total=5000.0, busy_seconds=30.0) for i in range(3)]
    labelled = [dataclasses.replace(s, models=(ModelSample("", CAP, 700.0, 100.0, 5000.0, 30.0),)) for s in flat]
    a, b = (decide(s, 3, POLICY, History(), 1000.0) for s in (flat, labelled))
    assert (a.desired, a.demand, a.capacities) == (b.desired, b.demand, b.capacities) == (3, pytest.approx(2100.0), (("", CAP),))


def test_a_pods_drain_is_every_models_queued_device_time():
    pod = PodSample("p", True, True, models=(ModelSample("dense", 2000.0, queued_tokens=400.0),
                                               ModelSample("rerank", 500.0, queued_tokens=50.0),
                                               ModelSample("new", 0.0, queued_tokens=10.0)))
    assert demand.drain_s(pod.readings()) == pytest.approx(0.2 + 0.1)
    idle = PodSample("q", True, True, models=(ModelSample("dense", 2000.0, queued_tokens=800.0),))
    timed = PodSample("p", True, True, models=pod.models[:2])
    # The idlest pod by device time goes first (0.3 s queued against 0.4 s), not the one of fewer tokens.
    assert list(autoscale.removal_marks([timed, idle], {"p": {}, "q": {}}, 1, None)) == ["p"]
    # A queue that cannot be timed (a model with no rate yet) is not idle: that pod goes last.
    assert list(autoscale.removal_marks([pod, idle], {"p": {}, "q": {}}, 1, None)) == ["q"]


# -- Reading an exposition per model.

def exposition(models: dict[str, dict], info: bool = True, label: bool = True) -> str:
    """What a server of several models exports (prometheus_client's own text), per model:
    rate, arrival, queued, offered, busy, limit, task; and pod totals without the label."""
    reg = prometheus_client.CollectorRegistry()
    names = ["model"] if label else []
    series = {"rate": ("embedfleet_service_rate_tokens_per_second", prometheus_client.Gauge),
              "arrival": ("embedfleet_arrival_rate_tokens_per_second", prometheus_client.Gauge),
              "queued": ("embedfleet_queued_tokens", prometheus_client.Gauge),
              "offered": ("embedfleet_offered_tokens", prometheus_client.Counter),
              "busy": ("embedfleet_model_busy_seconds", prometheus_client.Counter),
              "limit": ("embedfleet_admission_backlog_limit_seconds", prometheus_client.Gauge)}
    metrics = {k: kind(name, k, names, registry=reg) for k, (name, kind) in series.items()}
    info_metric = prometheus_client.Info("embedfleet_model", "what is served", ["model"], registry=reg)
    rejected = prometheus_client.Counter("embedfleet_rejected_requests", "refused", ["reason", *names], registry=reg)
    prometheus_client.Gauge("embedfleet_queued_requests", "pod total", registry=reg).set(3)
    prometheus_client.Gauge("embedfleet_capacity_busy_seconds_per_second", "1 per device", registry=reg).set(1)
    for model, values in models.items():
        for key, metric in metrics.items():
            if key in values:
                m = metric.labels(model) if label else metric
                m.inc(values[key]) if key in ("offered", "busy") else m.set(values[key])
        rejected.labels("drain_time", *([model] if label else [])).inc(2)
        if info and values.get("task"):
            info_metric.labels(model).info({"task": values["task"], "source": f"org/{model}", "device": "cuda"})
    return prometheus_client.generate_latest(reg).decode()


STACK = {"dense": {"rate": 2000, "arrival": 800, "queued": 40, "offered": 9000, "busy": 12, "limit": 0.45, "task": "embed"},
         "rerank": {"rate": 500, "arrival": 150, "queued": 5, "offered": 3000, "busy": 7, "limit": 0.45, "task": "rerank"}}


def test_each_model_is_read_by_its_label_with_its_task():
    got = scrape.read_models(exposition(STACK))
    assert got == {
        "dense": {"service_rate": 2000.0, "arrival_rate": 800.0, "queued_tokens": 40.0, "offered_total": 9000.0,
                  "busy_seconds": 12.0, "backlog_limit_s": 0.45, "task": "embed"},
        "rerank": {"service_rate": 500.0, "arrival_rate": 150.0, "queued_tokens": 5.0, "offered_total": 3000.0,
                   "busy_seconds": 7.0, "backlog_limit_s": 0.45, "task": "rerank"}}


def test_an_old_servers_unlabelled_series_are_the_model_named_empty_with_its_one_task():
    old = exposition({"m": STACK["dense"]}, label=False)
    assert list(scrape.read_models(old)) == [""] and scrape.read_models(old)[""]["task"] == "embed"
    sample = scrape.sample_of({"name": "p", "ready": True, "served": False, "startup_s": None}, scrape.read_models(old))
    assert (sample.service_rate, sample.task, sample.models[0].model) == (2000.0, "embed", "")


def test_a_one_model_server_with_the_label_reads_as_before():
    """A one-model pod's sample carries its model's readings in its own fields too (status.task,
    the service rate), as before the label."""
    models = scrape.read_models(exposition({"minilm": STACK["dense"]}))
    sample = scrape.sample_of({"name": "p", "ready": True, "served": False, "startup_s": None}, models)
    assert (sample.service_rate, sample.queued_tokens, sample.task) == (2000.0, 40.0, "embed")
    assert sample.readings() == (ModelSample("minilm", 2000.0, 800.0, 40.0, 9000.0, 12.0, 0.45, "embed"),)
    assert scrape.read_exposition(exposition({"minilm": STACK["dense"]}))[1] == "embed"


async def test_a_pod_of_several_models_is_scraped_per_model_and_one_without_a_models_series_is_blind():
    ip, port = "127.0.0.39", free_port()
    broken = {**STACK, "rerank": {k: v for k, v in STACK["rerank"].items() if k != "rate"}}
    good = serve_metrics(ip, port, exposition(STACK))
    bad_port = free_port()
    bad = serve_metrics(ip, bad_port, exposition(broken))
    try:
        async with scrape.Reader() as reader:
            errors = {}
            (sample,) = await reader.scrape([kubelet_pod(ip=ip)], (port,), 2, errors)
            (blind,) = await reader.scrape([kubelet_pod("q", ip=ip)], (bad_port,), 2, errors)
    finally:
        good.shutdown()
        bad.shutdown()
    assert sample.scraped, errors
    assert [(r.model, r.service_rate, r.task) for r in sample.readings()] == [("dense", 2000.0, "embed"),
                                                                              ("rerank", 500.0, "rerank")]
    assert not blind.scraped and "embedfleet_service_rate_tokens_per_second" in errors["q"] and "rerank" in errors["q"]


# -- What status says of the models (the autoscaler's writer, against the emulated API).

NS = "default"
SPEC = {"models": [{"name": "dense", "model": "org/dense", "task": "embed"},
                   {"name": "rerank", "model": "org/rerank", "task": "rerank"}],
        "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"}}


def decision(offered: dict[str, float]) -> autoscale.Decision:
    return autoscale.Decision(desired=1, reason="steady", recommendation=1, capacity=2000.0, demand=0.0, forecast=0.0,
                              limited=False, history=History(), offered=sum(offered.values()),
                              capacities=tuple(CAPS.items()), offered_by_model=tuple(offered.items()))


def pod_sample(tasks: dict[str, str | None]) -> PodSample:
    return PodSample("p", True, True, models=tuple(
        ModelSample(m, CAPS[m], 100.0, queued_tokens=200.0, task=t) for m, t in tasks.items()))


async def test_status_reports_each_model_and_their_tasks_and_writes_only_changes(emulator, cluster):
    emulator.request("POST", service_path(NS), new_service("stack", SPEC))
    spec = specs.defaulted(SPEC)

    async def write(tasks, offered=None, due=False):
        await autoscaler._write_status(cluster, NS, "stack", spec, decision(offered or {"dense": 800.0, "rerank": 150.0}),
                                       [pod_sample(tasks)], 1, due=due)
        return emulator.get(service_path(NS, "stack"))

    first = await write({"dense": "embed", "rerank": "embed"})
    st = first["status"]
    assert st["models"] == [
        {"name": "dense", "task": "embed", "serviceRateTokensPerSecond": 2000.0, "arrivalRateTokensPerSecond": 800.0},
        {"name": "rerank", "task": "embed", "serviceRateTokensPerSecond": 500.0, "arrivalRateTokensPerSecond": 150.0}]
    assert st["task"] == "embed" and st["serviceRateTokensPerSecond"] == 2000.0  # the first model's
    assert st["arrivalRateTokensPerSecond"] == 950.0 and st["estimatedDrainMs"] == pytest.approx(100 + 400)
    mismatch = next(c for c in st["conditions"] if c["type"] == "TaskMismatch")
    assert mismatch["status"] == "True" and "models[rerank].task is rerank but the pods serve embed" in mismatch["message"]
    # At rest, and with measurements that moved but are not due: nothing written.
    assert (await write({"dense": "embed", "rerank": "embed"}, {"dense": 880.0, "rerank": 150.0}))[
        "metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    agreed = (await write({"dense": "embed", "rerank": "rerank"}))["status"]
    assert agreed["task"] == "embed,rerank" and [m["task"] for m in agreed["models"]] == ["embed", "rerank"]
    assert next(c for c in agreed["conditions"] if c["type"] == "TaskMismatch")["reason"] == "AsSpecified"
    moved = (await write({"dense": "embed", "rerank": "rerank"}, {"dense": 1600.0, "rerank": 150.0}, due=True))["status"]
    assert moved["models"][0]["arrivalRateTokensPerSecond"] == 1600.0


# -- The whole path: the real operator, a Pod the test posts, its /metrics served by the test.

def test_a_service_of_several_models_with_the_real_operator(emulator, tmp_path):
    """Rendered as MODELS, its Model column a summary; each model's task and rates in status
    from a pod's per-model /metrics; a pod whose models do not fit its device (its termination
    message) makes the service Degraded with the numbers, at once, until that pod is gone."""
    name, port = "stack-live", render.HTTP_PORT
    (ip,) = pod_addresses(port)
    server = serve_metrics(ip, port, exposition(STACK))
    op = OperatorProcess(emulator.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator.log",
                         env={"EMBEDOP_SCRAPE_TIMEOUT_S": "1", "EMBEDOP_RESYNC_SECONDS": "30"})
    pods = f"/api/v1/namespaces/{NS}/pods"
    misfit = ("models do not fit the device: dense 1.20 GiB + rerank 2.30 GiB + margin 1.00 GiB = 4.50 GiB "
              "> device 4.00 GiB")
    with op.running(server):
        emulator.request("POST", service_path(NS), new_service(name, {
            **SPEC, "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 2, "intervalSeconds": 1}}))
        d = eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"))
        env = {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert "MODELS" in env and "MODEL_PATH" not in env
        eventually(lambda: emulator.get(service_path(NS, name))["status"]["modelSummary"] == "2 models: dense, rerank")
        emulator.request("POST", pods, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-0", "namespace": NS, "labels": render.labels(name)},
            "spec": {"containers": [{"name": "server", "image": "embedserve"}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})
        st = eventually(lambda: (s := emulator.get(service_path(NS, name))["status"]).get("task") and s)
        assert [(m["name"], m.get("task")) for m in st["models"]] == [("dense", "embed"), ("rerank", "rerank")]
        assert st["task"] == "embed,rerank"
        assert [m.get("serviceRateTokensPerSecond") for m in st["models"]] == [2000.0, 500.0]

        emulator.request("POST", pods, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-1", "namespace": NS, "labels": render.labels(name)},
            "spec": {"containers": d["spec"]["template"]["spec"]["containers"]},  # a pod of the present template
            "status": {"phase": "Running", "podIP": "10.9.9.9", "conditions": [{"type": "Ready", "status": "False"}],
                       "containerStatuses": [{"name": "server", "ready": False, "restartCount": 2, "image": "embedserve",
                                              "imageID": "", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                              "lastState": {"terminated": {"exitCode": 1, "message": misfit}}}]}})

        def degraded():
            return next(c for c in emulator.get(service_path(NS, name))["status"]["conditions"] if c["type"] == "Degraded")
        # Within the periodic check's 30 s only because the pod's event reconciles the service.
        c = eventually(lambda: (c := degraded())["reason"] == "ModelsDoNotFit" and c, timeout=20)
        assert c["status"] == "True" and c["message"].startswith(misfit) and f"{name}-1" in c["message"]
        emulator.request("DELETE", f"{pods}/{name}-1")
        eventually(lambda: degraded()["reason"] != "ModelsDoNotFit", timeout=60)


def test_a_model_renamed_in_a_rollout_is_no_ramp():
    """A rolling update that renames the model (spec.model changed, a spec.models entry renamed,
    a server upgraded from the unlabelled series): pod by pod the old name's load moves to the new
    one, the fleet's device time steady. Each name's points keep its capacity while they are in
    the trend's window: read as a fall and a rise, converted at 0, they were a ramp and a pod more."""
    def renamed(pod: PodSample, model: str) -> PodSample:
        return dataclasses.replace(pod, models=(dataclasses.replace(pod.readings()[0], model=model),))

    history, now, totals, desired = History(), 1000.0, {}, []
    for step in range(12):
        samples = []
        for i in range(4):
            name = f"p{i}"
            totals[name] = totals.get(name, 0.0) + 0.7 * 15
            moved = i < step - 4  # from step 5 on, one pod a step serves the renamed model
            samples.append(renamed(one_model(name, 0.7, 0.0, totals[name]), "new" if moved else "old"))
        d = decide(samples, 4, POLICY, history, now)
        desired.append(d.desired)
        history, now = d.history, now + 15
    assert set(desired) == {4}, desired  # 4 pods busy 0.7 each at a target of 0.7: 4 throughout
