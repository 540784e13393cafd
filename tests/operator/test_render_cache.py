"""spec.modelCache rendered: each kind validates against the Kubernetes versions that have its
fields, the fill Job is named for what it fills, and today's emptyDir and claim render as before."""

import kubernetes_validate
import pytest

from embedop import render, render_cache, spec as specs
from embedop.config import OperatorSettings
from tests.operator.test_render import K8S_VERSIONS, OWNER

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
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models-rwx"}} in p["volumes"]
    assert {"name": "model-cache", "mountPath": "/models"} in c["volumeMounts"]  # read-write
    assert p["tolerations"] == PREFILLED["tolerations"] and "nvidia.com/gpu" not in c["resources"]["limits"]
    # Its pod is not one of the servers': the Services, the PDB and the autoscaler select those.
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert not all(labels.get(k) == v for k, v in render.selector("svc").items())


def test_one_job_per_model_revision_and_claim():
    name = lambda **change: render.fill_job_name(OWNER, specs.defaulted({**PREFILLED, **change}), 45)
    assert name() == name(replicas=7, batching={"maxBatchSize": 64}) == name(image="other:2")  # same files
    others = [name(modelRevision="v1.6"), name(model="BAAI/bge-large-en-v1.5"),
              name(modelCache={"claimName": "other", "prefill": True}),
              name(env=[*PREFILLED["env"], {"name": "MODEL_REVISION", "value": "abc"}])]  # spec.env wins on the pods
    assert len({name(), *others}) == 5
    assert render.fill_job_name(OWNER, specs.defaulted({"model": "m", "modelCache": {"claimName": "c"}}), 45) is None


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
