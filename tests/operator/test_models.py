"""spec.models: several models per pod. The CRD's rules (schema, CEL, and the operator's own
problems for a server without CEL), the servers' model list (MODELS: one compact JSON env value,
and none of the one-model settings), the fill Job that fetches every model, the Model column's
summary, and a pod whose models do not fit its device read from its termination message."""

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from embedop import crd, render, render_cache, render_models, spec as specs, status
from embedserve.config import Settings
from tests.operator.test_crd import cel_errors, schema, strict

ROOT = Path(__file__).resolve().parents[2]
OWNER = render.Owner("svc", "ns", "0b0c7e8e-0000-4000-8000-000000000001")
STACK = [{"name": "dense", "model": "BAAI/bge-small-en-v1.5", "task": "embed"},
         {"name": "sparse", "model": "naver/splade-cocondenser-ensembledistil", "task": "sparse"},
         {"name": "rerank", "model": "BAAI/bge-reranker-base", "task": "rerank"}]
ONE_MODEL_ENV = ("MODEL_PATH", "MODEL_REVISION", "TASK", "POOLING", "NORMALIZE", "EXCLUDE_TOKENS", "SERVED_MODEL_NAME")


def example():
    return yaml.safe_load((ROOT / "crds" / "examples" / "retrieval-stack.yaml").read_text())


def env_of(deployment: dict) -> dict:
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def service(spec: dict) -> dict:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "svc"}, "spec": spec}


def test_the_retrieval_stack_example_is_valid_and_renders_its_three_models():
    obj = example()
    jsonschema.validate(obj, strict(schema()))
    spec = specs.defaulted(obj["spec"])
    assert cel_errors(spec, schema()["properties"]["spec"]) == [] and specs.problems(spec, "retrieval") == []
    objects = render.owned(OWNER, spec, "img", render.deployment_replicas(spec, None), 45)
    for version in ("1.29.0", "1.34.0"):
        for o in objects:
            kubernetes_validate.validate(o, version, strict=True)
    env = env_of(objects[0])
    assert json.loads(env["MODELS"]) == STACK
    assert not set(ONE_MODEL_ENV) & set(env)
    assert env["MODEL_CACHE_DIR"] == render_cache.MODEL_CACHE
    # The server takes it: one model per entry, in order, each with its task (embedserve.model_list).
    served = Settings.from_env(env).models
    assert [(m.name, m.model, m.task) for m in served] == [(m["name"], m["model"], m["task"]) for m in STACK]
    assert render_models.summary(spec) == "3 models: dense, sparse, rerank"


def test_models_is_compact_json_of_the_entries_set_fields_in_a_fixed_order():
    spec = specs.defaulted({"models": [
        {"pooling": {"normalize": False, "strategy": "cls"}, "model": "org/a", "name": "a", "modelRevision": "v2"},
        {"name": "b", "model": "/models/b", "pooling": {}, "task": "rerank"},
        {"name": "c", "model": "s3://bucket/c", "pooling": {"excludeTokens": ["<s>"], "strategy": "mean"}}]})
    env = env_of(render.deployment(OWNER, spec, "img", 1, 45))
    assert env["MODELS"] == (
        '[{"name":"a","model":"org/a","modelRevision":"v2","pooling":{"strategy":"cls","normalize":false}},'
        '{"name":"b","model":"/models/b","task":"rerank"},'
        '{"name":"c","model":"s3://bucket/c","pooling":{"strategy":"mean","excludeTokens":["<s>"]}}]')
    server = Settings.from_env(env).models
    assert (server[0].revision, server[0].pooling, server[0].normalize) == ("v2", "cls", False)
    assert server[2].exclude_tokens == ("<s>",)


def test_a_list_of_one_model_is_still_models_and_one_model_is_not():
    one = env_of(render.deployment(OWNER, specs.defaulted({"model": "org/a", "task": "embed"}), "img", 1, 45))
    listed = env_of(render.deployment(OWNER, specs.defaulted({"models": [{"name": "a", "model": "org/a", "task": "embed"}]}),
                                      "img", 1, 45))
    assert "MODELS" not in one and (one["MODEL_PATH"], one["TASK"]) == ("org/a", "embed")
    assert json.loads(listed["MODELS"]) == [{"name": "a", "model": "org/a", "task": "embed"}]
    assert not set(ONE_MODEL_ENV) & set(listed)
    # Everything else the pods get is the same.
    assert {k: v for k, v in one.items() if k not in ("MODEL_PATH", "TASK")} == {
        k: v for k, v in listed.items() if k != "MODELS"}


# The CRD's rules on model and models: (spec, the CEL rule's message, the operator's problem).
MODEL_CASES = [
    ({}, crd.MODEL_RULE, crd.MODEL_RULE),
    ({"model": "m", "models": STACK[:1]}, crd.MODEL_RULE, crd.MODEL_RULE),
    ({"models": [STACK[0], {**STACK[1], "name": "dense"}]}, crd.UNIQUE_MODELS_RULE, crd.UNIQUE_MODELS_RULE),
    ({"models": STACK, "task": "embed"}, crd.PER_MODEL_RULE, crd.PER_MODEL_RULE),
    ({"models": STACK, "modelRevision": "v1"}, crd.PER_MODEL_RULE, crd.PER_MODEL_RULE),
    ({"models": STACK, "pooling": {"strategy": "cls"}}, crd.PER_MODEL_RULE, crd.PER_MODEL_RULE),
    ({"models": STACK, "modelCache": {"image": {"reference": "r/m:1"}}}, crd.MODEL_IMAGE_RULE, crd.MODEL_IMAGE_RULE),
]


@pytest.mark.parametrize("spec, message, problem", MODEL_CASES,
                         ids=["neither", "both", "a name twice", "task beside", "revision beside", "pooling beside",
                              "an image volume"])
def test_the_model_rules_reject(spec, message, problem):
    jsonschema.validate(service(spec), strict(schema()))  # each field alone is fine
    defaulted = specs.defaulted(spec)
    assert message in cel_errors(defaulted, schema()["properties"]["spec"])
    assert any(problem in p for p in specs.problems(defaulted)), specs.problems(defaulted)


def test_the_rules_accept_models_with_a_claim_and_an_empty_pooling_beside():
    spec = specs.defaulted({"models": STACK, "pooling": {}, "modelCache": {"claimName": "c", "prefill": True}})
    assert cel_errors(spec, schema()["properties"]["spec"]) == [] and specs.problems(spec) == []


@pytest.mark.parametrize("entry, error", [
    ({"name": "Dense", "model": "m"}, "does not match"),  # lowercase only
    ({"name": "-a", "model": "m"}, "does not match"),
    ({"name": "a" * 64, "model": "m"}, "is too long"),
    ({"name": "a"}, "'model' is a required property"),
    ({"model": "m"}, "'name' is a required property"),
    ({"name": "a", "model": "m", "task": "summarize"}, "'summarize' is not one of"),
    ({"name": "a", "model": "m", "pooling": {"strategy": "maxi"}}, "'maxi' does not match"),
    ({"name": "a", "model": "m", "revision": "v1"}, "Additional properties"),
])
def test_an_entry_the_schema_refuses(entry, error):
    with pytest.raises(jsonschema.ValidationError, match=error):
        jsonschema.validate(service({"models": [entry]}), strict(schema()))


def test_an_empty_list_and_too_many_models_are_refused():
    with pytest.raises(jsonschema.ValidationError, match="should be non-empty|too short"):
        jsonschema.validate(service({"models": []}), strict(schema()))
    many = [{"name": f"m{i}", "model": "m"} for i in range(crd.MAX_MODELS + 1)]
    with pytest.raises(jsonschema.ValidationError, match="too long|is too long"):
        jsonschema.validate(service({"models": many}), strict(schema()))


def test_names_allow_dots_and_underscores_inside():
    jsonschema.validate(service({"models": [{"name": "bge-m3.v1_en", "model": "m"}, {"name": "a", "model": "m"}]}),
                        strict(schema()))


@pytest.mark.parametrize("spec, problem", [
    # The servers refuse MODELS beside the one-model settings: the pods would never start.
    ({"models": STACK, "env": [{"name": "MODEL_PATH", "value": "x"}]}, "env: MODEL_PATH"),
    ({"models": STACK, "env": [{"name": "TASK", "value": "embed"}]}, "env: TASK"),
    ({"models": STACK, "env": [{"name": "MODELS", "value": "[]"}]}, "env: MODELS"),
    ({"model": "m", "env": [{"name": "MODELS", "value": "[]"}]}, "MODELS beside model"),
    ({"models": [{"name": "a", "model": "m", "pooling": {"strategy": "cls", "excludeTokens": ["x"]}}]},
     "models[a].pooling.excludeTokens applies to mean pooling only"),
])
def test_what_the_servers_would_refuse_is_refused_first(spec, problem):
    assert any(problem in p for p in specs.problems(specs.defaulted(spec))), specs.problems(specs.defaulted(spec))


def test_the_model_column_is_the_summary_status_keeps():
    columns = {c["name"]: c for c in crd.crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Model"]["jsonPath"] == ".status.modelSummary"
    assert render_models.summary(specs.defaulted({"model": "BAAI/bge-base-en-v1.5"})) == "BAAI/bge-base-en-v1.5"
    assert render_models.summary({"models": STACK[:1]}) == "1 model: dense"
    long = [{"name": f"multilingual-embedder-{i}", "model": "m"} for i in range(5)]
    summary = render_models.summary({"models": long})
    assert summary == "5 models: multilingual-embedder-0 +4" and len(summary) <= render_models.SUMMARY_WIDTH
    assert render_models.summary({"models": [{"name": n, "model": "m"} for n in "abcdefghijklmnopqrstuvwxyz"]}) == (
        "26 models: a, b, c, d, e, f, g, h, i, j, k +15")


def prefilled(models=STACK, **extra):
    return specs.defaulted({"models": models, "modelCache": {"claimName": "models-rwx", "prefill": True},
                            "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}],
                            **extra})


def test_the_fill_job_fetches_every_model_one_after_the_other():
    spec = prefilled([{**STACK[0], "modelRevision": "abc123"}, *STACK[1:]])
    job = render.fill_job(OWNER, spec, "img", 45, claim_uid="uid-1")
    for version in ("1.29.0", "1.34.0"):
        kubernetes_validate.validate(job, version, strict=True)
    pod = job["spec"]["template"]["spec"]
    containers = [*pod["initContainers"], *pod["containers"]]
    assert [c["name"] for c in containers] == ["fill-0", "fill-1", "fill"]
    fetched = [{e["name"]: e.get("value") for e in c["env"]} for c in containers]
    assert [(f["MODEL_PATH"], f.get("MODEL_REVISION")) for f in fetched] == [
        ("BAAI/bge-small-en-v1.5", "abc123"), ("naver/splade-cocondenser-ensembledistil", None),
        ("BAAI/bge-reranker-base", None)]
    for c, f in zip(containers, fetched):
        assert c["command"] == ["python", "-m", "embedserve.prefetch"]
        assert "MODELS" not in f and f["MODEL_CACHE_DIR"] == render_cache.MODEL_CACHE and "HF_TOKEN" in f
        assert {"name": render_cache.CACHE_VOLUME, "mountPath": render_cache.MODEL_CACHE} in c["volumeMounts"]
    # prefetch's refusal in any of them fails the Job at once (no containerName: init containers too).
    (refused,) = [r for r in job["spec"]["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert refused["onExitCodes"] == {"operator": "In", "values": [render_cache.PREFETCH_REFUSED]}
    assert "dense (BAAI/bge-small-en-v1.5@abc123), sparse" in render_cache.fill_message(None, "j", spec)


def test_the_fill_is_redone_for_a_new_source_or_revision_not_for_a_new_task():
    def name(models):
        return render.fill_job_name(OWNER, prefilled(models), 45, "uid-1")
    base = name(STACK)
    assert name([{**STACK[0], "modelRevision": "v2"}, *STACK[1:]]) != base
    assert name([*STACK, {"name": "extra", "model": "org/x"}]) != base
    assert name([{**STACK[0], "task": "classify"}, *STACK[1:]]) == base
    assert name([{**STACK[0], "pooling": {"strategy": "cls"}}, *STACK[1:]]) == base


def test_with_models_the_pods_read_the_filled_claim_offline():
    env = env_of(render.deployment(OWNER, prefilled(), "img", 1, 45))
    assert env["HF_HUB_OFFLINE"] == "1" and "MODELS" in env and "MODEL_PATH" not in env


# -- Models that do not fit the device: the pods' termination messages.

MISFIT = ("models do not fit the device: dense 1.20 GiB + rerank 2.30 GiB + margin 1.00 GiB = 4.50 GiB "
          "> device 4.00 GiB")


def kubelet_pod(name="svc-1", state=None, last=None, ready=False, deleting=False, container="server"):
    c = {"name": container, "ready": ready, "restartCount": 3, "image": "embedserve", "imageID": "",
         "state": state or {"waiting": {"reason": "CrashLoopBackOff"}}}
    if last:
        c["lastState"] = last
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {"phase": "Running", "containerStatuses": [c]}}


def terminated(message):
    return {"terminated": {"exitCode": 1, "reason": "Error", "message": message + "\n"}}


@pytest.mark.parametrize("pod, found", [
    (kubelet_pod(last=terminated(MISFIT)), True),  # crash-looping on it
    (kubelet_pod(state=terminated(MISFIT)), True),  # just exited
    (kubelet_pod(last=terminated(MISFIT), state={"running": {}}, ready=True), False),  # it started since: not now
    (kubelet_pod(last=terminated(MISFIT), state={"running": {}}), True),  # loading again, not ready yet
    (kubelet_pod(last=terminated("Traceback ... CUDA error")), False),  # another crash: not this
    (kubelet_pod(last=terminated(MISFIT), deleting=True), False),
    (kubelet_pod(last=terminated(MISFIT), container="sidecar"), False),
])
def test_a_pod_whose_models_do_not_fit_is_read_from_its_termination_message(pod, found):
    message = status.misfit([pod])
    assert bool(message) == found
    if found:
        assert message.startswith(MISFIT) and "svc-1" in message


def test_only_pods_of_the_present_template_say_the_models_do_not_fit():
    """A fixed spec's rollout replaces the crash-looping pods one by one, minutes apart: theirs
    (an older template's server env) no longer say anything of the service."""
    template = {"spec": {"containers": [{"name": "server", "env": [{"name": "MODELS", "value": "[new]"}]}]}}

    def of(env_value):
        pod = kubelet_pod(last=terminated(MISFIT))
        pod["spec"] = {"containers": [{"name": "server", "env": [{"name": "MODELS", "value": env_value}]}]}
        return pod

    assert status.misfit([of("[old]")], template) is None
    assert status.misfit([of("[new]")], template).startswith(MISFIT)
    assert status.misfit([of("[old]")]).startswith(MISFIT)  # no template known: every pod counts


def test_models_that_do_not_fit_make_the_service_degraded_with_the_numbers():
    deployment = {"spec": {"replicas": 2}, "status": {"replicas": 2, "readyReplicas": 0, "updatedReplicas": 2}}
    misfit = status.misfit([kubelet_pod(last=terminated(MISFIT))])
    st = status.from_deployment(deployment, 2, [], 3, [], now="2026-01-01T00:00:00Z", misfit=misfit)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ModelsDoNotFit")
    assert degraded["message"].startswith(MISFIT)
    fine = status.from_deployment(deployment, 2, [], 3, st["conditions"], now="2026-01-01T00:01:00Z")
    assert next(c for c in fine["conditions"] if c["type"] == "Degraded")["status"] == "False"


def test_the_prefix_is_the_servers_and_the_termination_message_is_kubernetes_default():
    """The server writes its refusal to /dev/termination-log (terminationMessagePath's default);
    the operator renders neither a path nor a policy, so the kubelet reads that file (File)."""
    from embedserve.model.device import MISFIT_PREFIX

    assert status.MISFIT_PREFIX == MISFIT_PREFIX
    container = render.deployment(OWNER, specs.defaulted(example()["spec"]), "img", 1, 45)["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == status.SERVER_CONTAINER
    assert container.get("terminationMessagePolicy", "File") in ("File", "FallbackToLogsOnError")
    assert container.get("terminationMessagePath", "/dev/termination-log") == "/dev/termination-log"
