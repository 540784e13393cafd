"""spec.modelCache.prefill against the emulator, through the real operator process: the fill Job
is created once per model revision, the pods are not rolled onto a revision before its Job has
succeeded, and a failed Job is Degraded, naming it; a claim deleted and made again (empty) is
filled again, and the claim's access modes are reported. kmock runs no Job controller: the test
writes the Job's status as that controller would (conditions SuccessCriteriaMet and Complete,
succeeded)."""

import pytest

from tests.operator.conftest import eventually
from tests.operator.emulator import applies, deletes, new_service, service_path

SPEC = {"model": "org/model", "modelRevision": "v1", "replicas": 1, "autoscaling": {"mode": "off"},
        "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
        "modelCache": {"claimName": "models-rwx", "prefill": True}}
COMPLETE = {"status": {"succeeded": 1, "startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:01:00Z",
                       "conditions": [{"type": "SuccessCriteriaMet", "status": "True"}, {"type": "Complete", "status": "True"}]}}
FAILED = {"status": {"failed": 5, "conditions": [
    {"type": "FailureTarget", "status": "True", "reason": "BackoffLimitExceeded"},
    {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}]}}


def env_of(deployment):
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def condition(cr, type_):
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def fill_jobs(emulator, ns, service="filled"):
    return {j["metadata"]["name"]: j for j in (emulator.get(f"/apis/batch/v1/namespaces/{ns}/jobs") or {}).get("items", [])
            if j["metadata"]["name"].startswith(f"{service}-fill-")}


def created(name):
    return [c for c in applies if c["create"] and c["kind"] == "Job" and c["name"] == name]


def make_claim(emulator, ns, name="models-rwx", modes=("ReadWriteMany",)) -> dict:
    """A claim as a user makes it, bound (a real cluster's controller writes its status)."""
    path = f"/api/v1/namespaces/{ns}/persistentvolumeclaims"
    made = emulator.request("POST", path, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": ns},
        "spec": {"accessModes": list(modes), "resources": {"requests": {"storage": "1Gi"}}}})
    emulator.merge_patch(f"{path}/{name}/status", {"status": {"phase": "Bound", "accessModes": list(modes)}})
    return made


@pytest.fixture(scope="module")
def claims(emulator, namespace):
    make_claim(emulator, namespace)


def reconciled(emulator, ns, generation, service="filled"):
    return lambda: (cr := emulator.get(service_path(ns, service))) and cr["status"].get("observedGeneration", 0) >= generation and cr


def test_the_fill_job_runs_once_per_revision_and_the_pods_wait_for_it(emulator, operator, namespace, claims):
    ns, deploy = namespace, f"/apis/apps/v1/namespaces/{namespace}/deployments/filled"
    cr = emulator.request("POST", service_path(ns), new_service("filled", SPEC, ns))
    (v1,) = eventually(lambda: fill_jobs(emulator, ns))
    job = fill_jobs(emulator, ns)[v1]
    assert job["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
    cr = eventually(lambda: condition(c := emulator.get(service_path(ns, "filled")), "Progressing").get("reason")
                    == "FillingModelCache" and c)
    assert v1 in condition(cr, "Progressing")["message"] and condition(cr, "Degraded")["status"] == "False"
    # Re-reconciled (a spec change the Job does not depend on): no second Job, no Deployment yet.
    emulator.merge_patch(service_path(ns, "filled"), {"spec": {"replicas": 2}})
    eventually(reconciled(emulator, ns, 2))
    assert len(created(v1)) == 1 and list(fill_jobs(emulator, ns)) == [v1]
    assert emulator.get(deploy) is None

    emulator.merge_patch(f"/apis/batch/v1/namespaces/{ns}/jobs/{v1}/status", COMPLETE)
    d = eventually(lambda: emulator.get(deploy))
    e = env_of(d)
    assert (e["MODEL_REVISION"], e["HF_HUB_OFFLINE"]) == ("v1", "1") and d["spec"]["replicas"] == 2
    cr = eventually(lambda: condition(c := emulator.get(service_path(ns, "filled")), "Progressing").get("reason")
                    not in (None, "FillingModelCache") and c)

    # A new revision: a new Job; the pods stay on v1 until it has succeeded, and the count still moves.
    emulator.merge_patch(service_path(ns, "filled"), {"spec": {"modelRevision": "v2", "replicas": 3}})
    v2 = eventually(lambda: next(iter(set(fill_jobs(emulator, ns)) - {v1}), None))
    eventually(lambda: emulator.get(deploy)["spec"]["replicas"] == 3)
    cr = eventually(reconciled(emulator, ns, 3))
    assert env_of(emulator.get(deploy))["MODEL_REVISION"] == "v1"
    assert condition(cr, "Progressing")["reason"] == "FillingModelCache" and v2 in condition(cr, "Progressing")["message"]

    emulator.merge_patch(f"/apis/batch/v1/namespaces/{ns}/jobs/{v2}/status", FAILED)
    cr = eventually(lambda: condition(c := emulator.get(service_path(ns, "filled")), "Degraded").get("reason")
                    == "ModelCacheFillFailed" and c)
    assert v2 in condition(cr, "Degraded")["message"] and "BackoffLimitExceeded" in condition(cr, "Degraded")["message"]
    assert env_of(emulator.get(deploy))["MODEL_REVISION"] == "v1"  # the fleet keeps serving v1
    assert len(created(v1)) == 1 and len(created(v2)) == 1


def test_a_fill_is_recorded_and_an_earlier_revisions_job_deleted_once_a_later_one_succeeded(emulator, operator,
                                                                                            namespace, claims):
    """status.modelCache.filled, not the Job's existence, says the claim holds a revision: a Job
    deleted afterwards (a TTL an admission policy added, a person) is not run again and holds
    nothing; once a later revision's Job has succeeded, the earlier one's goes (its pods with it)."""
    ns, deploy = namespace, f"/apis/apps/v1/namespaces/{namespace}/deployments/refill"
    jobs = f"/apis/batch/v1/namespaces/{ns}/jobs"
    emulator.request("POST", service_path(ns), new_service("refill", SPEC, ns))
    (v1,) = eventually(lambda: fill_jobs(emulator, ns, "refill"))
    emulator.merge_patch(f"{jobs}/{v1}/status", COMPLETE)
    eventually(lambda: emulator.get(deploy))
    cr = eventually(lambda: ((c := emulator.get(service_path(ns, "refill"))).get("status") or {}).get("modelCache") and c)
    assert cr["status"]["modelCache"]["filled"] == fill_jobs(emulator, ns, "refill")[v1]["metadata"]["labels"][
        "embedfleet.dev/model-cache-fill"]

    emulator.merge_patch(service_path(ns, "refill"), {"spec": {"modelRevision": "v2"}})
    v2 = eventually(lambda: next(iter(set(fill_jobs(emulator, ns, "refill")) - {v1}), None))
    assert v1 in fill_jobs(emulator, ns, "refill")  # kept while v2 is not filled: v1 is what the pods run
    emulator.merge_patch(f"{jobs}/{v2}/status", COMPLETE)
    eventually(lambda: env_of(emulator.get(deploy))["MODEL_REVISION"] == "v2")
    eventually(lambda: list(fill_jobs(emulator, ns, "refill")) == [v2])
    (deleted,) = [d for d in deletes if d[1:4] == ("jobs", ns, v1)]
    assert "Background" in str(deleted[4]), deleted  # a Job's own default orphans its pods

    emulator.request("DELETE", f"{jobs}/{v2}")  # as a TTL controller would
    emulator.merge_patch(service_path(ns, "refill"), {"spec": {"replicas": 2}})
    cr = eventually(reconciled(emulator, ns, 3, "refill"))
    eventually(lambda: emulator.get(deploy)["spec"]["replicas"] == 2)  # not held
    assert not fill_jobs(emulator, ns, "refill") and len(created(v2)) == 1
    assert condition(cr, "Progressing")["reason"] != "FillingModelCache"


def test_a_job_of_the_fills_name_that_is_not_the_services_proves_nothing():
    """Someone else's Job, even Complete, holds the pods (the reconcile says NotOwned; the
    autoscaler, which reads the same Fill, must not roll the template past it)."""
    from embedop import fill as fills, render, spec as specs
    from tests.operator.test_render import OWNER

    spec = specs.defaulted(SPEC)
    job = render.fill_job(OWNER, spec, "img", 45)
    ours = {**job, **COMPLETE}
    theirs = {**ours, "metadata": {**job["metadata"], "ownerReferences": []}}
    assert not fills.of(job, ours, spec, OWNER).holds
    assert fills.of(job, theirs, spec, OWNER).holds and fills.of(job, theirs, spec, OWNER).foreign
    digest = job["metadata"]["labels"]["embedfleet.dev/model-cache-fill"]
    assert not fills.of(job, None, spec, OWNER, filled=digest).holds  # recorded: a deleted Job is no loss
    assert fills.of(job, None, spec, OWNER, filled="another").missing


def test_a_running_fill_does_not_hide_a_failing_fleet():
    from embedop import status

    failing = {"spec": {"replicas": 2}, "status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2, "conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "too slow"}]}}
    st = status.from_deployment(failing, 2, [], 4, [], fill=("Running", "Job j is filling m"))
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    progressing = next(c for c in st["conditions"] if c["type"] == "Progressing")
    assert (degraded["status"], degraded["reason"]) == ("True", "ProgressDeadlineExceeded")
    assert (progressing["reason"], progressing["message"]) == ("FillingModelCache", "Job j is filling m")
    first = status.from_deployment(None, 2, [], 4, [], fill=("Running", "Job j is filling m"))
    assert next(c for c in first["conditions"] if c["type"] == "Degraded")["reason"] == "FillingModelCache"


def test_a_claim_made_again_under_its_name_is_filled_again(emulator, operator, namespace):
    """The fill is keyed by the claim's uid, not its name: a claim deleted and created again is a
    new, empty volume, and trusting the record (or the old Job) would roll pods onto nothing."""
    ns, claims = namespace, f"/api/v1/namespaces/{namespace}/persistentvolumeclaims"
    first = make_claim(emulator, ns, "models-again")
    spec = {**SPEC, "modelCache": {"claimName": "models-again", "prefill": True}}
    emulator.request("POST", service_path(ns), new_service("again", spec, ns))
    (v1,) = eventually(lambda: fill_jobs(emulator, ns, "again"))
    emulator.merge_patch(f"/apis/batch/v1/namespaces/{ns}/jobs/{v1}/status", COMPLETE)
    cr = eventually(lambda: ((c := emulator.get(service_path(ns, "again"))).get("status") or {}).get("modelCache") and c)
    filled = cr["status"]["modelCache"]["filled"]

    emulator.request("DELETE", f"{claims}/models-again")
    second = make_claim(emulator, ns, "models-again")
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    v2 = eventually(lambda: next(iter(set(fill_jobs(emulator, ns, "again")) - {v1}), None))
    assert len(created(v2)) == 1
    cr = eventually(lambda: condition(c := emulator.get(service_path(ns, "again")), "Progressing").get("reason")
                    == "FillingModelCache" and c)
    assert v2 in condition(cr, "Progressing")["message"]
    assert (cr["status"].get("modelCache") or {}).get("filled") in (None, filled)  # the old record fills nothing now


def test_no_fill_job_is_made_before_its_claim_exists(emulator, operator, namespace):
    ns = namespace
    spec = {**SPEC, "modelCache": {"claimName": "models-later", "prefill": True}}
    emulator.request("POST", service_path(ns), new_service("later", spec, ns))
    cr = eventually(lambda: "models-later does not exist" in condition(c := emulator.get(service_path(ns, "later")),
                                                                       "Progressing").get("message", "") and c)
    assert condition(cr, "Progressing")["reason"] == "FillingModelCache"
    assert condition(cr, "ModelCacheShared")["status"] == "Unknown"
    assert not fill_jobs(emulator, ns, "later") and not [c for c in applies if (c["name"] or "").startswith("later-fill-")]
    make_claim(emulator, ns, "models-later")
    eventually(lambda: fill_jobs(emulator, ns, "later"))  # at its next periodic check (2 s here)


@pytest.mark.parametrize("modes, shared, reason", [
    (("ReadWriteMany",), "True", "ReadWriteMany"),
    (("ReadWriteOnce",), "False", "ReadWriteOnce"),
    (("ReadWriteOncePod",), "False", "ReadWriteOncePod"),
], ids=["RWX", "RWO", "RWOP"])
def test_the_claims_access_mode_is_reported_never_refused(emulator, operator, namespace, modes, shared, reason):
    """A claim all pods share read-write (kind claim): ReadWriteOnce pods off its node wait in
    ContainerCreating (Multi-Attach) and ReadWriteOncePod's second pod stays Pending; the status
    says so, naming the claim and its mode, and the fleet is made anyway (one node works)."""
    ns, name = namespace, f"shared-{reason.lower()}"
    make_claim(emulator, ns, f"{name}-claim", modes)
    spec = {**SPEC, "modelCache": {"claimName": f"{name}-claim"}}
    emulator.request("POST", service_path(ns), new_service(name, spec, ns))
    cr = eventually(lambda: condition(c := emulator.get(service_path(ns, name)), "ModelCacheShared") and c)
    c = condition(cr, "ModelCacheShared")
    assert (c["status"], c["reason"]) == (shared, reason) and f"{name}-claim" in c["message"] and reason in c["message"]
    assert emulator.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")
    assert condition(cr, "Degraded")["status"] == "False"


def test_claims_are_read_from_a_watch_never_by_name(emulator, operator):
    """After the scenarios above: the claims came from one list and a watch (an operator at rest
    reads them from its copy), never a GET per check; every call is one the chart grants."""
    from embedop.kube import CALLS
    from tests.operator import emulator as em

    calls = em.recorded["operator"]
    assert {c for c in calls if c[1] == "persistentvolumeclaims"} == {
        ("", "persistentvolumeclaims", "list"), ("", "persistentvolumeclaims", "watch")}
    assert calls <= CALLS, calls - CALLS


def test_a_claims_absence_is_trusted_only_once_the_claims_are_listed(tmp_path, monkeypatch):
    """Before the claims' informer has listed them (its list refused by an older chart's RBAC, or
    not done yet) a claim missing from the copy is read by name: a refusal is an error to report,
    not a claim that does not exist."""
    import asyncio

    from embedop import cache
    from embedop.kube import Kube
    from tests.operator import emulator as em
    from tests.operator.emulator import Emulator

    with Emulator(subject="claims-probe") as e:
        monkeypatch.setenv("KUBECONFIG", str(e.kubeconfig(tmp_path / "kubeconfig")))

        async def scenario():
            kube = Kube.connect()
            cluster = cache.Cluster(kube, {"PersistentVolumeClaim": cache.Store()})
            cluster.listed["PersistentVolumeClaim"] = listed = asyncio.Event()
            try:
                assert await cluster.get("PersistentVolumeClaim", "default", "nope", ours=True) is None  # read: 404
                reads = {c for c in em.recorded["claims-probe"] if c[1] == "persistentvolumeclaims"}
                assert reads == {("", "persistentvolumeclaims", "get")}
                listed.set()
                mark = len(em.calls)
                assert await cluster.get("PersistentVolumeClaim", "default", "nope", ours=True) is None  # the copy
                assert not [c for c in em.calls[mark:] if c["subject"] == "claims-probe"]
            finally:
                await kube.close()

        asyncio.run(scenario())


# What chart 0.2.x's operator keyed these fills by (render_cache.fill_digest at 46abe4b: the claim's
# name, no uid), for UPGRADED below: pinned, since it is what their statuses and Job names hold.
LEGACY = {"upgraded": "8ad6c075a9", "upgraded-job": "d4a808db97"}
UPGRADED = {**SPEC, "modelCache": {"claimName": "models-up", "prefill": True}}


def test_the_legacy_digest_is_what_chart_0_2_keyed_fills_by():
    from embedop import render, render_cache, spec as specs

    spec = specs.defaulted(UPGRADED)
    for name, digest in LEGACY.items():
        assert render_cache.fill_digest(name, spec, render.server_env(spec, 45)) == digest
        assert render_cache.fill_digest(name, spec, render.server_env(spec, 45), "uid") != digest


def test_an_upgrade_does_not_fill_again_what_chart_0_2_filled(tmp_path):
    """Services whose fill an operator of chart 0.2.x recorded (status.modelCache.filled without
    the claim's uid in its key), or whose fill Job of that time succeeded: the new operator runs no
    Job and holds no pod template (on a ReadWriteOncePod claim a server pod holds, the Job could
    never start); it records the uid-keyed digest and deletes the old Job."""
    from embedop import render, spec as specs
    from tests.operator.conftest import OperatorProcess
    from tests.operator.emulator import Emulator

    ns = "default"
    with Emulator() as e:
        make_claim(e, ns, "models-up", ("ReadWriteOncePod",))
        recorded = e.request("POST", service_path(ns), new_service("upgraded", UPGRADED, ns))
        e.merge_patch(f"{service_path(ns, 'upgraded')}/status", {"status": {"modelCache": {"filled": LEGACY["upgraded"]}}})
        by_job = e.request("POST", service_path(ns), new_service("upgraded-job", UPGRADED, ns))
        owner = render.Owner("upgraded-job", ns, by_job["metadata"]["uid"])
        old = render.fill_job(owner, specs.defaulted(UPGRADED), "embedserve:0.2.0", 45)  # as 0.2.x made it
        assert old["metadata"]["name"].endswith(LEGACY["upgraded-job"])
        e.request("POST", f"/apis/batch/v1/namespaces/{ns}/jobs", old)
        e.merge_patch(f"/apis/batch/v1/namespaces/{ns}/jobs/{old['metadata']['name']}/status", COMPLETE)
        op = OperatorProcess(e.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator.log")
        try:
            for cr in (recorded, by_job):
                name = cr["metadata"]["name"]
                d = eventually(lambda: e.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}"))  # not held
                assert env_of(d)["MODEL_REVISION"] == "v1"
                filled = eventually(lambda: ((e.get(service_path(ns, name)).get("status") or {}).get("modelCache")
                                             or {}).get("filled") not in (None, LEGACY[name]) and e.get(service_path(ns, name)))
                assert condition(filled, "Progressing").get("reason") != "FillingModelCache"
            eventually(lambda: not fill_jobs(e, ns, "upgraded-job"))  # the old Job goes, none is made
            assert not fill_jobs(e, ns, "upgraded")
            assert not [a for a in applies if a["create"] and a["kind"] == "Job" and a["name"].startswith("upgraded")]
        finally:
            op.stop()
