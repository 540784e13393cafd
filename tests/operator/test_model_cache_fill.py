"""spec.modelCache.prefill against the emulator, through the real operator process: the fill Job
is created once per model revision, the pods are not rolled onto a revision before its Job has
succeeded, and a failed Job is Degraded, naming it. kmock runs no Job controller: the test writes
the Job's status as that controller would (conditions SuccessCriteriaMet and Complete, succeeded)."""

from tests.operator.conftest import eventually
from tests.operator.emulator import applies, new_service, service_path

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


def fill_jobs(emulator, ns):
    return {j["metadata"]["name"]: j for j in (emulator.get(f"/apis/batch/v1/namespaces/{ns}/jobs") or {}).get("items", [])
            if j["metadata"]["name"].startswith("filled-fill-")}


def created(name):
    return [a for a in applies if a["kind"] == "Job" and a["name"] == name]


def reconciled(emulator, ns, generation):
    return lambda: (cr := emulator.get(service_path(ns, "filled"))) and cr["status"].get("observedGeneration", 0) >= generation and cr


def test_the_fill_job_runs_once_per_revision_and_the_pods_wait_for_it(emulator, operator, namespace):
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
