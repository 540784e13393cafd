"""`python -m bench.scrape_ports`: how long a server takes to answer the autoscaler's scrape of
/metrics on its API port and on its metrics port, idle and under a flood of HTTP API requests.

One `python -m embedserve` on the simulated accelerator (`sim:1500`); the flood is a separate
process holding `--concurrency` connections that POST /embed back to back (texts of 5-40 words,
far past the device's capacity, so most are refused at once: the server's event loop, which both
ports share, is what saturates). The scrapes alternate between the two ports, one new
connection each (as the operator's: one per scrape), `--rounds` of each with the operator's 2 s timeout. It prints each
port's median and P90 time to the whole answer and its timeouts, and the metrics port's median
over the API port's: why the autoscaler reads the metrics port first (operator/embedop/scrape.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tests.conftest import ServerProcess

FLOOD = r'''
import asyncio, random, sys
import aiohttp

async def main(url, concurrency):
    async with aiohttp.ClientSession() as session:
        async def worker():
            while True:
                try:
                    async with session.post(url, json={"texts": ["hello world " * random.randint(5, 40)]}) as r:
                        await r.read()
                except Exception:
                    await asyncio.sleep(0.01)
        await asyncio.gather(*(worker() for _ in range(concurrency)))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
'''
TIMEOUT_S = 2.0  # the operator's default EMBEDOP_SCRAPE_TIMEOUT_S


async def scrape_times(ports: dict[str, str], rounds: int) -> dict[str, list[float]]:
    """Seconds to the whole answer per port (inf: timed out), alternating which goes first."""
    times: dict[str, list[float]] = {name: [] for name in ports}
    for i in range(rounds):
        order = list(ports.items()) if i % 2 else list(reversed(ports.items()))
        for name, base in order:
            async with aiohttp.ClientSession() as session:
                t = time.perf_counter()
                try:
                    async with session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as r:
                        await r.read()
                    times[name].append(time.perf_counter() - t)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    times[name].append(float("inf"))
        await asyncio.sleep(0.2)
    return times


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"median_ms": round(statistics.median(ordered) * 1000, 1),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 1),
            "timeouts": sum(t == float("inf") for t in ordered), "n": len(ordered)}


async def run(rounds: int, concurrency: int, flooders: int) -> dict:
    server = ServerProcess({"MODEL_PATH": "sim:1500"}).wait_ready(180)
    ports = {"api": server.http, "metrics": server.metrics}
    out = {}
    try:
        out["idle"] = {k: summary(v) for k, v in (await scrape_times(ports, max(4, rounds // 4))).items()}
        flood = [subprocess.Popen([sys.executable, "-c", FLOOD, server.http + "/embed", str(concurrency)])
                 for _ in range(flooders)]
        try:
            await asyncio.sleep(3)  # the flood reaches its pace (not a synchronisation: a warm-up)
            out["flooded"] = {k: summary(v) for k, v in (await scrape_times(ports, rounds)).items()}
        finally:
            for p in flood:
                p.kill()
                p.wait()
    finally:
        server.stop()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scrape_ports", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40, help="scrapes of each port under the flood")
    p.add_argument("--concurrency", type=int, default=64, help="connections per flooding process")
    p.add_argument("--flooders", type=int, default=1, help="flooding processes")
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args(argv)
    out = asyncio.run(run(args.rounds, args.concurrency, args.flooders))
    for phase, by_port in out.items():
        for port, s in by_port.items():
            print(f"{phase:<8} {port:<8} median {s['median_ms']:>7} ms  p90 {s['p90_ms']:>7} ms  "
                  f"timeouts {s['timeouts']}/{s['n']}")
        ratio = by_port["metrics"]["median_ms"] / by_port["api"]["median_ms"] if by_port["api"]["median_ms"] else float("nan")
        print(f"{phase:<8} metrics/api median {ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
