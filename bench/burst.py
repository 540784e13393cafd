"""`python -m bench.burst`: a burst far beyond the drain budget, sent at once, through each
reference client with its defaults, against the server on the packaged model (CPU, default
settings), side by side with booking switched off (RESERVATION_HORIZON_MS=0: a refusal is only
a refusal, as before). Prints, per client and setting: how many succeeded, how long the burst
took, and that over the server's own compute time for it (model-busy seconds)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np

from embedserve.client import Client
from tests.conftest import ServerProcess, counter, make_text, rejections


def requests(n: int, seed: int) -> list[list[str]]:
    """n requests of 1-4 texts of 5-30 words, as the issue measured."""
    rng = np.random.default_rng(seed)
    return [[make_text(rng, int(w)) for w in rng.integers(5, 30, size=int(k))] for k in rng.integers(1, 5, size=n)]


async def grpc_burst(server: ServerProcess, batch: list[list[str]]) -> int:
    async with Client(server.target) as client:
        outcomes = await asyncio.gather(*(client.embed(t) for t in batch), return_exceptions=True)
    return sum(not isinstance(o, BaseException) for o in outcomes)


async def openai_burst(server: ServerProcess, batch: list[list[str]], model: str) -> int:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.http + "/v1", api_key="unused")
    outcomes = await asyncio.gather(*(client.embeddings.create(model=model, input=t) for t in batch),
                                    return_exceptions=True)
    await client.close()
    return sum(not isinstance(o, BaseException) for o in outcomes)


def measure(server: ServerProcess, run) -> dict:
    busy0 = counter(server.http, "embedfleet_model_busy_seconds_total")
    refused0 = rejections(server.http)
    t0 = time.perf_counter()
    ok = asyncio.run(run())
    elapsed = time.perf_counter() - t0
    busy = counter(server.http, "embedfleet_model_busy_seconds_total") - busy0
    refused = rejections(server.http) - refused0
    return {"ok": ok, "elapsed_s": elapsed, "compute_s": busy, "refusals": refused}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--grpc", type=int, default=300)
    p.add_argument("--openai", type=int, default=100)
    p.add_argument("--json")
    args = p.parse_args(argv)
    warm = requests(20, seed=9)
    results = {}
    for label, horizon in (("booking (default)", None), ("no booking", "0")):
        env = {"BATCH_CAPS": ""} | ({"RESERVATION_HORIZON_MS": horizon} if horizon else {})
        server = ServerProcess(env).wait_ready(600)
        try:
            asyncio.run(grpc_burst(server, warm))  # a server that has seen traffic (chars per token)
            results[label] = {
                f"Client x{args.grpc}": measure(server, lambda: grpc_burst(server, requests(args.grpc, 0))),
                f"openai x{args.openai}": measure(
                    server, lambda: openai_burst(server, requests(args.openai, 1), "all-MiniLM-L6-v2")),
            }
        finally:
            server.stop()
    print(f"\n{'setting':<19}{'client':<14}{'ok':>6}{'refusals':>10}{'burst s':>9}{'compute s':>11}{'ratio':>7}")
    for label, by_client in results.items():
        for name, r in by_client.items():
            total = int(name.split("x")[-1])
            print(f"{label:<19}{name:<14}{r['ok']:>3}/{total:<3}{int(r['refusals']):>9}{r['elapsed_s']:>9.1f}"
                  f"{r['compute_s']:>11.1f}{r['elapsed_s'] / max(r['compute_s'], 1e-9):>7.2f}")
    print("\ntargets (default): every request succeeds; the Client's burst within 1.5x the compute time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
