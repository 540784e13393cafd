"""The operator's settings: read once from the environment; a bad value is a start-up error naming it."""

import pytest

from embedop.config import OperatorSettings


def test_defaults():
    s = OperatorSettings.from_env({})
    assert (s.resync_seconds, s.lease_seconds, s.leader_election, s.lease_name) == (30.0, 15, True, "embedop-leader")
    assert s.identity  # unique per process: a pod restarted under its name is a new candidate
    assert s.metrics_port == 8002 and (s.pod_namespace, s.pod_labels) == ("", ())


def test_the_operators_own_pods_as_the_chart_tells_them():
    """What a service's NetworkPolicy admits to the metrics port (render_network.OperatorPods)."""
    s = OperatorSettings.from_env({"POD_NAMESPACE": "ops",
                                   "EMBEDOP_POD_LABELS": "app.kubernetes.io/name=embedfleet-operator, app.kubernetes.io/instance=ef"})
    assert s.pod_namespace == "ops"
    assert s.pod_labels == (("app.kubernetes.io/name", "embedfleet-operator"), ("app.kubernetes.io/instance", "ef"))
    assert OperatorSettings.from_env({"POD_NAMESPACE": "ops", "EMBEDOP_POD_NAMESPACE": "x"}).pod_namespace == "x"


def test_the_lease_lives_in_the_pods_namespace():
    assert OperatorSettings.from_env({"POD_NAMESPACE": "ops"}).lease_namespace == "ops"
    assert OperatorSettings.from_env({"POD_NAMESPACE": "ops", "EMBEDOP_LEASE_NAMESPACE": "x"}).lease_namespace == "x"


@pytest.mark.parametrize("key, value", [
    ("EMBEDOP_LEASE_SECONDS", "2.5"), ("EMBEDOP_LEASE_SECONDS", "2"), ("EMBEDOP_LEASE_SECONDS", "nan"),
    ("EMBEDOP_RESYNC_SECONDS", "nan"), ("EMBEDOP_RESYNC_SECONDS", "0"), ("EMBEDOP_SCRAPE_TIMEOUT_S", "inf"),
    ("EMBEDOP_API_TIMEOUT_S", "-1"), ("EMBEDOP_LEADER_ELECTION", "maybe"),
    ("EMBEDOP_POD_LABELS", "app"), ("EMBEDOP_POD_LABELS", "a=b,c d=e"), ("EMBEDOP_POD_LABELS", "a=-b-"),
    ("EMBEDOP_POD_LABELS", "=b"), ("EMBEDOP_METRICS_PORT", "0"), ("EMBEDOP_METRICS_PORT", "65536"),
    ("EMBEDOP_METRICS_PORT", "metrics"),
])
def test_bad_values_are_refused_naming_the_variable(key, value):
    with pytest.raises(ValueError, match=key):
        OperatorSettings.from_env({key: value})


@pytest.mark.parametrize("port, which", [("50051", "gRPC"), ("8001", "HTTP API")])
def test_the_metrics_port_may_not_be_a_port_the_servers_already_bind(port, which):
    """Every server would refuse to start ("the same port"), and every fleet with it."""
    from embedop import render

    assert {int(port)} <= {render.GRPC_PORT, render.HTTP_PORT}
    with pytest.raises(ValueError, match=f"EMBEDOP_METRICS_PORT='{port}'.*{which}"):
        OperatorSettings.from_env({"EMBEDOP_METRICS_PORT": port})
    assert OperatorSettings.from_env({"EMBEDOP_METRICS_PORT": "9102"}).metrics_port == 9102


@pytest.mark.parametrize("lease, timeout", [("6", "5"), ("12", "5"), ("15", "6"), ("3", "1.2")])
def test_a_lease_that_leaves_no_room_for_a_renewal_is_refused(lease, timeout):
    """A renewal may take the whole API timeout and must land before the leader stops writing
    (max(lease / 3, timeout) before a successor may start): 5 s calls on a 6 s lease left the
    leader a leader only between renewals, and its successor a gap shorter than a write."""
    with pytest.raises(ValueError, match=f"EMBEDOP_API_TIMEOUT_S={timeout}.*EMBEDOP_LEASE_SECONDS={lease}"):
        OperatorSettings.from_env({"EMBEDOP_LEASE_SECONDS": lease, "EMBEDOP_API_TIMEOUT_S": timeout})
    # Without election, there is no lease to fit.
    OperatorSettings.from_env({"EMBEDOP_LEASE_SECONDS": lease, "EMBEDOP_API_TIMEOUT_S": timeout,
                               "EMBEDOP_LEADER_ELECTION": "false"})


@pytest.mark.parametrize("lease, timeout", [("15", 5.0), ("10", 10 / 3), ("3", 1.0), ("60", 5.0)])
def test_the_api_timeout_defaults_to_what_the_lease_leaves_room_for(lease, timeout):
    """Unset: 5 s, or a third of the lease if less (a chart's shorter leaseSeconds still starts)."""
    s = OperatorSettings.from_env({"EMBEDOP_LEASE_SECONDS": lease})
    assert s.api_timeout_s == pytest.approx(timeout)
    from embedop.leader import Leadership

    Leadership(None, "ns", "l", "me", s.lease_seconds, None, None, request_s=s.api_timeout_s)  # accepted
    with pytest.raises(ValueError, match="EMBEDOP_API_TIMEOUT_S"):
        Leadership(None, "ns", "l", "me", s.lease_seconds, None, None, request_s=0.4 * s.lease_seconds)
