"""How an owned object is written (write.py, drift.after_apply): created when absent, so that an
object someone else makes between our read and our write is refused (409) rather than taken over;
the create's field ownership made our apply's; and a render the API server does not store as sent
(a webhook rewrites it, a schema prunes it) held after a few applies instead of applied at every
check, with the service's condition FieldNotPersisted naming the JSON path (not Degraded: a
digest-pinning policy, a webhook's default, is no fault of the fleet; a pinned digest is the image
its tag named, and is not even held). The decisions as
tables with a clock the test drives; the behaviour through the real operator process against the
emulator (mutating webhooks: emulator.mutators; the race: emulator.races)."""

from __future__ import annotations

import copy

import jsonpatch
import pytest

from embedop import drift, render, spec as specs, write
from tests.operator import emulator as em
from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path

OWNER = render.Owner("svc", "ns", "uid-1")
SPEC = {"model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"}, "autoscaling": {"mode": "off"}}


def pdb(**spec) -> dict:
    return drift.stamped(render.pod_disruption_budget(OWNER, specs.defaulted({**SPEC, **spec})))


def stored_as(obj: dict, **changes) -> dict:
    out = copy.deepcopy(obj)
    out["spec"].update(changes)
    return out


# -- what did not stick, and where

@pytest.mark.parametrize("sent, stored, paths", [
    ({"spec": {"a": "x"}}, {"spec": {}}, [".spec.a"]),  # pruned
    ({"spec": {"a": "x"}}, {"spec": {"a": "y"}}, [".spec.a"]),  # rewritten
    ({"spec": {"a": ""}}, {"spec": {}}, []),  # an empty value the server omits
    ({"spec": {"resources": {"limits": {"cpu": "1000m"}}}}, {"spec": {"resources": {"limits": {"cpu": "1"}}}}, []),
    ({"c": [{"name": "s", "env": [{"name": "X", "value": "1"}]}]},
     {"c": [{"name": "s", "env": [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}]}]}, [".c[name=s].env[name=X].value"]),
    ({"c": [{"name": "s", "env": [{"name": "X", "value": "1"}]}]}, {"c": [{"name": "s"}]}, [".c[name=s].env"]),
    ({"c": [{"name": "s"}]}, {"c": [{"name": "t"}]}, [".c[name=s]"]),
    ({"p": [{"number": 1}]}, {"p": [{"number": 2}]}, [".p[0].number"]),
    ({"p": [1, 2]}, {"p": [1]}, [".p"]),
], ids=["pruned", "rewritten", "omitempty", "quantity", "keyed list", "keyed list gone", "entry gone", "list", "length"])
def test_the_paths_that_did_not_stick(sent, stored, paths):
    assert drift.differences(sent, stored) == paths
    assert drift.subset(sent, stored) is (paths == [])


def test_three_applies_of_one_render_that_does_not_stick_within_ten_minutes_hold_it():
    sent = pdb()
    rewritten = stored_as(sent, unhealthyPodEvictionPolicy="IfHealthyBudget")
    record = None
    for t in (0.0, 100.0):
        record = drift.after_apply(record, sent, rewritten, t)
        assert record.held_until is None and not drift.held(record, sent, t + 1)
    record = drift.after_apply(record, sent, rewritten, 200.0)
    assert record.paths == (".spec.unhealthyPodEvictionPolicy",)
    assert record.held_until == 200.0 + drift.STUCK_BACKOFF_S
    assert drift.held(record, sent, 300.0)
    assert not drift.held(record, pdb(rollout={"maxSurge": 1, "maxUnavailable": 2}), 300.0)  # a new render: applied
    assert not drift.held(record, sent, record.held_until)  # the long backoff ran out: tried again
    retried = drift.after_apply(record, sent, rewritten, record.held_until)
    assert retried.held_until == record.held_until + drift.STUCK_BACKOFF_S  # still does not stick: held at once
    assert drift.after_apply(record, sent, sent, record.held_until) == drift.Applied(drift.digest_of(sent))
    assert "PodDisruptionBudget/svc: .spec.unhealthyPodEvictionPolicy" in drift.stuck_message(
        "PodDisruptionBudget", "svc", record)


def test_applies_spread_over_more_than_the_window_or_that_stick_do_not_hold():
    sent = pdb()
    rewritten = stored_as(sent, unhealthyPodEvictionPolicy="IfHealthyBudget")
    record = None
    for t in (0.0, 400.0, 800.0):  # the first has left the window by the third
        record = drift.after_apply(record, sent, rewritten, t)
    assert record.held_until is None and record.times == (400.0, 800.0)
    record = drift.after_apply(record, sent, rewritten, 900.0)
    assert record.held_until is not None
    fine = None
    for t in range(10):  # a hand edit reverted again and again: every apply stuck
        fine = drift.after_apply(fine, sent, sent, float(t))
    assert fine.held_until is None and fine.times == ()
    other = None
    for t, spec in enumerate(({}, {"rollout": {"maxSurge": 1, "maxUnavailable": 2}}, {})):  # a render that changes
        rendered = pdb(**spec)
        other = drift.after_apply(other, rendered, stored_as(rendered, unhealthyPodEvictionPolicy="X"), float(t))
    assert other.held_until is None and len(other.times) == 1


# -- the create's fields become our apply's

ENTRY = {"manager": "embedop", "operation": "Update", "apiVersion": "v1", "time": "2026-01-01T00:00:00Z",
         "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:ports": {}, "f:selector": {}}}}
STATUS = {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1", "subresource": "status",
          "time": "2026-01-01T00:00:01Z", "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:x": {}}}}
APPLY = {"manager": "embedop", "operation": "Apply", "apiVersion": "v1", "time": "2026-01-01T00:00:02Z",
         "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:selector": {"f:app": {}}, "f:type": {}}}}
SCALE = {**ENTRY, "subresource": "scale", "fieldsV1": {"f:spec": {"f:replicas": {}}}}


def managed(*entries) -> dict:
    return {"metadata": {"name": "x", "managedFields": [copy.deepcopy(e) for e in entries]}}


def test_a_creates_update_entry_becomes_our_apply_entry():
    obj = managed(ENTRY, STATUS)
    after = jsonpatch.apply_patch(obj, write.adoption(obj))
    assert after["metadata"]["managedFields"] == [{**ENTRY, "operation": "Apply"}, STATUS]


def test_an_update_entry_beside_our_apply_entry_is_merged_into_it():
    obj = managed(APPLY, STATUS, ENTRY)
    after = jsonpatch.apply_patch(obj, write.adoption(obj))
    merged = {**APPLY, "fieldsV1": {"f:spec": {"f:selector": {"f:app": {}}, "f:type": {}, "f:ports": {}}}}
    assert after["metadata"]["managedFields"] == [merged, STATUS]


def test_only_our_main_resource_update_entry_is_adopted_and_only_as_it_was_read():
    assert write.adoption(managed(APPLY, STATUS, SCALE)) is None  # the count through the scale subresource: kept
    assert write.adoption(managed({**ENTRY, "manager": "kubectl"})) is None
    obj = managed(ENTRY)
    moved = managed(STATUS, ENTRY)  # another entry landed before ours since it was read
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(moved, write.adoption(obj))


# -- through the operator

def condition(emulator, ns, name, type_) -> dict:
    cr = emulator.get(service_path(ns, name)) or {}
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def pdb_writes(ns: str, name: str) -> int:
    """Creates and applies."""
    return len([a for a in em.applies if a["kind"] == "PodDisruptionBudget" and (a["namespace"], a["name"]) == (ns, name)])


def periodic_checks(operator, ns: str, name: str) -> int:
    return operator.log().count(f"{ns}/{name}: periodic check done")


def test_a_field_a_webhook_rewrites_is_held_after_three_applies_and_named(emulator, operator, namespace):
    ns, name = namespace, "rewritten"

    def webhook(obj):  # a mutating webhook that insists on its own eviction policy
        if obj.get("kind") == "PodDisruptionBudget" and (obj.get("metadata") or {}).get("name") == name:
            obj.setdefault("spec", {})["unhealthyPodEvictionPolicy"] = "IfHealthyBudget"

    em.mutators.append(webhook)
    try:
        emulator.request("POST", service_path(ns), new_service(name, SPEC, ns))
        c = eventually(lambda: (c := condition(emulator, ns, name, write.FIELD_NOT_PERSISTED)).get("status") == "True"
                       and c)
        assert f"PodDisruptionBudget/{name}: .spec.unhealthyPodEvictionPolicy" in c["message"]
        degraded = condition(emulator, ns, name, "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("False", "AsExpected")  # Argo CD, Flux: healthy
        assert pdb_writes(ns, name) == drift.STUCK_APPLIES  # the create and two applies
        seen = periodic_checks(operator, ns, name)
        eventually(lambda: periodic_checks(operator, ns, name) >= seen + 3)  # 2 s apart here
        assert pdb_writes(ns, name) == drift.STUCK_APPLIES  # held: no apply at the checks since
        events = [e for e in emulator.get(f"/api/v1/namespaces/{ns}/events")["items"]
                  if e["involvedObject"]["name"] == name and e["reason"] == write.FIELD_NOT_PERSISTED]
        assert events and events[0]["type"] == "Warning"
        # The webhook goes and the render changes: applied at once, it sticks, the condition clears.
        em.mutators.remove(webhook)
        emulator.merge_patch(service_path(ns, name), {"spec": {"rollout": {"maxSurge": 1, "maxUnavailable": 2}}})
        eventually(lambda: emulator.get(f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{name}")["spec"]
                   ["maxUnavailable"] == 2)
        eventually(lambda: condition(emulator, ns, name, write.FIELD_NOT_PERSISTED).get("status") == "False")
        assert pdb_writes(ns, name) == drift.STUCK_APPLIES + 1
    finally:
        if webhook in em.mutators:
            em.mutators.remove(webhook)
        emulator.request("DELETE", service_path(ns, name))


THEIRS = {"metadata": {"labels": {"app": "theirs"}}}


@pytest.mark.parametrize("kind, plural, suffix, body", [
    ("Service", "services", "-headless",
     {"apiVersion": "v1", "kind": "Service", **THEIRS, "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}}),
    ("Deployment", "deployments", "",
     {"apiVersion": "apps/v1", "kind": "Deployment", **THEIRS, "spec": {
         "replicas": 2, "selector": {"matchLabels": {"app": "theirs"}},
         "template": {"metadata": {"labels": {"app": "theirs"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}}}),
], ids=["Service", "Deployment"])
def test_an_object_made_between_our_read_and_our_write_is_not_taken_over(emulator, operator, namespace, kind, plural,
                                                                         suffix, body):
    """Someone else creates the object after the operator found none and before it writes: a
    forced apply would take it over; the operator's create is refused (409) instead, and the
    object is reported as someone else's, untouched."""
    ns, name = namespace, f"raced-{kind.lower()}"
    group = "/api/v1" if plural == "services" else "/apis/apps/v1"
    path = f"{group}/namespaces/{ns}/{plural}/{name}{suffix}"
    em.races[(plural, ns, f"{name}{suffix}")] = body
    try:
        emulator.request("POST", service_path(ns), new_service(name, SPEC, ns))
        c = eventually(lambda: (c := condition(emulator, ns, name, "Degraded")).get("reason") == "NotOwned" and c)
        assert f"{kind}/{name}{suffix}" in c["message"]
        theirs = emulator.get(path)
        assert not theirs["metadata"].get("ownerReferences") and theirs["metadata"]["labels"] == {"app": "theirs"}
        assert theirs["spec"]["selector"] == body["spec"]["selector"]
        writes = [a for a in em.applies if (a["kind"], a["namespace"], a["name"]) == (kind, ns, f"{name}{suffix}")]
        assert writes and all(a["create"] for a in writes)  # refused (409), and never applied over
    finally:
        em.races.pop((plural, ns, f"{name}{suffix}"), None)
        emulator.request("DELETE", service_path(ns, name))


def test_what_the_operator_creates_it_owns_by_apply(emulator, operator, namespace):
    """After the create, our field manager's entry is an Apply (so a field we later stop sending
    is removed: on a real API server, tests/cluster/test_write_on_cluster.py)."""
    ns, name = namespace, "adopted"
    emulator.request("POST", service_path(ns), new_service(name, SPEC, ns))
    try:
        svc = eventually(lambda: emulator.get(f"/api/v1/namespaces/{ns}/services/{name}-headless"))
        ours = eventually(lambda: [m for m in emulator.get(f"/api/v1/namespaces/{ns}/services/{name}-headless")["metadata"]
                                   ["managedFields"] if m["manager"] == "embedop"])
        assert [m["operation"] for m in ours] == ["Apply"], svc
        assert [a["create"] for a in em.applies if (a["kind"], a["name"]) == ("Service", f"{name}-headless")] == [True]
    finally:
        emulator.request("DELETE", service_path(ns, name))


def test_an_image_a_policy_pins_to_its_digest_is_the_same_image(emulator, operator, namespace):
    """Kyverno's verifyImages (mutateDigest) stores `repo:tag` as `repo:tag@sha256:…`: the image
    the tag named, pulled by its digest. Not a drift: applied once, never held, nothing said."""
    ns, name = namespace, "pinned"
    digest = "sha256:" + "ab" * 32

    def pin(obj):
        if obj.get("kind") == "Deployment" and (obj.get("metadata") or {}).get("name") == name:
            for c in obj["spec"]["template"]["spec"]["containers"]:
                if "@" not in c["image"]:
                    c["image"] += f"@{digest}"

    em.mutators.append(pin)
    try:
        emulator.request("POST", service_path(ns), new_service(name, {**SPEC, "image": "registry.example/embedserve:1.2"}, ns))
        deploy = f"/apis/apps/v1/namespaces/{ns}/deployments/{name}"
        d = eventually(lambda: emulator.get(deploy))
        assert d["spec"]["template"]["spec"]["containers"][0]["image"] == f"registry.example/embedserve:1.2@{digest}"
        seen = periodic_checks(operator, ns, name)
        eventually(lambda: periodic_checks(operator, ns, name) >= seen + 3)
        assert [a["create"] for a in em.applies if (a["kind"], a["name"]) == ("Deployment", name)] == [True]
        assert condition(emulator, ns, name, write.FIELD_NOT_PERSISTED)["status"] == "False"
        # A new tag is a new image: applied (and pinned again).
        emulator.merge_patch(service_path(ns, name), {"spec": {"image": "registry.example/embedserve:1.3"}})
        eventually(lambda: emulator.get(deploy)["spec"]["template"]["spec"]["containers"][0]["image"]
                   == f"registry.example/embedserve:1.3@{digest}")
    finally:
        em.mutators.remove(pin)
        emulator.request("DELETE", service_path(ns, name))


def test_only_a_digest_added_to_the_tag_sent_is_the_same_image():
    containers = lambda image: {"spec": {"containers": [{"name": "c", "image": image}]}}  # noqa: E731
    sent = containers("r/x:1")
    assert drift.subset(sent, containers("r/x:1@sha256:" + "0" * 64))
    assert not drift.subset(sent, containers("r/x:2@sha256:" + "0" * 64))
    assert not drift.subset(containers("r/x:1@sha256:" + "1" * 64), containers("r/x:1@sha256:" + "0" * 64))
    assert not drift.subset({"spec": {"env": [{"name": "image", "value": "a"}]}},
                            {"spec": {"env": [{"name": "image", "value": "a@sha256:0"}]}})


def frozen(name: str, status: int = 422):
    """A ValidatingAdmissionPolicy refusing UPDATEs of the Service `name` (422, its default reason
    Invalid: the status a failed JSON patch `test` answers with too)."""
    def policy(obj):
        meta = obj.get("metadata") or {}
        if obj.get("kind") == "Service" and meta.get("name") == name and meta.get("resourceVersion"):
            return status, f'ValidatingAdmissionPolicy "frozen" with binding "frozen" denied request: {name} is frozen'
    return policy


def test_an_adoption_admission_refuses_is_not_sent_again_at_every_check(emulator, operator, namespace):
    """A policy that refuses UPDATEs of an object refuses the adoption's JSON patch: one attempt
    and one read (did a `test` fail? the entry has not moved: no), then not again for an hour,
    logged, where each check used to send three patches and three reads."""
    ns, name = namespace, "unadoptable"
    target = f"{name}-headless"
    policy = frozen(target)
    em.policies.append(policy)
    try:
        emulator.request("POST", service_path(ns), new_service(name, SPEC, ns))
        eventually(lambda: emulator.get(f"/api/v1/namespaces/{ns}/services/{target}"))
        seen = periodic_checks(operator, ns, name)
        eventually(lambda: periodic_checks(operator, ns, name) >= seen + 3)
        calls = [c["verb"] for c in em.calls if (c["resource"], c["namespace"], c.get("name")) == ("services", ns, target)]
        assert calls == ["get", "patch", "get"], calls  # the read before its create, the adoption, its re-read
        assert f"Service {ns}/{target}: the fields of its create could not be made embedop's apply" in operator.log()
        assert "not tried again for 60 min" in operator.log()
    finally:
        em.policies.remove(policy)
        emulator.request("DELETE", service_path(ns, name))


def test_an_adoption_is_read_again_when_its_entry_moved_and_a_refusal_waits_out_its_backoff(tmp_path, monkeypatch):
    """Against the emulator with a clock the test drives: a `test` that failed because the entry
    changed since it was read (422) is read again and patched; a refusal is not tried again
    before ADOPT_BACKOFF_S, and is after (for that object: its uid)."""
    import asyncio

    from embedop import cache
    from embedop.kube import Kube
    from tests.operator.emulator import Emulator

    def service(name):
        return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
                "spec": {"ports": [{"port": 80}]}}

    def verbs(mark, name):
        return [c["verb"] for c in em.calls[mark:] if c["subject"] == "adoption-probe" and c.get("name") == name]

    with Emulator(subject="adoption-probe") as e:
        monkeypatch.setenv("KUBECONFIG", str(e.kubeconfig(tmp_path / "kubeconfig")))

        async def scenario():
            now = [1000.0]
            kube = Kube.connect()
            cluster = cache.Cluster(kube, {}, clock=lambda: now[0])
            try:
                stored = await write.create(cluster, service("moved"), adopt=False)
                stale = copy.deepcopy(stored)  # our entry as an older read had it
                stale["metadata"]["managedFields"][0]["time"] = "2000-01-01T00:00:00Z"
                mark = len(em.calls)
                adopted = await write.adopted(cluster, "Service", stale)
                assert [m["operation"] for m in adopted["metadata"]["managedFields"]] == ["Apply"]
                assert verbs(mark, "moved") == ["patch", "get", "patch"]

                em.policies.append(frozen("refused"))
                stored = await write.create(cluster, service("refused"), adopt=False)
                for t, expected in ((0, ["patch", "get"]), (60, []), (write.ADOPT_BACKOFF_S - 1, []),
                                    (write.ADOPT_BACKOFF_S, ["patch", "get"])):
                    now[0] = 1000.0 + t
                    mark = len(em.calls)
                    assert await write.adopted(cluster, "Service", stored) == stored
                    assert verbs(mark, "refused") == expected, (t, verbs(mark, "refused"))
            finally:
                em.policies.clear()
                await kube.close()

        asyncio.run(scenario())
