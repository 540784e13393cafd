"""Where a service's health and metrics are read (render.health_port): the metrics port when keys,
TLS or a NetworkPolicy guard the API port, else the API port, which every server version answers
without a key. The probes, the prometheus.io/port annotation, the Services' `metrics` target and
the autoscaler's scrape all follow it; METRICS_PORT and the `metrics` container port are rendered
either way. (Strict schema validation of each guard's render: test_render.py's VARIATIONS; the
autoscaler's scrape of that port: test_autoscaler_writes.py and test_scrape.py.)"""

import pytest

from embedop import render, scrape, spec as specs

OWNER = render.Owner("svc", "ns", "0b0c7e8e-0000-4000-8000-000000000001")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
AUTH = {"auth": {"apiKeySecretRef": {"name": "keys"}}}
TLS = {"tls": {"secretRef": {"name": "certs"}}}
POLICY = {"networkPolicy": {"enabled": True}}


@pytest.mark.parametrize("fields, metrics_port, port", [
    ({}, 8002, 8001),
    ({"networkPolicy": {"enabled": False, "from": [{"podSelector": {}}]}}, 8002, 8001),  # rendered no policy
    ({"tls": {"secretRef": {"name": "certs"}, "clientAuth": True}}, 8002, 8002),
    (AUTH, 8002, 8002),
    (TLS, 8002, 8002),
    (POLICY, 8002, 8002),
    ({**AUTH, **TLS, **POLICY}, 8002, 8002),
    (AUTH, 9102, 9102),  # EMBEDOP_METRICS_PORT moved it
    ({}, 9102, 8001),  # ...which an unguarded service does not read
], ids=["none", "policy-disabled", "mtls", "auth", "tls", "policy", "all", "auth-moved", "none-moved"])
def test_health_port(fields, metrics_port, port):
    spec = specs.defaulted({"model": "m", **fields})
    assert specs.problems(spec) == []
    assert render.health_port(spec, metrics_port) == port


def rendered(fields: dict, image: str = "img", metrics_port: int = render.METRICS_PORT):
    spec = specs.defaulted({"model": "m", **fields})
    return render.owned(OWNER, spec, image, 1, 45, metrics_port)


@pytest.mark.parametrize("fields, port", [({}, render.HTTP_PORT), (AUTH, render.METRICS_PORT),
                                          (TLS, render.METRICS_PORT), (POLICY, render.METRICS_PORT)],
                         ids=["none", "auth", "tls", "policy"])
def test_what_reads_health_follows_health_port(fields, port):
    deployment, service, headless, *_ = rendered(fields)
    c = deployment["spec"]["template"]["spec"]["containers"][0]
    for probe in PROBES:
        assert c[probe]["httpGet"] == {"path": "/health", "port": port}, probe
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    for svc in (service, headless):
        # The ServiceMonitor scrapes the port named `metrics`: it leads where the probes go.
        assert {"name": "metrics", "port": render.METRICS_PORT, "targetPort": port, "protocol": "TCP"} in svc["spec"]["ports"]
    # The metrics port is there either way: new servers always bind it.
    assert {"name": "metrics", "containerPort": render.METRICS_PORT, "protocol": "TCP"} in c["ports"]
    assert {"name": "METRICS_PORT", "value": str(render.METRICS_PORT)} in c["env"]


def test_an_operator_upgrade_leaves_a_pinned_old_unguarded_fleet_probed_where_its_server_answers():
    """The upgrade's render of a service without spec.image that kept an older default image (the
    Deployment's annotation): the pod template changes, so the fleet rolls, and its new pods run
    the OLD server, which binds no metrics port. Probed and scraped on 8001, which it serves, the
    rollout completes and the autoscaler keeps reading it."""
    old, new = "ghcr.io/embedfleet/embedserve:0.1.0", "ghcr.io/embedfleet/embedserve:0.2.0"
    spec = specs.defaulted({"model": "m"})
    live = {"metadata": {"annotations": {render.DEFAULT_IMAGE: old}}}
    image, notice = render.server_image(spec, live, new)
    assert image == old and new in notice
    deployment = rendered({}, image)[0]
    c = deployment["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == old
    assert {c[probe]["httpGet"]["port"] for probe in PROBES} == {8001}
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8001"
    assert render.health_port(spec) == 8001
    # The autoscaler tries the metrics port first, and reads a pod that refuses it on 8001.
    assert scrape.ports(spec) == (render.METRICS_PORT, 8001)


def test_a_guarded_fleet_needs_the_metrics_port_and_says_where_it_is_read():
    """With a guard, probes and scrapes need a server that binds METRICS_PORT; a ready pod that
    cannot be read there is said to be such an image (or a policy)."""
    from embedop import autoscale

    guarded = scrape.ports(specs.defaulted({"model": "m", **AUTH}))
    assert guarded == (render.METRICS_PORT,)
    why = scrape.unscraped([autoscale.PodSample("p", True, False)], {"p": "ClientConnectorError"}, guarded)
    assert "port 8002" in why and "server image from before the metrics port" in why
    plain = scrape.ports(specs.defaulted({"model": "m"}))
    why = scrape.unscraped([autoscale.PodSample("p", True, False)], {"p": "ClientConnectorError"}, plain)
    assert "port 8002 or 8001" in why and "server image" not in why
