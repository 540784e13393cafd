"""`python -m bench.operator_load`: what settled EmbeddingServices cost the Kubernetes API.

The real operator process (`python -m embedop`) against the emulated API server
(tests/operator/emulator.py), N services in mode operator, each with one ready pod whose /metrics
(served here, on its own loopback address, on the API port, where the operator reads an
unguarded service's pod that refuses the metrics port: scrape.ports) says a steady load that
one replica carries, and a cluster holding as many Deployments and Pods of others (no label of ours) as it has services.
The pods' gauges move by a few % at every scrape and their offered counters grow, as a live
server's do. Once every service has settled (its autoscaler's status written), every request the
operator makes in a window is counted, watches aside, and printed per service per minute, beside
the operator's own leader-election requests (per operator, not per service) and its settings.

The goal (issue: hardening, item 5): a settled service costs at most 6 requests a minute."""

from __future__ import annotations

import argparse
import http.server
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from embedop import render
from tests.conftest import pod_addresses
from tests.operator import emulator as em
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import Emulator, new_service, service_path

NS = "default"
def exposition(service_rate: float, arrival_rate: float, queued: float = 0, offered_total: float | None = None,
               task: str | None = None) -> str:
    """The shared signal as a server exports it (the series the autoscaler requires); `task`: the
    task label of its embedfleet_model_info (None: a server that exports none)."""
    extra = ("" if offered_total is None else
             f"# TYPE embedfleet_offered_tokens_total counter\nembedfleet_offered_tokens_total {offered_total}\n")
    if task is not None:
        extra += f'# TYPE embedfleet_model_info gauge\nembedfleet_model_info{{model="m",task="{task}"}} 1.0\n'
    return (f"# TYPE embedfleet_service_rate_tokens_per_second gauge\n"
            f"embedfleet_service_rate_tokens_per_second {service_rate}\n"
            f"# TYPE embedfleet_arrival_rate_tokens_per_second gauge\n"
            f"embedfleet_arrival_rate_tokens_per_second {arrival_rate}\n"
            f"# TYPE embedfleet_queued_tokens gauge\nembedfleet_queued_tokens {queued}\n" + extra)


def steady_load(seed: int) -> Callable[[], str]:
    """One replica's worth of load as a live server shows it: ~500 offered tokens/s on a ~1000
    tokens/s pod (0.7 target: 1 pod), the gauges moving by a few % at each scrape and the offered
    counter growing, so the measured rates in status move as they would (and are refreshed at
    most once a minute); its model_info says it serves embed (status.task: written once)."""
    rng, start = random.Random(seed), time.monotonic()

    def text() -> str:
        return exposition(1000 * rng.uniform(0.97, 1.03), 500 * rng.uniform(0.95, 1.05), rng.choice((0, 0, 40)),
                          offered_total=500 * (time.monotonic() - start), task="embed")
    return text


def serve_metrics(ip: str, port: int, text: str | Callable[[], str]) -> http.server.ThreadingHTTPServer:
    """A pod's /metrics, answered with `text` (or what it returns), on its own address (pods share
    their port)."""
    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            body = (text() if callable(text) else text).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((ip, port), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def ready_pod(name: str, service: str | None, ip: str, namespace: str = NS) -> dict:
    """A Pod as the kubelet reports one that started and is Ready (`service` None: someone else's)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": render.labels(service) if service else {"app": "someone-else"}},
            "spec": {"containers": [{"name": "server", "image": "embedserve"}]},
            "status": {"phase": "Running", "podIP": ip, "startTime": now,
                       "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
                       "containerStatuses": [{"name": "server", "image": "embedserve", "imageID": "", "ready": True,
                                              "started": True, "restartCount": 0,
                                              "state": {"running": {"startedAt": now}}}]}}


def others(emulator: Emulator, n: int, namespace: str = "others") -> None:
    """n Deployments and n Pods of someone else's (the cluster's other workloads)."""
    for i in range(n):
        emulator.request("POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"web-{i}", "namespace": namespace,
                                                                          "labels": {"app": "web"}},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                     "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}}})
        emulator.request("POST", f"/api/v1/namespaces/{namespace}/pods", ready_pod(f"web-{i}", None, f"10.9.0.{i % 250}", namespace))


def settled(emulator: Emulator, names: list[str], interval_s: int, live: bool = True) -> list:
    """The services, each with one ready pod serving its metrics (`live`: moving as a server's do;
    else the same answer every time); → the metrics servers."""
    servers = []
    spec = {"model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
            "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 4, "intervalSeconds": interval_s}}
    # No guard: the API port, where the operator reads a server from before the metrics port (it
    # finds it after one refused connection, and remembers it).
    port = render.health_port(spec)
    for i, (name, ip) in enumerate(zip(names, pod_addresses(port, len(names)))):
        servers.append(serve_metrics(ip, port, steady_load(i) if live else exposition(1000, 500)))
        emulator.request("POST", service_path(NS), new_service(name, spec))
        emulator.request("POST", f"/api/v1/namespaces/{NS}/pods", ready_pod(f"{name}-0", name, ip))
    for name in names:
        eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"), timeout=60)
        emulator.merge_patch(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}/status",
                             {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "availableReplicas": 1}})
    for name in names:  # the autoscaler has written its status (measured rates included)
        eventually(lambda: (emulator.get(service_path(NS, name)).get("status") or {}).get("serviceRateTokensPerSecond")
                   and (emulator.get(service_path(NS, name))["status"].get("readyReplicas") == 1), timeout=120)
    return servers


def requests_between(start: float, end: float) -> list[dict]:
    """The operator's requests in [start, end), watches aside (each is one long-lived stream)."""
    return [c for c in em.calls if start <= c["t"] < end and c["subject"] == "operator" and c["verb"] != "watch"]


def run(services: int, window_s: float, interval_s: int, resync_s: float) -> dict:
    with Emulator() as emulator, tempfile.TemporaryDirectory() as d:
        others(emulator, services)
        op = OperatorProcess(emulator.kubeconfig(Path(d) / "kubeconfig"), Path(d) / "operator.log",
                             env={"EMBEDOP_RESYNC_SECONDS": str(resync_s), "EMBEDOP_LEASE_SECONDS": "15"})
        servers = []
        try:
            names = [f"svc-{i:03d}" for i in range(services)]
            servers = settled(emulator, names, interval_s)
            start = time.monotonic()
            time.sleep(window_s)  # the window being measured, not a synchronisation
            calls = requests_between(start, time.monotonic())
        except AssertionError:
            print(op.log()[-3000:], file=sys.stderr)
            raise
        finally:
            op.stop()
            for s in servers:
                s.shutdown()
    per_kind: dict[str, int] = {}
    for c in calls:
        per_kind[f"{c['verb']} {c['resource']}"] = per_kind.get(f"{c['verb']} {c['resource']}", 0) + 1
    lease = sum(n for k, n in per_kind.items() if k.endswith("leases"))
    per_min = 60 / window_s
    return {"services": services, "window_s": window_s, "interval_s": interval_s, "resync_s": resync_s,
            "requests_per_service_per_min": round((len(calls) - lease) * per_min / services, 3),
            "lease_requests_per_min": round(lease * per_min, 1), "by_kind": per_kind}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.operator_load", description=__doc__.splitlines()[0])
    p.add_argument("--services", type=int, default=24)
    p.add_argument("--window", type=float, default=60.0, help="seconds measured once settled")
    p.add_argument("--interval", type=int, default=5, help="spec.autoscaling.intervalSeconds (the CRD default)")
    p.add_argument("--resync", type=float, default=30.0, help="EMBEDOP_RESYNC_SECONDS (the default)")
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args(argv)
    out = run(args.services, args.window, args.interval, args.resync)
    print(f"{out['services']} settled services (mode operator, intervalSeconds {out['interval_s']}, "
          f"resync {out['resync_s']:g} s), {out['window_s']:g} s window, watches aside:")
    print(f"  {out['requests_per_service_per_min']} API requests per service per minute (goal <= 6)")
    print(f"  {out['lease_requests_per_min']} leader-election requests per minute (the operator's, not per service)")
    print(f"  by kind: {json.dumps(out['by_kind'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
