"""A guarded service on a real cluster: API keys and TLS from Secrets, a NetworkPolicy, and the
operator installed by the chart (with its own NetworkPolicy) in the cluster, where the policy's
operator peer must select its pod. The real API server accepts the NetworkPolicy, the kubelet's
probes pass on the metrics port with keys and TLS on, and the operator still scrapes the pods:
status shows their measured rates and MetricsUnavailable=False. Where the network plugin enforces
NetworkPolicies (kindnet since kind 0.24, Calico, Cilium) the scrape crosses the policy.
Needs the helm CLI and both images in the cluster (EMBEDFLEET_OPERATOR_IMAGE,
EMBEDFLEET_SERVER_IMAGE); the servers run the simulated device."""

import base64
import datetime
import secrets
import shutil

import pytest

from tests.cluster.conftest import OPERATOR_IMAGE, SERVER_IMAGE
from tests.cluster.test_uninstall_on_cluster import CHART, helm, image_values
from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path

pytestmark = pytest.mark.skipif(not (shutil.which("helm") and OPERATOR_IMAGE and SERVER_IMAGE),
                                reason="needs the helm CLI, EMBEDFLEET_OPERATOR_IMAGE and EMBEDFLEET_SERVER_IMAGE")


def self_signed(name: str) -> tuple[bytes, bytes]:
    """(certificate, key) PEM for `name`, its own CA (cert-manager's Secret shape: ca.crt = it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def secret(namespace: str, name: str, data: dict[str, bytes], type_: str = "Opaque") -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}, "type": type_,
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


def condition(cr: dict, type_: str) -> dict:
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


@pytest.mark.timeout(900)
def test_a_guarded_service_is_probed_and_scraped_through_its_policy(emulator, namespace):
    ns, release, name = namespace, "ef", "guarded"
    helm("install", release, str(CHART), "--namespace", ns, "--set", f"watchNamespace={ns}", "--wait",
         "--set", "crds.install=false", "--set", "networkPolicy.enabled=true",
         *image_values(OPERATOR_IMAGE, "image"), *image_values(SERVER_IMAGE, "serverImage"))
    try:
        cert, key = self_signed(f"{name}.{ns}.svc")
        emulator.request("POST", f"/api/v1/namespaces/{ns}/secrets",
                         secret(ns, "guarded-keys", {"api-keys": secrets.token_hex(16).encode()}))
        emulator.request("POST", f"/api/v1/namespaces/{ns}/secrets",
                         secret(ns, "guarded-tls", {"tls.crt": cert, "tls.key": key, "ca.crt": cert}, "kubernetes.io/tls"))
        emulator.request("POST", service_path(ns), new_service(name, {
            "model": "sim:20000", "resources": {"gpu": 0, "cpu": "250m", "memory": "1Gi"},
            "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 2},
            "auth": {"apiKeySecretRef": {"name": "guarded-keys"}}, "tls": {"secretRef": {"name": "guarded-tls"}},
            "networkPolicy": {"enabled": True}}, ns))
        policy = eventually(lambda: emulator.get(f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/{name}"),
                            timeout=60)
        assert policy["metadata"]["ownerReferences"][0]["name"] == name
        operator_pod = emulator.get(f"/api/v1/namespaces/{ns}/pods?labelSelector=app.kubernetes.io/instance={release},"
                                    "app.kubernetes.io/name=embedfleet-operator")["items"][0]
        (metrics_rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 8002]
        (peer,) = metrics_rule["from"]
        assert peer["podSelector"]["matchLabels"].items() <= operator_pod["metadata"]["labels"].items()
        assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": ns}
        # The kubelet's probes, on the plain metrics port, pass with keys and TLS on the API ports.
        eventually(lambda: (emulator.get(service_path(ns, name)).get("status") or {}).get("readyReplicas") == 1,
                   timeout=600)
        # The operator, in its pod, scrapes the servers through the policy.
        cr = eventually(lambda: (c := emulator.get(service_path(ns, name)))
                        and condition(c, "MetricsUnavailable").get("reason") == "Scraped" and c, timeout=120)
        assert condition(cr, "MetricsUnavailable")["status"] == "False"
        assert cr["status"].get("serviceRateTokensPerSecond") is not None
    finally:
        emulator.request("DELETE", service_path(ns, name))
        helm("uninstall", release, "--namespace", ns, "--no-hooks", "--wait")
