"""`python -m bench.routing`: the Client's routing, round robin against least-drain (the default),
side by side in one run, alternating, over pods behind a real DNS server on loopback (as a
headless Service: tests/conftest.py LoopbackDNS). Pods run the simulated device, so their speeds
are known and this 2-core machine only has to carry gRPC, not the model:

- "3x apart": one pod at RATE tokens/s, one at RATE/3;
- "equal": two pods at RATE.

Each run offers Poisson arrivals of single ~60-token texts at LOAD of the pair's capacity for
DURATION seconds, through one Client with its defaults (30 s deadline, waits for booked room,
retries) but `routing`. Prints P50/P99 of the calls that succeeded, goodput (successful calls/s)
and failures, per scenario and routing, and the P99 ratio. Goal: with a pod 3x slower, P99 at
least 2x lower with least-drain; at equal pods, no call lost either way."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import grpc
import numpy as np

from bench.loadgen import Outcome, open_loop, summarize
from embedserve.client import Client
from tests.conftest import LoopbackDNS, ServerProcess, free_port, pod_addresses

CAPS = "16:8,32:8,64:8,128:4,256:2,512:1"
NAME = "pods.bench"
TEXT_TOKENS = 64  # the bucket each text lands in (~55 words' tokens and [CLS], [SEP])
ROUTINGS = ("round-robin", "least-drain")


# name → its two pods among start_pods' (fast, slow, fast), and their capacity in fast pods
SCENARIOS = {"3x apart": ((0, 1), 1 + 1 / 3), "equal": ((0, 2), 2.0)}


def start_pods(rate: float) -> list[ServerProcess]:
    port = free_port()
    rates = (rate, rate / 3, rate)
    pods = [ServerProcess({"MODEL_PATH": f"sim:{r:g}", "BATCH_CAPS": CAPS, "BIND_HOST": host, "GRPC_PORT": str(port)})
            for host, r in zip(pod_addresses(port, 3), rates)]
    for p in pods:
        p.wait_ready(300)
    return pods


async def idle(pods: list[ServerProcess]) -> None:
    """Until no pod has anything queued: a run starts on empty queues."""
    while any([(await asyncio.to_thread(p.health))[1].get("queued_tokens", 0) for p in pods]):
        await asyncio.sleep(0.1)


async def run(target: str, routing: str, rate_per_s: float, duration_s: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    words = "embedding vector search query passage retrieval model token batch bucket latency".split()
    async with Client(target, routing=routing) as client:
        for i in range(20):  # connected to both pods, and they to the texts' characters per token
            await client.embed([" ".join(rng.choice(words, 50))])

        async def send() -> Outcome:
            text = " ".join(rng.choice(words, 50))
            t0 = time.perf_counter()
            try:
                await client.embed([text])
                code = "OK"
            except grpc.aio.AioRpcError as e:
                code = e.code().name
            done = time.perf_counter()
            return Outcome(code, done - t0, TEXT_TOKENS, done_at=done)

        outcomes, sent_for = await open_loop(send, rate_per_s, duration_s, seed)
        return {**summarize(outcomes, sent_for), "offered_per_s": len(outcomes) / sent_for, "hedges": client.hedges}


async def bench(args) -> dict:
    dns = LoopbackDNS()
    pods = await asyncio.to_thread(start_pods, args.rate)
    results: dict[str, dict[str, list[dict]]] = {}
    try:
        for name, ((a, b), fast_pods) in SCENARIOS.items():
            if args.scenario and name not in args.scenario:
                continue
            pair = [pods[a], pods[b]]
            dns.records[NAME] = [p.host for p in pair]
            rate_per_s = args.load * fast_pods * args.rate / TEXT_TOKENS
            results[name] = {r: [] for r in ROUTINGS}
            for rep in range(args.reps):
                order = ROUTINGS if rep % 2 == 0 else ROUTINGS[::-1]  # alternating: neither always runs first
                for routing in order:
                    await idle(pair)
                    r = await run(dns.target(NAME, pair[0].grpc_port), routing, rate_per_s, args.duration, seed=rep)
                    results[name][routing].append(r)
                    print(f"  {name:<10} {routing:<12} rep {rep}: P50 {r['p50_ms']:7.1f} ms  P99 {r['p99_ms']:8.1f} ms  "
                          f"goodput {r['ok_requests_per_s']:6.1f}/s  {r['codes']}  hedges {r['hedges']}", flush=True)
    finally:
        for p in pods:
            p.stop()
        dns.stop()
    return results


def table(results: dict) -> str:
    lines = [f"{'scenario':<11}{'routing':<13}{'P50 ms':>8}{'P99 ms':>9}{'goodput/s':>11}{'offered/s':>11}{'failed':>8}"
             f"{'hedges':>8}"]
    for name, by_routing in results.items():
        p99 = {}
        for routing, runs in by_routing.items():
            med = lambda key: float(np.median([r[key] for r in runs]))  # noqa: E731
            failed = sum(n for r in runs for code, n in r["codes"].items() if code != "OK")
            p99[routing] = med("p99_ms")
            lines.append(f"{name:<11}{routing:<13}{med('p50_ms'):>8.1f}{p99[routing]:>9.1f}{med('ok_requests_per_s'):>11.1f}"
                         f"{med('offered_per_s'):>11.1f}{failed:>8}{sum(r['hedges'] for r in runs):>8}")
        lines.append(f"{'':<11}P99 round-robin / least-drain: {p99['round-robin'] / max(p99['least-drain'], 1e-9):.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=6000, help="the fast pod's tokens/s (simulated device)")
    p.add_argument("--load", type=float, default=0.6, help="offered load, a share of the pair's capacity")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per run")
    p.add_argument("--reps", type=int, default=2, help="runs per routing and scenario (alternating)")
    p.add_argument("--scenario", action="append", choices=("3x apart", "equal"), help="only these (default: both)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    results = asyncio.run(bench(args))
    print("\n" + table(results))
    print("\ngoal: with a pod 3x slower, P99 at least 2x lower with least-drain; at equal pods, none failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
