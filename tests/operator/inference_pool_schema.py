"""The real InferencePool CRD (vendored in fixtures/, with where it came from): its v1
openAPIV3Schema checked with jsonschema, and its x-kubernetes-validations (CEL, which jsonschema
does not run) as the plain checks they say, each asserted to still be in the file."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml

CRD_FILE = Path(__file__).parent / "fixtures" / "inference.networking.k8s.io_inferencepools.yaml"
CRD = yaml.safe_load(CRD_FILE.read_text())
(V1,) = [v for v in CRD["spec"]["versions"] if v["name"] == "v1"]
SCHEMA = V1["schema"]["openAPIV3Schema"]
SPEC = SCHEMA["properties"]["spec"]
# The CEL rules this file expresses, exactly as the CRD states them: a CRD that changes one fails here.
PICKER_PORT_RULE = "self.kind != 'Service' || has(self.port)"
UNIQUE_PORTS_RULE = "self.all(p1, self.exists_one(p2, p1.number==p2.number))"
assert [r["rule"] for r in SPEC["properties"]["endpointPickerRef"]["x-kubernetes-validations"]] == [PICKER_PORT_RULE]
assert [r["rule"] for r in SPEC["properties"]["targetPorts"]["x-kubernetes-validations"]] == [UNIQUE_PORTS_RULE]


def _structural(schema):
    """The schema as JSON Schema: Kubernetes' x-kubernetes-* extensions dropped (jsonschema ignores
    unknown keywords anyway; dropped so nothing is mistaken for checked) and `format: int32` left
    to the minimum/maximum beside it."""
    if isinstance(schema, dict):
        return {k: _structural(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if isinstance(schema, list):
        return [_structural(v) for v in schema]
    return schema


def problems(pool: dict) -> list[str]:
    """What the API server would refuse in `pool` (empty: accepted): the schema, then the CEL rules
    on the defaulted object (the API server defaults before it runs them)."""
    validator = jsonschema.Draft7Validator(_structural(SCHEMA))
    out = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(pool)]
    spec = pool.get("spec") or {}
    picker = spec.get("endpointPickerRef") or {}
    if picker.get("kind", SPEC["properties"]["endpointPickerRef"]["properties"]["kind"]["default"]) == "Service" \
            and "port" not in picker:
        out.append("spec.endpointPickerRef: port is required when kind is 'Service' or unspecified")
    numbers = [p.get("number") for p in spec.get("targetPorts") or []]
    if len(numbers) != len(set(numbers)):
        out.append("spec.targetPorts: port number must be unique")
    return out
