"""`python -m bench`: the systems side by side in one run, on this machine, same model, same
request stream.

(a) offline limit: the model alone, length-sorted batches, best of a batch-size sweep
(b) naive: count-based dynamic batching in arrival order, padded to the longest row (bench/naive_server.py)
(c) embedfleet: `python -m embedserve`, default settings
(d) infinity-emb, when INFINITY_PYTHON names a Python with infinity_emb installed (else skipped)

Scenarios: saturation (closed loop, 48 callers for 15 s), 2x overload right after it (open-loop
Poisson), latency at 50% and 80% of each system's own saturation, and a lone short request on an
idle server. Throughput counts the calls that end between 3 s and 15 s into a scenario.
Prints one table and writes JSON (--json)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp  # the peer's HTTP client (installed with kopf, pinned in constraints.txt)
import numpy as np

from bench.corpus import corpus
from bench.loadgen import GrpcSystem, Outcome, closed_loop, open_loop, summarize, until_served
from bench.serve_vs_offline import model_max_length, offline
from tests.conftest import ServerProcess, free_port

SCENARIO_S = 15.0
SETTLE_S = 3.0  # throughput counts what completes after this much of a scenario (queues filled)
SHORT = "what is an embedding"


class HttpSystem(GrpcSystem):
    """An OpenAI-style POST /embeddings server (infinity-emb)."""

    async def __aenter__(self):
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc):
        await self.session.close()

    async def send(self, i: int, timeout_s: float = 60, refused: int = 0, wait: bool = True) -> Outcome:
        t0 = time.perf_counter()
        try:
            async with self.session.post(self.target, json={"model": "minilm", "input": [self.texts[i]]},
                                         timeout=timeout_s) as r:
                await r.read()
                code = "OK" if r.status == 200 else f"HTTP{r.status}"
        except asyncio.TimeoutError:
            code = "DEADLINE_EXCEEDED"
        except aiohttp.ClientError as e:  # a peer that drops connections under load: count it, go on
            code = type(e).__name__
        done_at = time.perf_counter()
        return Outcome(code, done_at - t0, self.tokens[i], done_at=done_at)


async def scenarios(system, n: int, rng, yardstick: Yardstick) -> dict:
    order = iter(rng.integers(0, n, size=10_000_000))
    send = lambda: system.send(int(next(order)))  # noqa: E731

    def send_until_served():
        return until_served(system, int(next(order)), rng)

    def steady(start: float) -> tuple[float, float]:
        return start + SETTLE_S, start + SCENARIO_S

    await closed_loop(send, 8, 16)  # warm
    start = time.perf_counter()
    outcomes, elapsed = await closed_loop(send_until_served, 48, duration_s=SCENARIO_S)
    sat = summarize(outcomes, elapsed, steady(start))
    out = {"saturation": sat}
    rate_rps = sat["ok_requests_per_s"]
    # 2x overload right after saturation: its goodput is compared with saturation's, and this
    # VM's speed drifts from one minute to the next.
    for label, factor in (("overload 2x", 2.0), ("load 50%", 0.5), ("load 80%", 0.8)):
        start = time.perf_counter()
        outcomes, elapsed = await open_loop(send, factor * rate_rps, SCENARIO_S, seed=int(factor * 10))
        out[label] = summarize(outcomes, elapsed, steady(start))
        await asyncio.sleep(2)  # let the backlog drain between scenarios
    short = system.texts.index(SHORT)
    lone, forward = [], []
    for _ in range(30):  # alternating: a served lone request, then the bare forward pass, each
        await asyncio.sleep(0.1)  # after a pause, so neither runs into the other's spinning threads
        lone.append((await system.send(short)).latency_s * 1000)
        await asyncio.sleep(0.1)
        forward.append(yardstick.once())
    out["idle ms"] = float(np.median(lone))
    out["idle forward ms"] = float(np.median(forward))
    return out


class Yardstick:
    """The model's own forward time for one text: the idle target's yardstick. A separate clean
    process (no gRPC threads, no load generator beside it) times one pass whenever asked, so the
    bench can alternate it with the served lone requests: both see the same minute of this
    shared machine."""

    SCRIPT = """
import sys, time, torch
from transformers import AutoModel, AutoTokenizer
from embedserve.model.source import packaged_model_dir
d = str(packaged_model_dir())
model, enc = AutoModel.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)([sys.argv[1]], return_tensors="pt")
with torch.inference_mode():
    for _ in range(5):
        model(**enc)
    print("ready", flush=True)
    for _ in sys.stdin:
        t0 = time.perf_counter(); model(**enc); print((time.perf_counter() - t0) * 1000, flush=True)
"""

    def __init__(self, text: str):
        self.proc = subprocess.Popen([sys.executable, "-c", self.SCRIPT, text], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def once(self) -> float:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()


def start_naive() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.naive_server", "--port", str(port)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, f"127.0.0.1:{port}"


def start_infinity(model_dir: str):
    python = os.environ.get("INFINITY_PYTHON")
    if not python:
        return None, None
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(python).parent / "infinity_emb"), "v2", "--model-id", model_dir, "--served-model-name", "minilm",
         "--engine", "torch", "--device", "cpu", "--port", str(port)],
        env={**os.environ, "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request

    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc, f"http://127.0.0.1:{port}/embeddings"
        except OSError:
            time.sleep(0.5)
    proc.kill()
    return None, None


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--texts", type=int, default=600)
    p.add_argument("--json")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from embedserve.model.source import packaged_model_dir

    model_dir = str(packaged_model_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = corpus(args.texts, seed=3) + [SHORT]
    tokens = [len(tok(t, truncation=True, max_length=model_max_length(model_dir))["input_ids"]) for t in texts]
    results: dict = {"machine": f"{os.cpu_count()} cores", "texts": len(texts), "real_tokens": sum(tokens)}
    print("(a) offline ...", flush=True)
    results["offline"] = offline(texts)
    yardstick = Yardstick(SHORT)
    systems = []
    naive, naive_target = start_naive()
    systems.append(("naive", lambda: GrpcSystem("naive", naive_target, texts, tokens), naive.kill))
    ours = ServerProcess({"BATCH_CAPS": ""}).wait_ready(600)
    systems.append(("embedfleet", lambda: GrpcSystem("embedfleet", ours.target, texts, tokens), ours.stop))
    inf, inf_url = start_infinity(model_dir)
    if inf:
        systems.append(("infinity", lambda: HttpSystem("infinity", inf_url, texts, tokens), inf.kill))
    else:
        results["infinity"] = "skipped (set INFINITY_PYTHON to a Python with infinity-emb installed)"
    for name, make, _ in systems:
        print(f"({name}) scenarios ...", flush=True)

        async def run():
            async with make() as system:
                return await scenarios(system, len(texts), np.random.default_rng(7), yardstick)

        results[name] = asyncio.run(run())
    yardstick.close()
    for _, _, stop in systems:
        stop()
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def report(r: dict) -> None:
    a = r["offline"]["tokens_per_s"]
    print(f"\n{'system':<12}{'sat tok/s':>10}{'vs (a)':>8}{'p99@50%':>9}{'p99@80%':>9}{'idle ms':>9}"
          f"{'2x goodput':>11}{'2x p99':>8}")
    print(f"{'(a) offline':<12}{a:>10.0f}{1.0:>8.2f}")
    for name in ("naive", "embedfleet", "infinity"):
        s = r.get(name)
        if not isinstance(s, dict):
            print(f"{name:<12} {s}")
            continue
        sat = s["saturation"]["ok_tokens_per_s"]
        print(f"{name:<12}{sat:>10.0f}{sat / a:>8.2f}{s['load 50%']['p99_ms']:>9.0f}{s['load 80%']['p99_ms']:>9.0f}"
              f"{s['idle ms']:>9.1f}{s['overload 2x']['ok_tokens_per_s'] / sat:>11.2f}{s['overload 2x']['p99_ms']:>8.0f}")
    ours = r["embedfleet"]
    print(f"\nembedfleet/offline {ours['saturation']['ok_tokens_per_s'] / a:.2f} (target >= 0.90); "
          f"embedfleet/naive {ours['saturation']['ok_tokens_per_s'] / r['naive']['saturation']['ok_tokens_per_s']:.2f} (target >= 3)")
    fw = ours["idle forward ms"]
    print(f"idle: {ours['idle ms']:.1f} ms vs forward {fw:.1f} ms, interleaved "
          f"(target <= 1.2 x forward + 2 ms = {1.2 * fw + 2:.1f})")
    print(f"2x overload goodput / saturation {ours['overload 2x']['ok_tokens_per_s'] / ours['saturation']['ok_tokens_per_s']:.2f} "
          f"(target >= 0.95); accepted p99 {ours['overload 2x']['p99_ms']:.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
