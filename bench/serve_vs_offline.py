"""Served throughput vs the offline limit, side by side in one run on this machine.

(a) offline: the model alone on the corpus, length-sorted batches, best of a batch-size sweep;
(b) served: the same corpus as single-text gRPC Embed requests, closed loop at concurrency C,
    against a real `python -m embedserve` process (default settings: warm-up sweep on).
Prints real (unpadded) tokens/s for both and the ratio. Usage:
    python -m bench.serve_vs_offline [--texts 800] [--concurrency 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.corpus import corpus  # noqa: E402


def model_max_length(model_dir: str) -> int:
    """Tokens per text as the model declares them (and the server serves them)."""
    from embedserve.model.declared import read

    return read(model_dir).max_seq_length or 512


def offline(texts: list[str], sizes=(1, 4, 8, 16, 32)) -> dict:
    import torch
    from transformers import AutoModel, AutoTokenizer

    from embedserve.model.source import packaged_model_dir
    from embedserve.model.pooling import pool

    d = str(packaged_model_dir())
    tok = AutoTokenizer.from_pretrained(d)
    max_length = model_max_length(d)
    model = AutoModel.from_pretrained(d, dtype=torch.float32).eval()
    order = sorted(range(len(texts)), key=lambda i: len(tok(texts[i], truncation=True, max_length=max_length)["input_ids"]))
    ordered = [texts[i] for i in order]
    results = {}
    with torch.inference_mode():
        model(**tok(["warm up"], return_tensors="pt"))
        for bs in sizes:
            real, t0 = 0, time.perf_counter()
            for i in range(0, len(ordered), bs):
                enc = tok(ordered[i : i + bs], truncation=True, max_length=max_length, padding=True, return_tensors="pt")
                hidden = model(**enc).last_hidden_state
                torch.nn.functional.normalize(pool(hidden, enc["input_ids"], enc["attention_mask"], "mean"), dim=-1)
                real += int(enc["attention_mask"].sum())
            results[bs] = real / (time.perf_counter() - t0)
            print(f"  offline batch {bs:>2}: {results[bs]:8.0f} real tokens/s", flush=True)
    best = max(results, key=results.get)
    return {"sweep": results, "best_batch": best, "tokens_per_s": results[best]}


async def served(texts: list[str], target: str, concurrency: int, count_tokens) -> dict:
    from embedserve.client import Client

    queue = list(range(len(texts)))
    latencies: list[float] = []

    async def loop(client):
        while queue:
            i = queue.pop()
            t0 = time.perf_counter()
            await client.embed([texts[i]])
            latencies.append(time.perf_counter() - t0)

    async with Client(target, max_attempts=50, timeout_s=300) as client:
        await client.embed(texts[:4])  # connection + first-call costs out of the timing
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    real = sum(count_tokens(t) for t in texts)
    lat = np.array(latencies) * 1000
    return {"tokens_per_s": real / elapsed, "requests_per_s": len(texts) / elapsed,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99))}


def padding_efficiency(http: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(http + "/metrics").read().decode()
    value = {k: float(line.split()[-1]) for line in text.splitlines()
             for k in ("real", "padded") if line.startswith(f'embedfleet_tokens_total{{kind="{k}"}}')}
    return value["real"] / value["padded"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--texts", type=int, default=800)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--json")
    p.add_argument("--server-env", action="append", default=[], metavar="K=V", help="extra server settings")
    args = p.parse_args(argv)
    from tests.conftest import ServerProcess  # the same launcher the tests use
    from transformers import AutoTokenizer

    from embedserve.model.source import packaged_model_dir

    texts = corpus(args.texts, seed=1)
    tok = AutoTokenizer.from_pretrained(str(packaged_model_dir()))
    count = lambda t: len(tok(t, truncation=True, max_length=model_max_length(str(packaged_model_dir())))["input_ids"])  # noqa: E731
    print(f"corpus: {len(texts)} texts, {sum(map(count, texts))} real tokens", flush=True)
    print("(a) offline, length-sorted batches:", flush=True)
    a = offline(texts)
    print("(b) served: starting embedserve (warm-up sweep on) ...", flush=True)
    extra = dict(kv.split("=", 1) for kv in args.server_env)
    server = ServerProcess({"BATCH_CAPS": "", "MAX_DRAIN_TIME_MS": "600000", **extra}).wait_ready(600)
    try:
        b = asyncio.run(served(texts, server.target, args.concurrency, count))
        b["padding_efficiency"] = padding_efficiency(server.http)
    finally:
        server.stop()
    caps = [line.split("batch caps per bucket: ")[1] for line in server.log().splitlines() if "batch caps per bucket" in line]
    ratio = b["tokens_per_s"] / a["tokens_per_s"]
    print(f"\n{'system':<34}{'real tokens/s':>14}")
    print(f"{'(a) offline best (batch ' + str(a['best_batch']) + ')':<34}{a['tokens_per_s']:>14.0f}")
    print(f"{'(b) embedserve, C=' + str(args.concurrency):<34}{b['tokens_per_s']:>14.0f}")
    print(f"ratio served/offline = {ratio:.3f}   (target >= 0.85)")
    print(f"served: real/padded tokens {b['padding_efficiency']:.3f}, {b['requests_per_s']:.1f} req/s, p50 {b['p50_ms']:.0f} ms, p99 {b['p99_ms']:.0f} ms; caps {caps[0] if caps else '?'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"offline": a, "served": b, "ratio": ratio, "caps": caps}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
