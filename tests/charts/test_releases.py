"""Several releases of the chart in one cluster: each its own leader Lease (an upgraded release
keeps the one its operator uses), each a claim on the namespaces it watches, the CRD installed by
one of them. Rendered by the real Helm SDK, offline and, where the chart reads the cluster
(`lookup`), against the emulated API server (tests/operator/emulator.py) holding what a real one
would: an older release's Deployment, a CRD another release owns."""

from pathlib import Path

import helm_python as helm
import pytest
import yaml

from embedop import scope
from tests.operator.emulator import Emulator

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "embedfleet"
NS = "embedfleet-system"
CRD_NAME = "embeddingservices.embedfleet.dev"


def objects_of(files: dict) -> list[dict]:
    return [d for path, text in files.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]


def render(values=None, name="ef", namespace=NS, **kw) -> list[dict]:
    return objects_of(helm.Chart.load(str(CHART)).render(values or {}, name=name, namespace=namespace,
                                                         **(kw or {"is_install": True})))


def env_of(objects) -> dict:
    d = next(o for o in objects if o["kind"] == "Deployment")
    return {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}


def lease_of(objects) -> str:
    """The Lease the operator elects on, as its Role names it; the same as its setting."""
    (role,) = [o for o in objects if o["kind"] == "Role" and o["metadata"]["name"].endswith("-leader")]
    (named,) = [r["resourceNames"] for r in role["rules"] if r.get("resourceNames")]
    assert named == [env_of(objects)["EMBEDOP_LEASE_NAME"]]
    return named[0]


def test_two_new_releases_in_one_namespace_elect_on_leases_of_their_own():
    """Sharing embedop-leader, one of them (watching another namespace) never led."""
    a = render({"watchNamespace": "team-a"}, name="a")
    b = render({"watchNamespace": "team-b"}, name="b")
    assert (lease_of(a), lease_of(b)) == ("a-operator-leader", "b-operator-leader")
    assert lease_of(render({"leaseName": "mine"})) == "mine"


def test_a_render_without_a_cluster_is_sane():
    """helm template, lint and --dry-run read nothing (lookup finds nothing): a release's own Lease,
    whether rendered as an install or an upgrade."""
    assert lease_of(render(is_upgrade=True)) == lease_of(render()) == "ef-operator-leader"


@pytest.fixture(scope="module")
def cluster():
    # Helm's lookups are Helm's calls, not the operator's: recorded apart, so the operator's RBAC
    # tests (tests/operator, which run later in the same process) see only its own.
    with Emulator(subject="helm") as e:
        yield e


def render_on(cluster, tmp_path, values=None, name="ef", namespace=NS, upgrade=True) -> list[dict]:
    """Rendered as helm install/upgrade renders: lookup reads the (emulated) cluster."""
    config = helm.Config(kubeconfig_path=str(cluster.kubeconfig(tmp_path / "kubeconfig")), namespace=namespace)
    return objects_of(config.render(helm.Chart.load(str(CHART)), values or {}, name=name, namespace=namespace,
                                    is_upgrade=upgrade, is_install=not upgrade))


def deploy(cluster, objects, lease: str | None) -> None:
    """The release's operator Deployment as an earlier chart left it: EMBEDOP_LEASE_NAME `lease`,
    or none (a chart from before the setting, whose operators used the default, embedop-leader)."""
    d = next(o for o in objects if o["kind"] == "Deployment")
    c = d["spec"]["template"]["spec"]["containers"][0]
    c["env"] = [e for e in c["env"] if e["name"] != "EMBEDOP_LEASE_NAME"]
    if lease:
        c["env"].append({"name": "EMBEDOP_LEASE_NAME", "value": lease})
    path = f"/apis/apps/v1/namespaces/{d['metadata']['namespace']}/deployments"
    cluster.request("DELETE", f"{path}/{d['metadata']['name']}")
    cluster.request("POST", path, d)


@pytest.mark.parametrize("before, kept", [(None, "embedop-leader"), ("ef-operator-leader", "ef-operator-leader"),
                                          ("custom", "custom")])
def test_an_upgraded_release_keeps_the_lease_its_operator_uses(cluster, tmp_path, before, kept):
    """Renaming it mid-rollout would let the old pod and the new one each hold a Lease and act."""
    deploy(cluster, render(), before)
    assert lease_of(render_on(cluster, tmp_path)) == kept
    # Another release beside it is new: a Lease of its own.
    assert lease_of(render_on(cluster, tmp_path, name="other", upgrade=False)) == "other-operator-leader"


def leader_lease(cluster, holder: str | None) -> None:
    """Lease embedop-leader as the operators of releases from before leaseName left it: held by
    `holder` (a pod's name and the operator's random suffix), released (""), or absent (None)."""
    path = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
    cluster.request("DELETE", f"{path}/embedop-leader")
    if holder is not None:
        cluster.request("POST", path, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                       "metadata": {"name": "embedop-leader", "namespace": NS},
                                       "spec": {"holderIdentity": holder or None, "leaseDurationSeconds": 15}})


def operator_pod(cluster, name: str, release: str) -> None:
    """A running operator pod of `release`, labelled as the chart labels them."""
    path = f"/api/v1/namespaces/{NS}/pods"
    cluster.request("DELETE", f"{path}/{name}")
    cluster.request("POST", path, {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": NS, "labels": {"app.kubernetes.io/name": "embedfleet-operator",
                                                  "app.kubernetes.io/instance": release}},
        "spec": {"containers": [{"name": "operator", "image": "ghcr.io/embedfleet/embedop:0.2.0"}]}})


@pytest.mark.parametrize("holder, kept", [
    ("ef-operator-5d8f7c9b4-x2x4z_0a1b2c3d", "embedop-leader"),  # its own pod leads on it: a rename would add a leader
    ("other-operator-6c9d8b7f5-q8w7e_12345678", "ef-operator-leader"),  # another release's: it never led there
    ("ef-operator-5d8f7c9b4-gone1_0a1b2c3d", "embedop-leader"),  # a pod no longer there: nobody acts on it
    ("", "embedop-leader"),  # released
    (None, "embedop-leader"),  # none: as before
])
def test_a_release_that_shared_embedop_leader_with_another_takes_its_own(cluster, tmp_path, holder, kept):
    """Releases from before leaseName all elected on embedop-leader: of two in one namespace, the
    one whose pods never held it never led. Upgraded while another release's pod holds it, a
    release takes a Lease of its own; while one of its own pods holds it, it keeps it."""
    deploy(cluster, render(), None)
    operator_pod(cluster, "ef-operator-5d8f7c9b4-x2x4z", "ef")
    operator_pod(cluster, "other-operator-6c9d8b7f5-q8w7e", "other")
    leader_lease(cluster, holder)
    try:
        assert lease_of(render_on(cluster, tmp_path)) == kept
        # A release that names its Lease (EMBEDOP_LEASE_NAME) keeps it, whoever holds embedop-leader.
        deploy(cluster, render(), "ef-operator-leader")
        assert lease_of(render_on(cluster, tmp_path)) == "ef-operator-leader"
    finally:
        leader_lease(cluster, None)


def claim_of(objects) -> dict:
    (claim,) = [o for o in objects if o["kind"] == "Lease"]
    return claim


@pytest.mark.parametrize("values, watched", [({}, "*"), ({"watchNamespace": "search"}, "search")])
def test_each_release_claims_the_namespaces_its_operator_watches(values, watched):
    objects = render(values)
    claim = claim_of(objects)
    assert claim["metadata"]["namespace"] == NS and claim["metadata"]["labels"][scope.CLAIM_LABEL] == "true"
    assert claim["metadata"]["annotations"][scope.WATCHED] == watched
    assert env_of(objects)["EMBEDOP_SCOPE_CLAIM"] == claim["metadata"]["name"]
    assert scope.Claim.of(claim).watched == frozenset({scope.ALL if watched == "*" else watched})
    assert "spec" not in claim or not claim["spec"].get("holderIdentity")  # nothing elects on it


def test_releases_of_one_name_in_two_namespaces_do_not_share_cluster_scoped_objects():
    def cluster_scoped(namespace):
        return {(o["kind"], o["metadata"]["name"]) for o in render({"watchNamespace": namespace}, namespace=namespace)
                if "namespace" not in o["metadata"] and o["kind"] != "CustomResourceDefinition"}

    a, b = cluster_scoped("team-a"), cluster_scoped("team-b")
    assert a and not a & b


def test_no_two_releases_share_a_cluster_scoped_name():
    """Release c in namespace a-b and release b-c in namespace a: <namespace>-<fullname> gave both
    a-b-c-operator; the namespace after the last dot cannot (a namespace has no dot)."""
    def names(name, namespace):
        return {o["metadata"]["name"] for o in render({"watchNamespace": namespace, "admissionPolicy": {"enabled": True}},
                                                      name=name, namespace=namespace)
                if "namespace" not in o["metadata"] and o["kind"] != "CustomResourceDefinition"}

    one, other = names("c", "a-b"), names("b-c", "a")
    assert len(one) == len(other) == 2 and not one & other, (one, other)


def crd_owned_by(cluster, release: str | None, namespace: str = NS) -> None:
    """The CRD as the cluster has it: installed by `release` (Helm's ownership), or by kubectl (None)."""
    cluster.request("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")
    (crd,) = [o for o in render() if o["kind"] == "CustomResourceDefinition"]
    if release:
        crd["metadata"]["labels"] = {"app.kubernetes.io/managed-by": "Helm"}
        crd["metadata"]["annotations"].update({"meta.helm.sh/release-name": release,
                                               "meta.helm.sh/release-namespace": namespace})
    cluster.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)


def test_a_second_release_is_told_to_leave_the_crd_to_the_first(cluster, tmp_path):
    """Helm refuses an object another release owns; the chart says which and what to do."""
    crd_owned_by(cluster, "first", "platform")
    with pytest.raises(helm.HelmError) as refused:
        render_on(cluster, tmp_path, name="second", upgrade=False)
    message = str(refused.value)
    assert "release first in namespace platform" in message and "crds.install=false" in message
    assert "meta.helm.sh/release-name=second" in message  # adopting it, when the first is gone
    kinds = {o["kind"] for o in render_on(cluster, tmp_path, {"crds": {"install": False}}, name="second", upgrade=False)}
    assert "CustomResourceDefinition" not in kinds and "Deployment" in kinds
    # The release that owns it upgrades as before.
    assert any(o["kind"] == "CustomResourceDefinition" for o in render_on(cluster, tmp_path, name="first",
                                                                         namespace="platform"))


def test_a_crd_no_release_owns_is_left_or_adopted_as_said(cluster, tmp_path):
    crd_owned_by(cluster, None)
    with pytest.raises(helm.HelmError, match="no Helm release owns it") as refused:
        render_on(cluster, tmp_path, upgrade=False)
    assert "crds.install=false" in str(refused.value) and "kubectl label crd" in str(refused.value)
