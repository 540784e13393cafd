"""The CRD's cross-field rules as a real API server runs them. Here they are evaluated by
cel-python on an object defaulted by our own code (tests/operator/test_crd.py); only a real API
server shows that each rule compiles within its cost budget, sees the structural defaults (a
spec without `admission` or `batching` still has them) and refuses the object at `kubectl apply`."""

import pytest

from tests.operator.emulator import new_service, service_path
from tests.operator.test_crd import CROSS_FIELD


@pytest.mark.parametrize("case", range(len(CROSS_FIELD)))
def test_the_api_server_refuses_what_the_rules_refuse(emulator, namespace, case):
    field, value, message, _ = CROSS_FIELD[case]
    name = f"bad-{case}"
    code, reply = emulator.attempt("POST", service_path(namespace), new_service(name, {"model": "m", field: value}, namespace))
    if code == 201:  # wrongly accepted: leave nothing behind for the next case
        emulator.request("DELETE", service_path(namespace, name))
    assert code == 422, reply
    assert message in reply


def test_defaults_satisfy_the_rules(emulator, namespace):
    created = emulator.request("POST", service_path(namespace), new_service("plain", {"model": "m"}, namespace))
    assert created["spec"]["batching"]["deadlineWaitMs"] == 50  # defaulted, then validated
    emulator.request("DELETE", service_path(namespace, "plain"))


def test_spec_task_is_an_enum_the_api_server_enforces(emulator, namespace):
    """spec.task takes embed, rerank, sparse or classify (the reranker example's); anything else is
    refused at `kubectl apply`, naming the value."""
    code, reply = emulator.attempt("POST", service_path(namespace),
                                   new_service("bad-task", {"model": "m", "task": "summarize"}, namespace))
    if code == 201:
        emulator.request("DELETE", service_path(namespace, "bad-task"))
    assert code == 422 and "summarize" in reply, reply
    created = emulator.request("POST", service_path(namespace),
                               new_service("reranker", {"model": "BAAI/bge-reranker-base", "task": "rerank"}, namespace))
    assert created["spec"]["task"] == "rerank"
    emulator.request("DELETE", service_path(namespace, "reranker"))
