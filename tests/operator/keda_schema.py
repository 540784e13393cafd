"""The real CRDs of KEDA's ScaledObject and its HTTP add-on's InterceptorRoute and HTTPScaledObject
(vendored in fixtures/: no version stated, fixtures/README.md), and what their API server would
refuse: the served version's openAPIV3Schema checked with jsonschema, plus what jsonschema does not
run: every x-kubernetes-validations rule (CEL) as the plain check it says (RULES: a rule the CRDs
state that this module does not know fails the check, so a newer CRD's rule cannot pass unread),
and the uniqueness of x-kubernetes-list-type set and map lists."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml

FIXTURES = Path(__file__).parent / "fixtures"
FILES = {"scaledobjects": FIXTURES / "keda.sh_scaledobjects.yaml",
         "interceptorroutes": FIXTURES / "http.keda.sh_interceptorroutes.yaml",
         "httpscaledobjects": FIXTURES / "http.keda.sh_httpscaledobjects.yaml"}
CRDS = {plural: yaml.safe_load(path.read_text()) for plural, path in FILES.items()}


def served(crd: dict) -> dict:
    """The one version the CRD serves (each of these serves one)."""
    (version,) = [v for v in crd["spec"]["versions"] if v["served"]]
    return version


def schema(plural: str) -> dict:
    return served(CRDS[plural])["schema"]["openAPIV3Schema"]


def api_version(plural: str) -> str:
    return f"{CRDS[plural]['spec']['group']}/{served(CRDS[plural])['name']}"


def kind(plural: str) -> str:
    return CRDS[plural]["spec"]["names"]["kind"]


def plural_of(kind_: str) -> str:
    return next(p for p in CRDS if kind(p) == kind_)


def _has(obj: dict, field: str) -> bool:
    return isinstance(obj, dict) and field in obj


# Each CEL rule of the three CRDs, exactly as stated, as the check it makes on `self`.
RULES = {
    "!has(self.minReplicaCount) || self.minReplicaCount <= (has(self.maxReplicaCount) ? self.maxReplicaCount : 100)":
        lambda s: not _has(s, "minReplicaCount") or s["minReplicaCount"] <= s.get("maxReplicaCount", 100),
    "has(self.port) != has(self.portName)": lambda s: _has(s, "port") != _has(s, "portName"),
    "has(self.portName) != has(self.port)": lambda s: _has(s, "port") != _has(s, "portName"),
    "has(self.fallback) || has(self.placeholder)": lambda s: _has(s, "fallback") or _has(s, "placeholder"),
    "!(has(self.body) && has(self.bodyFromConfigMap))": lambda s: not (_has(s, "body") and _has(s, "bodyFromConfigMap")),
    "has(self.concurrency) || has(self.requestRate)": lambda s: _has(s, "concurrency") or _has(s, "requestRate"),
}


def _structural(node):
    """The schema as JSON Schema: Kubernetes' x-kubernetes-* keys dropped (checked by _walk)."""
    if isinstance(node, dict):
        return {k: _structural(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if isinstance(node, list):
        return [_structural(v) for v in node]
    return node


def _walk(obj, node: dict, path: str):
    """What the x-kubernetes-* keys of `node` (the schema where `obj` sits) refuse, recursively."""
    for rule in node.get("x-kubernetes-validations") or []:
        check = RULES.get(rule["rule"])
        if check is None:
            yield f"{path}: a CEL rule this check does not know: {rule['rule']}"
        elif not check(obj):
            yield f"{path}: {rule.get('message', rule['rule'])}"
    if isinstance(obj, list):
        kind_ = node.get("x-kubernetes-list-type")
        keys = node.get("x-kubernetes-list-map-keys") or []
        seen = [tuple(item.get(k) for k in keys) if kind_ == "map" else repr(item) for item in obj]
        if kind_ in ("set", "map") and len(seen) != len(set(seen)):
            yield f"{path}: duplicate entries in a list of type {kind_}"
        for i, item in enumerate(obj):
            yield from _walk(item, node.get("items") or {}, f"{path}[{i}]")
    elif isinstance(obj, dict):
        props, extra = node.get("properties") or {}, node.get("additionalProperties")
        for key, value in obj.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield from _walk(value, sub, f"{path}.{key}")


def problems(obj: dict) -> list[str]:
    """What the API server serving the object's CRD would refuse (empty: accepted). The status is
    not judged (a subresource)."""
    plural = plural_of(obj.get("kind"))
    obj = {k: v for k, v in obj.items() if k != "status"}
    validator = jsonschema.Draft7Validator(_structural(schema(plural)))
    out = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    if obj.get("apiVersion") != api_version(plural):
        out.append(f"apiVersion: {obj.get('apiVersion')} is not served; {api_version(plural)} is")
    return out + list(_walk(obj, schema(plural), ""))


def rules() -> list[str]:
    """Every CEL rule the three CRDs state (each must be in RULES)."""
    def find(node):
        if isinstance(node, dict):
            yield from (r["rule"] for r in node.get("x-kubernetes-validations") or [])
            for v in node.values():
                yield from find(v)
        elif isinstance(node, list):
            for v in node:
                yield from find(v)
    return [r for plural in CRDS for r in find(schema(plural))]
