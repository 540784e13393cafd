"""spec.auth and spec.tls → the server pod's Secret volumes, their mounts, and the settings that
point the server at the files. Pure.

Volumes, never subPath mounts: the kubelet updates a mounted Secret (through a symlink swap) when it
changes, but never a subPath, and the servers re-read both files when they change (key rotation,
cert-manager renewals) without a restart. Each volume projects only the keys the server reads
(`items`): other keys of the Secret never reach the pod, and a missing key fails the volume's set-up
with an Event naming it (optional: false), rather than a server that starts without keys or TLS."""

from __future__ import annotations

from embedop.crd import AUTH_DIR, TLS_DIR

AUTH_VOLUME, TLS_VOLUME = "api-keys", "tls"
# Read-only, for the files' owner (root) and group; nobody else. With the pod's fsGroup (10001) the
# kubelet gives a Secret volume's files that group and, the volume being read-only, adds group read
# to their mode (0400 would become 0440 too), so the server (uid 10001, gid 10001) reads them
# through the group bit. 0440 is written because it is what the files get: the manifest says what
# the pod has, and nothing wider (no write, no world read).
SECRET_MODE = 0o440
TLS_FILES = {"TLS_CERT_FILE": "tls.crt", "TLS_KEY_FILE": "tls.key"}
CLIENT_CA = ("TLS_CLIENT_CA_FILE", "ca.crt")


def _tls_files(tls: dict) -> dict[str, str]:
    """Setting → the Secret's key it names."""
    return {**TLS_FILES, **dict([CLIENT_CA] if tls.get("clientAuth") else [])}


def env(spec: dict) -> dict[str, str]:
    """The settings spec.auth and spec.tls decide (server/embedserve/config.py reads them)."""
    out = {}
    if auth := spec.get("auth"):
        out["API_KEYS_FILE"] = f"{AUTH_DIR}/{auth['apiKeySecretRef'].get('key', 'api-keys')}"
    if tls := spec.get("tls"):
        out.update({setting: f"{TLS_DIR}/{key}" for setting, key in _tls_files(tls).items()})
    return out


def settings_owned(spec: dict) -> set[str]:
    """The env names spec.auth and spec.tls set, when they are set (spec.env may not set them too)."""
    names = set()
    if spec.get("auth"):
        names.add("API_KEYS_FILE")
    if spec.get("tls"):
        names |= {*TLS_FILES, CLIENT_CA[0]}
    return names


def _secret_volume(name: str, secret: str, keys: list[str]) -> dict:
    return {"name": name, "secret": {"secretName": secret, "defaultMode": SECRET_MODE, "optional": False,
                                     "items": [{"key": k, "path": k} for k in keys]}}


def volumes(spec: dict) -> list[dict]:
    out = []
    if auth := spec.get("auth"):
        ref = auth["apiKeySecretRef"]
        out.append(_secret_volume(AUTH_VOLUME, ref["name"], [ref.get("key", "api-keys")]))
    if tls := spec.get("tls"):
        out.append(_secret_volume(TLS_VOLUME, tls["secretRef"]["name"], list(_tls_files(tls).values())))
    return out


def mounts(spec: dict) -> list[dict]:
    out = []
    if spec.get("auth"):
        out.append({"name": AUTH_VOLUME, "mountPath": AUTH_DIR, "readOnly": True})
    if spec.get("tls"):
        out.append({"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True})
    return out
