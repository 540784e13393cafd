"""The real InferencePool CRDs (vendored in fixtures/, each with where it came from): the
newest one we track (CRD, CRD_FILE) and v1.0.0 (CRD_V1_0_0, CRD_FILE_V1_0_0: the same served
version, inference.networking.k8s.io/v1, without appProtocol). Their v1 openAPIV3Schema checked
with jsonschema, and their x-kubernetes-validations (CEL, which jsonschema does not run) as the
plain checks they say, each asserted to still be in the file."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml

FIXTURES = Path(__file__).parent / "fixtures"
CRD_FILE = FIXTURES / "inference.networking.k8s.io_inferencepools.yaml"
CRD_FILE_V1_0_0 = FIXTURES / "inference.networking.k8s.io_inferencepools-v1.0.0.yaml"
CRD = yaml.safe_load(CRD_FILE.read_text())
CRD_V1_0_0 = yaml.safe_load(CRD_FILE_V1_0_0.read_text())


def v1_schema(crd: dict) -> dict:
    """The openAPIV3Schema of the CRD's served version v1."""
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


SCHEMA = v1_schema(CRD)
SPEC = SCHEMA["properties"]["spec"]
# The CEL rules this file expresses, exactly as the CRDs state them: a CRD that changes one fails here.
PICKER_PORT_RULE = "self.kind != 'Service' || has(self.port)"
UNIQUE_PORTS_RULE = "self.all(p1, self.exists_one(p2, p1.number==p2.number))"


def _rules(crd: dict, field: str) -> list[str]:
    return [r["rule"] for r in v1_schema(crd)["properties"]["spec"]["properties"][field].get("x-kubernetes-validations", [])]


assert _rules(CRD, "endpointPickerRef") == [PICKER_PORT_RULE] and _rules(CRD, "targetPorts") == [UNIQUE_PORTS_RULE]
# v1.0.0: one target port at most (maxItems 1), so no uniqueness rule; and no appProtocol.
assert _rules(CRD_V1_0_0, "endpointPickerRef") == [PICKER_PORT_RULE] and _rules(CRD_V1_0_0, "targetPorts") == []
assert "appProtocol" not in v1_schema(CRD_V1_0_0)["properties"]["spec"]["properties"]


def _structural(schema):
    """The schema as JSON Schema: Kubernetes' x-kubernetes-* extensions dropped (jsonschema ignores
    unknown keywords anyway; dropped so nothing is mistaken for checked) and `format: int32` left
    to the minimum/maximum beside it."""
    if isinstance(schema, dict):
        return {k: _structural(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if isinstance(schema, list):
        return [_structural(v) for v in schema]
    return schema


def problems(pool: dict, crd: dict = CRD) -> list[str]:
    """What the API server serving `crd` would refuse in `pool` (empty: accepted): the schema,
    then the CEL rules it states on the defaulted object (the API server defaults before it runs
    them)."""
    schema = v1_schema(crd)
    spec_schema = schema["properties"]["spec"]
    validator = jsonschema.Draft7Validator(_structural(schema))
    out = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(pool)]
    spec = pool.get("spec") or {}
    picker = spec.get("endpointPickerRef") or {}
    if PICKER_PORT_RULE in _rules(crd, "endpointPickerRef") and "port" not in picker \
            and picker.get("kind", spec_schema["properties"]["endpointPickerRef"]["properties"]["kind"]["default"]) == "Service":
        out.append("spec.endpointPickerRef: port is required when kind is 'Service' or unspecified")
    numbers = [p.get("number") for p in spec.get("targetPorts") or []]
    if UNIQUE_PORTS_RULE in _rules(crd, "targetPorts") and len(numbers) != len(set(numbers)):
        out.append("spec.targetPorts: port number must be unique")
    return out
