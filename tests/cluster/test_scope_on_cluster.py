"""One operator per namespace on a real API server: a claim Lease as the chart makes it (the API
server stamps its creationTimestamp), listed across the cluster by label, stops an operator that
would watch the namespace it claims; a claim on another namespace does not."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from embedop import scope
from tests.cluster.conftest import operator_env
from tests.operator.conftest import OperatorProcess, eventually


def test_an_overlapping_claim_stops_the_operator_and_a_disjoint_one_does_not(emulator, namespace, tmp_path):
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    name = f"other-operator-scope-{uuid.uuid4().hex[:4]}"

    def claim(watched: str) -> None:
        emulator.request("DELETE", f"{leases}/{name}")
        emulator.request("POST", leases, {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "labels": {scope.CLAIM_LABEL: "true", "app.kubernetes.io/instance": "other"},
                         "annotations": {scope.WATCHED: watched}}})

    def start(log: str) -> OperatorProcess:
        return OperatorProcess(Path(os.environ["KUBECONFIG"]), tmp_path / log, namespace=namespace,
                               env=operator_env(namespace))

    try:
        claim(namespace)
        op = start("refused.log")
        try:
            assert op.proc.wait(60) == 2
        finally:
            op.stop()
        assert f"release other in namespace {namespace}" in op.log()
        claim(f"{namespace}-elsewhere")
        op = start("runs.log")
        try:
            eventually(lambda: "no other operator's claim overlaps it" in op.log(), timeout=60)
        finally:
            op.stop()
    finally:
        emulator.request("DELETE", f"{leases}/{name}")
