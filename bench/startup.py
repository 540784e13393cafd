"""`python -m bench.startup`: how long a server takes from process start to Ready (/health 200),
cold (an empty MODEL_CACHE_DIR: the warm-up sweep runs) against warm (the warm-up file a cold
start just wrote: reused, no sweep), alternated, for FRONTENDS=1 and 2; and from zero: a warm
start's process start to the answer of the first request, sent as a scale-to-zero request waits
(KEDA's HTTP add-on holds it until the pod is Ready, then forwards it: autoscaling.md). Prints
each run, the medians and warm / cold; --json writes them. The packaged model on the CPU by default; bench/gpu.sh
runs it with --device cuda and its own model directory.

The clock starts just before the process is spawned and stops at the first /health 200 on the
metrics port (polled every 20 ms): what a readiness probe sees, less the kubelet's period."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from tests.conftest import ServerProcess, post_json

POLL_S = 0.02


def start_once(env: dict[str, str], timeout_s: float, first_answer: bool = False) -> tuple[float, str]:
    """One start: → (seconds to /health 200, /health's `warmup`); `first_answer`: to the answer
    of one /embed sent once Ready, as the add-on's interceptor forwards a held request."""
    t0 = time.perf_counter()
    server = ServerProcess(env)
    try:
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-3000:]}")
            try:
                status, health = server.health()
            except OSError:
                status, health = 0, {}
            if status == 200:
                if first_answer:
                    answered, _ = post_json(server.http + "/embed", {"inputs": "the first request after a scale to zero"})
                    if answered != 200:
                        raise RuntimeError(f"the first request was answered {answered}")
                return time.perf_counter() - t0, health.get("warmup", "")
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"not ready in {timeout_s} s:\n{server.log()[-3000:]}")
            time.sleep(POLL_S)
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)


def summarize(cold: list[float], warm: list[float]) -> dict:
    c, w = statistics.median(cold), statistics.median(warm)
    return {"cold_s": cold, "warm_s": warm, "cold_median_s": c, "warm_median_s": w, "warm_over_cold": w / c}


def run(frontends: int, runs: int, base_env: dict[str, str], timeout_s: float) -> dict:
    """`runs` cold starts, each followed by a warm one on the file it wrote (alternated: a drift
    of the host's load touches both alike)."""
    cold, warm, zero, states = [], [], [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="startup-cache-") as cache:
            env = {**base_env, "FRONTENDS": str(frontends), "MODEL_CACHE_DIR": cache}
            for times, expected in ((cold, "measured"), (warm, "reused"), (zero, "reused")):
                seconds, state = start_once(env, timeout_s, first_answer=times is zero)
                times.append(seconds)
                states.append(state)
                if state != expected:
                    raise RuntimeError(f"a {'cold' if expected == 'measured' else 'warm'} start reported "
                                       f"warmup={state!r}, expected {expected!r}")
            if not any(Path(cache, "embedfleet-warmup").glob("*.json")):
                raise RuntimeError("the cold start wrote no warm-up file")
    return {"frontends": frontends, **summarize(cold, warm), "zero_s": zero, "zero_median_s": statistics.median(zero)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="cold/warm pairs per mode")
    p.add_argument("--frontends", default="1,2", help="the FRONTENDS values to measure")
    p.add_argument("--device", default="cpu", help="DEVICE (cuda on a GPU)")
    p.add_argument("--model", default="", help="MODEL_PATH (default: the packaged model)")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for every server (repeatable)")
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    env = {"WARM_START": "true", "BATCH_CAPS": "", "DEVICE": a.device}  # the default: caps measured
    if a.model:
        env["MODEL_PATH"] = a.model
    env.update(kv.split("=", 1) for kv in a.env)
    results = []
    print(f"process start → /health 200, cold (empty MODEL_CACHE_DIR) vs warm (its warm-up file), {a.runs} each")
    print(f"{'FRONTENDS':>9}  {'cold median':>11}  {'warm median':>11}  {'warm/cold':>9}  {'from zero':>9}  "
          "runs (cold | warm | first answer from zero, s)")
    for n in (int(x) for x in a.frontends.split(",")):
        r = run(n, a.runs, env, a.timeout_s)
        results.append(r)
        runs = " | ".join(" ".join(f"{x:.2f}" for x in r[k]) for k in ("cold_s", "warm_s", "zero_s"))
        print(f"{n:>9}  {r['cold_median_s']:>10.2f}s  {r['warm_median_s']:>10.2f}s  {r['warm_over_cold']:>9.2f}  "
              f"{r['zero_median_s']:>8.2f}s  {runs}", flush=True)
    out = {"device": a.device, "model": a.model or "packaged", "runs": a.runs, "results": results}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
