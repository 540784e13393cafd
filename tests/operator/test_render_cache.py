"""spec.modelCache rendered: each kind validates against the Kubernetes versions that have its
fields, the fill Job is named for what it fills, and today's emptyDir and claim render as before."""

import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest

from embedop import render, render_cache, spec as specs
from embedop.config import OperatorSettings
from embedserve import prefetch as prefetch_module
from embedserve.config import ConfigError, Settings
from tests.operator.test_render import K8S_VERSIONS, OWNER
from tests.server.model.fake_hub import FakeHub

ROOT = Path(__file__).resolve().parents[2]

IMAGE = OperatorSettings().server_image
PREFILLED = {"model": "BAAI/bge-base-en-v1.5", "modelRevision": "v1.5", "resources": {"gpu": 1},
             "modelCache": {"claimName": "models-rwx", "prefill": True},
             "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
             "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
IMAGE_VOLUME = {"model": "BAAI/bge-base-en-v1.5",
                "modelCache": {"image": {"reference": "registry.example/models/bge:1.5", "path": "models/bge"}}}
# ImageVolumeSource is in the Kubernetes API (and kubernetes-validate's schemas) from 1.31.
IMAGE_VOLUME_VERSIONS = [v for v in K8S_VERSIONS if tuple(map(int, v.split(".")[:2])) >= (1, 31)]


def pod(spec):
    return render.deployment(OWNER, specs.defaulted(spec), IMAGE, 1, 45)["spec"]["template"]["spec"]


def env(spec):
    return {e["name"]: e.get("value") for e in pod(spec)["containers"][0]["env"]}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_prefilled_claim_and_its_job_validate(version):
    spec = specs.defaulted(PREFILLED)
    assert specs.problems(spec) == []
    kubernetes_validate.validate(render.deployment(OWNER, spec, IMAGE, 2, 45), version, strict=True)
    kubernetes_validate.validate(render.fill_job(OWNER, spec, IMAGE, 45), version, strict=True)


@pytest.mark.parametrize("version", IMAGE_VOLUME_VERSIONS)
def test_the_image_volume_validates_where_kubernetes_has_it(version):
    kubernetes_validate.validate(render.deployment(OWNER, specs.defaulted(IMAGE_VOLUME), IMAGE, 2, 45), version, strict=True)


def test_before_1_31_there_is_no_image_volume():
    with pytest.raises(kubernetes_validate.ValidationError, match="'image' was unexpected"):
        kubernetes_validate.validate(render.deployment(OWNER, specs.defaulted(IMAGE_VOLUME), IMAGE, 2, 45), "1.30.0",
                                     strict=True)


def test_the_pods_read_a_prefilled_claim_read_only_and_offline():
    p = pod(PREFILLED)
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models-rwx", "readOnly": True}} in p["volumes"]
    assert {"name": "model-cache", "mountPath": "/models", "readOnly": True} in p["containers"][0]["volumeMounts"]
    e = env(PREFILLED)
    assert (e["MODEL_PATH"], e["MODEL_REVISION"], e["HF_HUB_OFFLINE"]) == ("BAAI/bge-base-en-v1.5", "v1.5", "1")


def test_the_fill_job_downloads_with_the_servers_settings_into_the_claim():
    spec = specs.defaulted(PREFILLED)
    job = render.fill_job(OWNER, spec, IMAGE, 45)
    assert job["metadata"]["name"] == render.fill_job_name(OWNER, spec, 45)
    assert job["metadata"]["name"].startswith("svc-fill-") and len(job["metadata"]["name"]) <= 63
    assert job["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert "ttlSecondsAfterFinished" not in job["spec"] and job["spec"]["backoffLimit"] == render_cache.FILL_BACKOFF_LIMIT
    p = job["spec"]["template"]["spec"]
    (c,) = p["containers"]
    assert c["image"] == IMAGE and c["command"] == ["python", "-m", "embedserve.prefetch"]
    e = {x["name"]: x for x in c["env"]}
    assert e["MODEL_REVISION"]["value"] == "v1.5" and "HF_HUB_OFFLINE" not in e and "valueFrom" in e["HF_TOKEN"]
    assert "MAX_BATCH_SIZE" not in e and "GRPC_PORT" not in e  # serving settings mean nothing to a download
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models-rwx"}} in p["volumes"]
    assert {"name": "model-cache", "mountPath": "/models"} in c["volumeMounts"]  # read-write
    assert p["tolerations"] == PREFILLED["tolerations"] and "nvidia.com/gpu" not in c["resources"]["limits"]
    # Its pod is not one of the servers': the Services, the PDB and the autoscaler select those.
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert not all(labels.get(k) == v for k, v in render.selector("svc").items())


GUARDED = {**PREFILLED, "model": "org/minilm", "modelRevision": "v1",
           "auth": {"apiKeySecretRef": {"name": "keys"}}, "tls": {"secretRef": {"name": "cert"}, "clientAuth": True},
           "env": [*PREFILLED["env"], {"name": "MAX_BATCH_SIZE", "value": "8"},
                   {"name": "MEM", "valueFrom": {"resourceFieldRef": {"containerName": "server", "resource": "limits.memory"}}}]}


def job_environment(spec: dict, cache: Path, **values: str) -> dict[str, str]:
    """The fill container's environment as the kubelet gives it (a valueFrom resolved to a
    stand-in), its cache directory moved to `cache`."""
    (c,) = render.fill_job(OWNER, specs.defaulted(spec), IMAGE, 45)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value", "from-a-secret") for e in c["env"]}
    return {**env, "MODEL_CACHE_DIR": str(cache), **values}


@pytest.mark.parametrize("spec", [PREFILLED, GUARDED], ids=["plain", "auth-and-tls"])
def test_the_fill_jobs_environment_is_one_the_servers_settings_accept(spec, tmp_path):
    """prefetch reads Settings.from_env: the files of spec.auth and spec.tls, mounted only in the
    server pods, must not reach it (it would refuse to start: the Job would fail for ever)."""
    Settings.from_env(job_environment(spec, tmp_path))
    server = {e["name"]: e.get("value", "x") for e in pod(spec)["containers"][0]["env"]}
    if spec is GUARDED:  # the servers' own environment could not be the Job's
        with pytest.raises(ConfigError, match="API_KEYS_FILE"):
            Settings.from_env(server)


def prefetch(env: dict[str, str]) -> subprocess.CompletedProcess:
    """The fill container's command, with exactly the Job's environment (and the test's PATH)."""
    (c,) = render.fill_job(OWNER, specs.defaulted(GUARDED), IMAGE, 45)["spec"]["template"]["spec"]["containers"]
    assert c["command"][:1] == ["python"]
    return subprocess.run([sys.executable, *c["command"][1:]], capture_output=True, text=True, timeout=60,
                          env={**env, "PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT / "server")})


def test_the_fill_job_downloads_with_its_environment_and_a_missing_revision_fails_it_at_once(tmp_path):
    """The Job's command and environment (auth and TLS on, credentials from spec.env) against a hub
    on loopback: the revision lands in the cache; a revision the hub lacks exits with the code the
    Job's podFailurePolicy fails on without retrying."""
    hub = FakeHub("org/minilm", {"v1": {"config.json": b"{}", "model.safetensors": b"weights"}})
    try:
        spec = {**GUARDED, "env": [*GUARDED["env"], {"name": "HF_ENDPOINT", "value": hub.url}]}
        done = prefetch(job_environment(spec, tmp_path / "cache"))
        assert done.returncode == 0, done.stderr
        assert (Path(done.stdout.strip().splitlines()[-1]) / "model.safetensors").read_bytes() == b"weights"
        refused = prefetch(job_environment({**spec, "modelRevision": "no-such-tag"}, tmp_path / "other"))
    finally:
        hub.close()
    job = render.fill_job(OWNER, specs.defaulted(GUARDED), IMAGE, 45)
    (fail, ignore) = job["spec"]["podFailurePolicy"]["rules"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # the API requires it with the policy
    assert fail["action"] == "FailJob" and refused.returncode in fail["onExitCodes"]["values"], refused.stderr
    # Only prefetch's refusal: its 1 (a hub 5xx, a connection reset, a traceback) is retried. The
    # operator cannot import the server package; the two constants are kept equal by hand.
    assert fail["onExitCodes"]["values"] == [render_cache.PREFETCH_REFUSED] == [prefetch_module.REFUSED]
    assert fail["onExitCodes"]["containerName"] == job["spec"]["template"]["spec"]["containers"][0]["name"]
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


def test_services_with_a_long_common_prefix_get_their_own_jobs():
    long = "embedding-service-for-the-search-team-in-europe-west"  # longer than the 47 kept
    names = {render.fill_job_name(render.Owner(long + suffix, "ns", "u"), specs.defaulted(PREFILLED), 45)
             for suffix in ("-a", "-b")}
    assert len(names) == 2 and all(len(n) <= 63 for n in names)


def test_one_job_per_model_revision_and_claim():
    name = lambda **change: render.fill_job_name(OWNER, specs.defaulted({**PREFILLED, **change}), 45)
    assert name() == name(replicas=7, batching={"maxBatchSize": 64}) == name(image="other:2")  # same files
    others = [name(modelRevision="v1.6"), name(model="BAAI/bge-large-en-v1.5"),
              name(modelCache={"claimName": "other", "prefill": True}),
              name(env=[*PREFILLED["env"], {"name": "MODEL_REVISION", "value": "abc"}])]  # spec.env wins on the pods
    assert len({name(), *others}) == 5
    assert render.fill_job_name(OWNER, specs.defaulted({"model": "m", "modelCache": {"claimName": "c"}}), 45) is None


def test_a_claim_made_again_under_its_name_is_another_fill():
    """Keyed by the claim's uid: a claim deleted and made again is empty, and its Job (and the
    record status.modelCache.filled, the same digest) must differ."""
    name = lambda uid: render.fill_job_name(OWNER, specs.defaulted(PREFILLED), 45, uid)  # noqa: E731
    assert name("uid-a") != name("uid-b") and name("uid-a") == name("uid-a")
    job = render.fill_job(OWNER, specs.defaulted(PREFILLED), IMAGE, 45, claim_uid="uid-a")
    assert job["metadata"]["name"] == name("uid-a")
    assert job["metadata"]["name"].endswith(job["metadata"]["labels"][render_cache.FILL_LABEL])


def claim(*modes, bound=True):
    return {"metadata": {"name": "c", "uid": "u"}, "spec": {"accessModes": list(modes)},
            "status": {"phase": "Bound", "accessModes": list(modes)} if bound else {}}


def on(*nodes):
    return [{"metadata": {"name": f"p{i}"}, "spec": {"nodeName": n}} for i, n in enumerate(nodes)]


SHARED = {"model": "m", "modelCache": {"claimName": "models"}}


@pytest.mark.parametrize("spec, pvc, pods, status, reason, says", [
    (SHARED, claim("ReadWriteMany"), on("a", "b"), True, "ReadWriteMany", ["claim models"]),
    (SHARED, claim("ReadWriteOnce"), on("a"), False, "ReadWriteOnce", ["claim models", "Multi-Attach", "one node"]),
    (SHARED, claim("ReadWriteOnce"), on("a", "b", "a"), False, "ReadWriteOnce", ["run on 2 nodes"]),
    (SHARED, claim("ReadWriteOncePod"), [], False, "ReadWriteOncePod", ["claim models", "Pending"]),
    (PREFILLED, claim("ReadWriteOncePod"), [], False, "ReadWriteOncePod", ["fill Job"]),
    (SHARED, claim("ReadOnlyMany"), [], True, "ReadOnlyMany", ["every pod reads it"]),
    (PREFILLED, claim("ReadOnlyMany"), [], False, "ReadOnlyMany", ["cannot write"]),
    (SHARED, claim("ReadWriteOnce", bound=False), [], False, "ReadWriteOnce", ["Multi-Attach"]),  # not bound yet: asked for
    (SHARED, claim("ReadWriteOnce", "ReadWriteMany"), [], True, "ReadWriteMany", []),
    (SHARED, None, [], None, "ClaimNotFound", ["claim models does not exist"]),
    (SHARED, claim(), [], None, "AccessModesUnknown", ["claim models"]),
], ids=["RWX", "RWO", "RWO on 2 nodes", "RWOP", "RWOP prefilled", "ROX", "ROX prefilled", "RWO unbound", "RWO+RWX",
        "no claim", "no mode"])
def test_the_claims_access_mode_is_what_the_condition_says(spec, pvc, pods, status, reason, says):
    got = render_cache.claim_access(specs.defaulted(spec), pvc, pods)
    assert got[:2] == (status, reason) and all(s in got[2] for s in says), got
    if reason in ("ReadWriteOnce", "ReadWriteOncePod", "ReadOnlyMany"):
        assert reason in got[2]


def test_the_message_counts_the_nodes_and_does_not_name_them():
    """The condition is written when its message changes: naming the nodes would write the status
    at every reschedule of a pod to another node; the count changes only when the spread does."""
    spec, rwo = specs.defaulted(SHARED), claim("ReadWriteOnce")
    message = lambda *nodes: render_cache.claim_access(spec, rwo, on(*nodes))[2]  # noqa: E731
    assert message("a", "b") == message("c", "d", "c") != message("a", "b", "c")
    assert "node-7" not in message("node-7", "node-9")


def test_no_claim_no_condition():
    assert render_cache.claim_access(specs.defaulted({"model": "m"}), None) is None
    assert render_cache.claim_access(specs.defaulted(IMAGE_VOLUME), None) is None


def test_an_image_volume_is_the_model_directory_and_the_cache_stays_writable():
    p = pod(IMAGE_VOLUME)
    assert {"name": "model-image", "image": {"reference": "registry.example/models/bge:1.5",
                                             "pullPolicy": "IfNotPresent"}} in p["volumes"]
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "20Gi"}} in p["volumes"]
    mounts = p["containers"][0]["volumeMounts"]
    assert {"name": "model-image", "mountPath": "/model-image", "readOnly": True} in mounts
    assert {"name": "model-cache", "mountPath": "/models"} in mounts
    e = env(IMAGE_VOLUME)
    assert (e["MODEL_PATH"], e["SERVED_MODEL_NAME"], e["MODEL_CACHE_DIR"]) == (
        "/model-image/models/bge", "BAAI/bge-base-en-v1.5", "/models")
    assert "HF_HUB_OFFLINE" not in e
    assert env({**IMAGE_VOLUME, "modelCache": {"image": {"reference": "r/m:1"}}})["MODEL_PATH"] == "/model-image"


def test_todays_cache_kinds_render_as_before():
    assert pod({"model": "m"})["volumes"][0] == {"name": "model-cache", "emptyDir": {"sizeLimit": "20Gi"}}
    p = pod({"model": "m", "modelCache": {"claimName": "c"}})
    assert p["volumes"][0] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "c"}}
    assert p["containers"][0]["volumeMounts"][0] == {"name": "model-cache", "mountPath": "/models"}
    assert [k for k in env({"model": "m"}) if k.startswith(("MODEL", "HF_HUB_OFFLINE"))] == ["MODEL_PATH", "MODEL_CACHE_DIR"]


@pytest.mark.parametrize("cache, problem", [
    ({"image": {"reference": "r/m:1"}, "claimName": "c"}, "image and claimName are exclusive"),
    ({"prefill": True}, "prefill needs claimName"),
    ({"image": {"reference": "r/m:1", "path": "a/../../etc"}}, "a relative path inside the image"),
])
def test_contradictions_are_refused(cache, problem):
    assert any(problem in p for p in specs.problems(specs.defaulted({"model": "m", "modelCache": cache})))


@pytest.mark.parametrize("status, state", [
    (None, "Missing"), ({}, "Running"), ({"active": 1}, "Running"),
    ({"succeeded": 1, "conditions": [{"type": "SuccessCriteriaMet", "status": "True"},
                                     {"type": "Complete", "status": "True"}]}, "Complete"),
    ({"failed": 5, "conditions": [{"type": "FailureTarget", "status": "True"},
                                  {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}, "Failed"),
])
def test_fill_state_reads_the_job_controllers_status(status, state):
    assert render_cache.fill_state(None if status is None else {"status": status}) == state


def test_a_fill_pod_that_cannot_start_is_said():
    unscheduled = {"metadata": {"name": "p"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: pod has unbound immediate PersistentVolumeClaims."}]}}
    pulling = {"metadata": {"name": "q"}, "status": {"phase": "Pending", "containerStatuses": [
        {"name": "fill", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}]}}
    creating = {"metadata": {"name": "r"}, "status": {"phase": "Pending", "containerStatuses": [
        {"name": "fill", "state": {"waiting": {"reason": "ContainerCreating"}}}]}}
    spec = specs.defaulted(PREFILLED)
    assert "unbound immediate PersistentVolumeClaims" in render_cache.fill_message({}, "j", spec, [unscheduled])
    assert "ImagePullBackOff" in render_cache.fill_message({}, "j", spec, [creating, pulling])
    assert render_cache.fill_message({}, "j", spec, [creating]).endswith("once it has succeeded")
