"""`python -m bench.shared_device`: four models on one device against four devices, side by side in
one run (issue 37, items 4 and 11). A retrieval stack's models are small and their users live in
different time zones: each model alone needs most of a device at its peak and little the rest of
the day, so four dedicated pods pay four devices for what one could serve. The question is
whether one shared pod, whose device runs the batch closest to its drain budget first and whose
admission counts every model's queued device time, keeps each model's latency within its budget.

On the simulated device (four real CPU pods do not fit two cores) of speed R tokens/s:
(a) one shared pod, MODELS with four `sim:R` models; (b) four dedicated one-model pods of speed
R (MODEL_PATH, today's pod). The same open-loop trace (`trace`, below: four language embedders
peaking a quarter period apart) is replayed against each over real gRPC, single 128-token texts
addressed by the request's `model` field. Per model: P99 of accepted requests, goodput (accepted
tokens/s) and refusals, busy seconds (`embedfleet_model_busy_seconds_total`), and the
device-seconds paid: 1 x duration for (a), 4 x duration for (b).

Then the isolation case on the shared pod: every model at its usual rate (its trace mean), and
the same with the first model flooded at 10x: every other model's accepted P99 must stay within
MAX_DRAIN_TIME_MS plus one batch (the batch in progress when its row arrives), flood or not.
Goal: the shared pod serves the whole trace at each model's P99 within its budget (plus one
batch) with a quarter of the devices. `--model DIR --no-dedicated --device cuda` measures the
shared pod alone on a real device (bench/gpu.sh's phase `shared`).
Usage: python -m bench.shared_device [--period 40] [--isolation 10] [--rate 20000] [--json out.json]"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
from typing import Callable

import grpc
import numpy as np

from bench.loadgen import Outcome, call
from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, counter

NAMES = ("en", "de", "hi", "ja")  # four embedders whose users' days are a quarter period apart
PEAK, FLOOR = 0.60, 0.03  # a model's share of one device at its peak and at night
TARGET_UTILIZATION = 0.7  # the autoscaler's default: what one device is sized to carry
WORDS = "the of and to in is for on with as by at from that this it be are was not or an he she we".split()
TEXT_TOKENS = 128  # 126 one-token words, [CLS] and [SEP]: every row fills the 128 bucket exactly
CAPS = "16:64,32:64,64:32,128:16,256:8,512:4"  # at most 2,048 tokens a batch: one batch ~0.1 s at R 20,000
FLOOD = 10.0
USUAL = (3 * FLOOR + PEAK) / 4  # each model's trace mean (a quarter of the flat sum): its usual rate


def share(i: int, t: float, period: float) -> float:
    """Model i's offered load at t, as a fraction of one device: FLOOR, plus a raised-cosine day
    (cos^2, half-width a quarter period) centred on (i + 0.5) quarter periods, cyclic. Adjacent
    days overlap by half, where cos^2 + sin^2 = 1: the four models' sum is 4 FLOOR + PEAK - FLOOR
    (0.69) at every t, under TARGET_UTILIZATION, while each peak alone is 0.6 of a device (0.86
    of one at the target): a fleet sized per model needs four devices, one sized on the sum one."""
    quarter = period / 4
    d = (t - (i + 0.5) * quarter + period / 2) % period - period / 2  # cyclic distance from the peak
    return FLOOR + (PEAK - FLOOR) * (math.cos(math.pi * d / (2 * quarter)) ** 2 if abs(d) < quarter else 0.0)


def trace(period: float) -> dict[str, Callable[[float], float]]:
    """Each model's share of a device over one period (the committed trace)."""
    return {name: (lambda t, i=i: share(i, t, period)) for i, name in enumerate(NAMES)}


def arrivals(shares: dict[str, Callable[[float], float]], device_rps: float, duration: float, seed: int,
             scale: dict[str, float] | None = None) -> list[tuple[float, str]]:
    """Poisson arrivals of every model, merged in time order: in each 10 ms step a Poisson count at
    the model's share x `device_rps` (requests/s one device serves) x its `scale`, placed
    uniformly within the step."""
    rng, step, out = np.random.default_rng(seed), 0.01, []
    for name, f in shares.items():
        k = (scale or {}).get(name, 1.0)
        for t0 in np.arange(0.0, duration, step):
            n = rng.poisson(f(t0 + step / 2) * device_rps * k * step)
            out.extend((float(t), name) for t in t0 + rng.uniform(0, step, n))
    return sorted(out)


def texts(n: int, count: int, seed: int = 0) -> list[list[str]]:
    """`count` requests of `n` texts, each TEXT_TOKENS tokens."""
    rng = np.random.default_rng(seed)
    return [[" ".join(rng.choice(WORDS, TEXT_TOKENS - 2)) for _ in range(n)] for _ in range(count)]


async def replay(schedule: list[tuple[float, str]], stubs: dict, bodies: list[list[str]]) -> dict[str, list[Outcome]]:
    """Sends each (t, model) at t, open loop (no retries: a refusal is counted as one)."""
    tasks: dict[str, list] = {n: [] for n in stubs}
    start = time.perf_counter()
    for k, (t, name) in enumerate(schedule):
        if (delay := start + t - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        body = bodies[k % len(bodies)]
        request = pb.EmbedRequest(texts=body, model=name)
        tasks[name].append(asyncio.ensure_future(call(stubs[name].Embed, request, TEXT_TOKENS * len(body), 30)))
    return {n: list(await asyncio.gather(*ts)) for n, ts in tasks.items()}


def figures(outcomes: list[Outcome], duration: float, busy_s: float) -> dict:
    ok = [o for o in outcomes if o.code == "OK"]
    lat = np.array([o.latency_s * 1000 for o in ok]) if ok else np.zeros(1)
    inside = np.array([o.server_ms for o in ok if o.server_ms is not None] or [0.0])
    return {"sent": len(outcomes), "ok": len(ok), "refused": sum(o.code == "RESOURCE_EXHAUSTED" for o in outcomes),
            "failed": sum(o.code not in ("OK", "RESOURCE_EXHAUSTED") for o in outcomes),
            "offered_tok_s": sum(o.tokens for o in outcomes) / duration, "ok_tok_s": sum(o.tokens for o in ok) / duration,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "server_p99_ms": float(np.percentile(inside, 99)), "busy_s": busy_s}


class Arm:
    """Pods and, per model, the pod that serves it: one shared pod, or one pod per model."""

    def __init__(self, name: str, pods: dict[str, ServerProcess]):
        self.name, self.pods = name, pods

    def busy(self) -> dict[str, float]:
        return {n: counter(p.metrics, "embedfleet_model_busy_seconds_total", model=n) for n, p in self.pods.items()}

    def quiet(self) -> bool:
        """Nothing queued, no model reading its load as sustained overload: a run starts afresh."""
        for p in set(self.pods.values()):
            h = p.health()[1]
            if any(m.get("queued_tokens") or m.get("sustained_overload") for m in h.get("models", [h])):
                return False
        return True

    async def run(self, drive, duration: float, bodies) -> dict[str, dict]:
        """Each model's figures over `drive(stubs)` (→ outcomes by model), once the pods have
        settled and every model has answered a few warm-up requests."""
        for _ in range(300):
            if await asyncio.to_thread(self.quiet):
                break
            await asyncio.sleep(0.1)
        else:
            raise TimeoutError(f"{self.name}: the pods did not settle within 30 s")
        channels = {p: grpc.aio.insecure_channel(p.target) for p in set(self.pods.values())}
        stubs = {n: pb_grpc.InferenceStub(channels[p]) for n, p in self.pods.items()}
        try:
            for n in self.pods:  # connected, and the server has seen the texts (characters per token)
                await asyncio.gather(*(call(stubs[n].Embed, pb.EmbedRequest(texts=b, model=n), 0, 30) for b in bodies[:4]))
            busy0 = await asyncio.to_thread(self.busy)
            outcomes = await drive(stubs)
            busy1 = await asyncio.to_thread(self.busy)
        finally:
            for c in channels.values():
                await c.close()
        return {n: figures(outcomes[n], duration, busy1[n] - busy0[n]) for n in self.pods}


async def saturate(stubs: dict, bodies: list[list[str]], seconds: float, callers: int = 8) -> dict[str, list[Outcome]]:
    """`callers` closed-loop callers per model for `seconds` (a refused one waits its retry-after)."""
    out: dict[str, list[Outcome]] = {n: [] for n in stubs}
    stop = time.perf_counter() + seconds

    async def caller(name: str, k: int) -> None:
        while time.perf_counter() < stop:
            body = bodies[(k := k + 1) % len(bodies)]
            o = await call(stubs[name].Embed, pb.EmbedRequest(texts=body, model=name), TEXT_TOKENS * len(body), 30)
            out[name].append(o)
            if o.code == "RESOURCE_EXHAUSTED":
                await asyncio.sleep((o.retry_after_ms or 10) / 1000)

    await asyncio.gather(*(caller(n, k) for n in stubs for k in range(callers)))
    return out


def start(args, pods: list[ServerProcess]) -> tuple[Arm, Arm | None]:
    """The pods, each appended to `pods` as it is spawned (the caller stops them, whatever happens)."""
    base = {"BATCH_CAPS": args.caps, "MAX_DRAIN_TIME_MS": str(args.budget_ms), "LOG_LEVEL": "WARNING",
            **({"DEVICE": args.device} if args.device else {})}
    sim = args.model.startswith("sim:")
    models = [{"name": n, "model": args.model} for n in NAMES]
    pods.append(shared := ServerProcess({**base, "MODELS": json.dumps(models),
                                         **({"DEVICE_MEMORY_BYTES": str(8 * 2**30)} if sim else {})}))
    dedicated = {}
    for n in NAMES if args.dedicated else ():
        pods.append(dedicated.setdefault(n, ServerProcess({**base, "MODEL_PATH": args.model, "SERVED_MODEL_NAME": n})))
    for p in pods:
        p.wait_ready(args.timeout_s)
    return Arm("shared", {n: shared for n in NAMES}), Arm("dedicated", dedicated) if dedicated else None


def print_table(title: str, rows: list[tuple[str, str, dict]], bound_ms: float) -> None:
    print(f"\n{title}")
    print(f"{'model':<6}{'run':<11}{'sent':>6}{'ok':>6}{'refused':>8}{'offered tok/s':>14}{'ok tok/s':>9}"
          f"{'p50 ms':>8}{'p99 ms':>8}{'server p99':>11}{'p99/bound':>10}{'busy s':>8}")
    for name, label, f in rows:
        print(f"{name:<6}{label:<11}{f['sent']:>6}{f['ok']:>6}{f['refused']:>8}{f['offered_tok_s']:>14,.0f}"
              f"{f['ok_tok_s']:>9,.0f}{f['p50_ms']:>8.0f}{f['p99_ms']:>8.0f}{f['server_p99_ms']:>11.0f}"
              f"{f['p99_ms'] / bound_ms:>10.2f}{f['busy_s']:>8.1f}")


async def bench(args, shared: Arm, dedicated: Arm | None) -> dict:
    bodies = texts(args.texts, 64)
    # One device's tokens per busy second, from the shared pod at saturation: the trace is in
    # shares of it (a warm-up's figure in /health can be far off on a real model).
    calibration = await shared.run(lambda stubs: saturate(stubs, bodies, args.calibrate), args.calibrate, bodies)
    rate = sum(f["ok_tok_s"] for f in calibration.values()) * args.calibrate / sum(f["busy_s"] for f in calibration.values())
    device_rps = rate / (TEXT_TOKENS * args.texts)
    cap = int(dict(c.split(":") for c in args.caps.split(","))[str(TEXT_TOKENS)])  # rows of its bucket's batch
    batch_ms = 1000 * cap * TEXT_TOKENS / rate  # the longest batch the device runs of these rows
    bound_ms = args.budget_ms + batch_ms
    print(f"one device: {rate:,.0f} tok/s ({device_rps:,.0f} requests of {args.texts} x {TEXT_TOKENS} tokens/s); "
          f"budget {args.budget_ms} ms + one batch {batch_ms:.0f} ms = bound {bound_ms:.0f} ms", flush=True)
    out = {"device_tok_s": rate, "budget_ms": args.budget_ms, "batch_ms": batch_ms, "bound_ms": bound_ms, "trace": {}}
    schedule = arrivals(trace(args.period), device_rps, args.period, seed=1)
    for arm in (a for a in (shared, dedicated) if a):
        out["trace"][arm.name] = r = await arm.run(lambda stubs: replay(schedule, stubs, bodies), args.period, bodies)
        print(f"  {arm.name}: {sum(f['ok'] for f in r.values())} ok", flush=True)
    out["summary"] = report_trace(out["trace"], args.period, bound_ms)
    base = {n: (lambda t: USUAL) for n in NAMES}
    out["isolation"] = runs = {}
    for label, scale in (("usual", {}), ("flood", {NAMES[0]: FLOOD})):
        schedule = arrivals(base, device_rps, args.isolation, seed=2, scale=scale)
        runs[label] = await shared.run(lambda stubs: replay(schedule, stubs, bodies), args.isolation, bodies)
    print_table(f"isolation, shared pod: every model at its trace mean ({USUAL:.3f} of a device), then "
                f"{NAMES[0]} at {FLOOD:.0f}x, {args.isolation:.0f} s each",
                [(n, label, runs[label][n]) for n in NAMES for label in runs], bound_ms)
    report_isolation(runs, bound_ms)
    return out


def report_trace(arms: dict[str, dict[str, dict]], period: float, bound_ms: float) -> dict:
    """The trace's table, model by model, and each arm's totals: device-seconds paid (1 device for
    the shared pod, one per model for the dedicated ones), busy seconds, goodput, worst P99."""
    print_table(f"trace: {len(NAMES)} models x {period:.0f} s, each peaking at {PEAK:.2f} of a device a quarter "
                f"period apart, their sum {4 * FLOOR + PEAK - FLOOR:.2f}",
                [(n, arm, r[n]) for n in NAMES for arm, r in arms.items()], bound_ms)
    summary = {}
    for arm, r in arms.items():
        devices = 1 if arm == "shared" else len(NAMES)
        summary[arm] = s = {"device_s": devices * period, "busy_s": sum(f["busy_s"] for f in r.values()),
                            "ok_tok_s": sum(f["ok_tok_s"] for f in r.values()),
                            "refused": sum(f["refused"] + f["failed"] for f in r.values()),
                            "worst_p99_over_bound": max(f["p99_ms"] for f in r.values()) / bound_ms}
        print(f"{arm:<10} device-seconds paid {s['device_s']:6.0f} ({devices} x {period:.0f} s), busy {s['busy_s']:6.1f} s "
              f"(utilization {s['busy_s'] / s['device_s']:.2f}), goodput {s['ok_tok_s']:,.0f} tok/s, refused/failed "
              f"{s['refused']}, worst P99 / bound {s['worst_p99_over_bound']:.2f}")
    if "dedicated" in summary:
        sh, de = summary["shared"], summary["dedicated"]
        print(f"shared / dedicated: device-seconds {sh['device_s'] / de['device_s']:.2f}, goodput "
              f"{sh['ok_tok_s'] / de['ok_tok_s']:.2f}, busy seconds {sh['busy_s'] / max(de['busy_s'], 1e-9):.2f}")
    met = all(f["p99_ms"] <= bound_ms and f["ok"] == f["sent"] for f in arms["shared"].values())
    print(f"goal: the shared pod serves every request, each model's P99 within budget + one batch, on a quarter "
          f"of the devices: {'met' if met else 'missed'}")
    return summary


def report_isolation(runs: dict[str, dict[str, dict]], bound_ms: float) -> None:
    """The models not flooded, with and without the flood: worst P99 (client and server) against
    the bound, and the share of their requests refused (the flood's cost to them in goodput)."""
    def worst(label: str, key: str) -> float:
        return max(runs[label][n][key] for n in NAMES[1:])

    def refused(label: str) -> float:
        return sum(runs[label][n]["refused"] for n in NAMES[1:]) / max(sum(runs[label][n]["sent"] for n in NAMES[1:]), 1)

    print(f"the others, flood / usual: worst P99 {worst('flood', 'p99_ms'):.0f} / {worst('usual', 'p99_ms'):.0f} ms "
          f"(server {worst('flood', 'server_p99_ms'):.0f} / {worst('usual', 'server_p99_ms'):.0f} ms) against the "
          f"bound {bound_ms:.0f} ms: {'within' if worst('flood', 'p99_ms') <= bound_ms else 'past it'}; refused "
          f"{refused('flood'):.0%} / {refused('usual'):.0%} of their requests")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--period", type=float, default=40.0, help="seconds of the trace (one 'day')")
    p.add_argument("--isolation", type=float, default=10.0, help="seconds of each isolation run")
    p.add_argument("--calibrate", type=float, default=3.0, help="seconds of saturation measuring one device")
    p.add_argument("--rate", type=float, default=20000.0, help="the simulated device's tokens/s (R)")
    p.add_argument("--model", default="", help="every model's source (default: sim:RATE@1GiB); a directory on a GPU")
    p.add_argument("--texts", type=int, default=1, help="texts per request (more on a fast device)")
    p.add_argument("--caps", default=CAPS, help="BATCH_CAPS of every pod (its 128 bucket's cap: one batch)")
    p.add_argument("--budget-ms", type=int, default=500, help="MAX_DRAIN_TIME_MS of every pod")
    p.add_argument("--no-dedicated", dest="dedicated", action="store_false",
                   help="the shared pod alone (one real device cannot host four dedicated pods)")
    p.add_argument("--device", default="", help="DEVICE of the pods (cuda on a GPU)")
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    args.model = args.model or f"sim:{args.rate:g}@1GiB"
    # `timeout`'s TERM (bench/gpu.sh) ends the run through the `finally` below: no pod outlives it.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    pods: list[ServerProcess] = []
    try:
        out = asyncio.run(bench(args, *start(args, pods)))
    finally:
        for p in pods:
            p.stop()
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
