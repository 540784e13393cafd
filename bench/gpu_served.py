"""Served throughput for bench/gpu_bench.py: a server under closed-loop load from several client
processes, all starting together and stopping at a deadline, counting the real tokens they got
back. Two servers: `python -m embedserve` (gRPC, our Client) and infinity-emb (OpenAI-style HTTP
POST /embeddings, aiohttp), on the same GPU, corpus and request shapes."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np

START_DELAY_S = 6  # client processes spawn, import and connect before the window opens


def _requests(texts, counts, per_request):
    requests = [(texts[i : i + per_request], sum(counts[i : i + per_request])) for i in range(0, len(texts), per_request)]
    requests.reverse()
    return requests


async def _closed_loop(send, requests, concurrency, start_at, duration_s) -> dict:
    """`concurrency` requests in flight until the texts or the window run out."""
    import asyncio

    done = {"texts": 0, "tokens": 0, "latencies": []}

    async def loop(stop_at):
        while requests and time.time() < stop_at:
            batch, tokens = requests.pop()
            t0 = time.perf_counter()
            await send(batch)
            done["latencies"].append(time.perf_counter() - t0)
            done["texts"] += len(batch)
            done["tokens"] += tokens

    await send(requests[-1][0])  # connected and warm before the window
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.time()
    await asyncio.gather(*(loop(t0 + duration_s) for _ in range(concurrency)))
    return {"t0": t0, "t1": time.time(), **done}


def _grpc_client(args) -> dict:
    import asyncio

    from embedserve.client import Client

    target, texts, counts, per_request, concurrency, start_at, duration_s = args

    async def run():
        async with Client(target, max_attempts=50, timeout_s=120) as client:
            return await _closed_loop(client.embed, _requests(texts, counts, per_request), concurrency, start_at,
                                      duration_s)

    return asyncio.run(run())


def _http_client(args) -> dict:
    import asyncio

    import aiohttp

    url, name, texts, counts, per_request, concurrency, start_at, duration_s = args

    async def run():
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            async def send(batch):
                async with session.post(url, json={"model": name, "input": batch}, timeout=aiohttp.ClientTimeout(total=120)) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}")

            return await _closed_loop(send, _requests(texts, counts, per_request), concurrency, start_at, duration_s)

    return asyncio.run(run())


def _scrape(url: str) -> dict[str, float]:
    """The embedfleet_* counters of /metrics, as {name{labels}: value}."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("embedfleet_") and "_bucket{" not in line:
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def _load(client, jobs, processes, start_at, scrape) -> tuple[list[dict], dict, dict]:
    """Run the client processes; scrape the server's counters as the window opens and closes."""
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pending = pool.map_async(client, jobs)
        time.sleep(max(0.0, start_at - time.time()))
        before = scrape()
        parts = pending.get()
        after = scrape()
    return parts, before, after


def _summary(parts: list[dict]) -> dict:
    elapsed = max(p["t1"] for p in parts) - min(p["t0"] for p in parts)
    lat = np.array([x for p in parts for x in p["latencies"]]) * 1e3
    return {"tokens_per_s": sum(p["tokens"] for p in parts) / elapsed, "texts_per_s": sum(p["texts"] for p in parts) / elapsed,
            "requests_per_s": len(lat) / elapsed, "seconds": elapsed, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99))}


def embedserve(model_dir: str, texts: list[str], counts: list[int], env: dict, processes: int, per_request: int,
               concurrency: int, duration_s: float) -> dict:
    """`python -m embedserve` with its defaults plus `env`. A server that exits before it is
    ready (e.g. refusing a FRONTENDS it does not support) is reported as skipped, with its log."""
    from tests.conftest import ServerProcess

    t0 = time.monotonic()
    server = ServerProcess({"MODEL_PATH": model_dir, "BATCH_CAPS": "", "MAX_DRAIN_TIME_MS": "600000", **env})
    try:
        try:
            server.wait_ready(300)
        except RuntimeError as e:  # exited: the settings were refused
            return {"skipped": f"the server did not start with {env}: {str(e)[-1500:]}"}
        ready_s = time.monotonic() - t0
        _, health = server.health()
        start_at = time.time() + START_DELAY_S
        jobs = [(server.target, texts[i::processes], counts[i::processes], per_request, concurrency, start_at, duration_s)
                for i in range(processes)]
        parts, before, after = _load(_grpc_client, jobs, processes, start_at, lambda: _scrape(server.http + "/metrics"))
    finally:
        server.stop()
    out = _summary(parts)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    real, padded = delta.get('embedfleet_tokens_total{kind="real"}', 0), delta.get('embedfleet_tokens_total{kind="padded"}', 0)
    batches = delta.get("embedfleet_batch_size_count", 0)
    log = server.log()
    budget = [line.split("packed rows: ")[1] for line in log.splitlines() if "packed rows: token budget" in line]
    caps = [line.split("batch caps per bucket: ")[1] for line in log.splitlines() if "batch caps per bucket" in line]
    return {**out, "ready_s": ready_s, "processes": processes, "texts_per_request": per_request,
            "concurrency_per_process": concurrency, "attention": health.get("attention", ""),
            "gpu_busy": delta.get("embedfleet_model_busy_seconds_total", 0) / out["seconds"],
            "real_per_padded": real / padded if padded else None, "rows_per_batch": delta.get("embedfleet_batch_size_sum", 0) / batches if batches else None,
            "health": {k: v for k, v in health.items() if "front" in k or k in ("attention", "device")},
            "shapes": (budget or caps)[:1], "server_log_tail": log[-2000:]}


def start_infinity(python: str, model_dir: str, port: int, device: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(Path(python).parent / "infinity_emb"), "v2", "--model-id", model_dir, "--served-model-name", "bench",
         "--engine", "torch", "--device", device, "--port", str(port)],
        # Without our PYTHONPATH: gpu.sh puts our pinned transformers first there, not infinity's.
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
             "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"},
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def infinity(python: str | None, model_dir: str, texts: list[str], counts: list[int], device: str, processes: int,
             per_request: int, concurrency: int, duration_s: float) -> dict:
    """infinity-emb 0.0.78's own defaults (its dynamic batching, its dtype choice) on the same
    device; skipped when INFINITY_PYTHON names no Python with it installed."""
    if not python or not (Path(python).parent / "infinity_emb").exists():
        return {"skipped": "set INFINITY_PYTHON (bench/gpu.sh: INFINITY_WHEELS) to a Python with infinity-emb"}
    from tests.conftest import free_port

    port = free_port()
    t0 = time.monotonic()
    proc = start_infinity(python, model_dir, port, device)
    try:
        for _ in range(480):
            if proc.poll() is not None:
                return {"skipped": f"infinity-emb exited with {proc.returncode}"}
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            return {"skipped": "infinity-emb was not ready within 240 s"}
        ready_s = time.monotonic() - t0
        start_at = time.time() + START_DELAY_S
        url = f"http://127.0.0.1:{port}/embeddings"
        jobs = [(url, "bench", texts[i::processes], counts[i::processes], per_request, concurrency, start_at, duration_s)
                for i in range(processes)]
        parts, _, _ = _load(_http_client, jobs, processes, start_at, dict)
    finally:
        proc.kill()
        proc.wait()
    return {**_summary(parts), "ready_s": ready_s, "processes": processes, "texts_per_request": per_request,
            "concurrency_per_process": concurrency}
