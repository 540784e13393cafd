"""GPU measurements for bench/gpu.sh, on a BERT-base-sized encoder with random weights (no hub):

1. kernels: per (dtype, bucket, batch) the server's own Encoder.run (host→device copy, forward,
   pooling, device→host copy) eager vs replaying a captured CUDA graph (COMPILE=graphs, the CUDA
   default), and the graphs' max deviation from eager on random-length rows;
2. served vs offline: `python -m embedserve` (defaults: graphs, static shapes, warm-up sweep)
   under closed-loop gRPC load from several client processes, against the model alone on the
   same corpus in length-sorted batches (best of a sweep), with and without tokenization;
3. inductor: COMPILE=true (torch.compile each shape, then graphs) on a few shapes: compile
   seconds and time per batch, beside (1)'s figures.

Each phase is time-boxed and its results are written as soon as it ends (results.json,
table.md), so a run cut short still reports. `--dry-run` exercises every phase on the CPU with a
tiny model (no graphs there): a check of this script, not a measurement."""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from embedserve.config import Settings
from embedserve.encoder import Encoder, choose_placement
from embedserve.worker import WarmupPlan, dummy_batch

BUCKETS = (16, 64, 128, 256, 512)
BATCHES = (8, 32, 128)
MAX_TOKENS = 32768  # the server's default MAX_TOKENS_PER_BATCH
INDUCTOR_SHAPES = ((8, 16), (32, 128), (64, 512))  # (rows, bucket)


def save_model(path: str, tokenizer_dir: str, dry: bool) -> None:
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    size = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128} if dry else {}
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tok), **size)).save_pretrained(path)
    tok.save_pretrained(path)


def encoder(model_dir: str, env: dict[str, str], cuda: bool) -> Encoder:
    settings = Settings.from_env(env)
    return Encoder(model_dir, settings, choose_placement(settings, cuda, cuda), [])


def time_run(enc: Encoder, batch, reps: int) -> float:
    enc.run(batch)
    enc.run(batch)
    t0 = time.perf_counter()
    for _ in range(reps):
        enc.run(batch)  # returns host numpy: synchronised
    return (time.perf_counter() - t0) / reps


def full_rows(bucket: int, rows: int, vocab: int, rng):
    """A batch of `rows` random rows, each `bucket` tokens long (the warm-up's own batches)."""
    return dummy_batch(bucket, rows, WarmupPlan((bucket,), rows, rows * bucket, True, None, 0, vocab), rng)


def random_rows(rows: int, bucket: int, vocab: int, rng):
    """A batch of `rows` rows of random lengths up to `bucket`, padded to the shape."""
    batch = full_rows(bucket, rows, vocab, rng)
    lengths = rng.integers(1, bucket + 1, rows)
    batch.attention_mask[:] = torch.from_numpy(np.arange(bucket)[None, :] < lengths[:, None]).long()
    batch.input_ids[batch.attention_mask == 0] = 0
    return batch


def kernels(model_dir: str, cuda: bool, budget_s: float, reps: int) -> list[dict]:
    rows, start, rng = [], time.monotonic(), np.random.default_rng(0)
    for dtype in ("bfloat16", "float16"):
        eager = encoder(model_dir, {"DTYPE": dtype, "COMPILE": "false"}, cuda)
        graphs = encoder(model_dir, {"DTYPE": dtype, "COMPILE": "graphs"}, cuda)
        vocab = eager.model.config.vocab_size
        for bucket in BUCKETS:
            for n in BATCHES:
                if n * bucket > MAX_TOKENS:
                    continue
                if time.monotonic() - start > budget_s:
                    return rows + [{"note": f"kernels: {budget_s:.0f} s budget spent; remaining shapes skipped"}]
                check = random_rows(n, bucket, vocab, rng)
                deviation = float(np.abs(graphs.run(check) - eager.run(check)).max())
                full = full_rows(bucket, n, vocab, rng)
                e, g = time_run(eager, full, reps), time_run(graphs, full, reps)
                rows.append({"dtype": dtype, "bucket": bucket, "batch": n, "eager_ms": e * 1e3, "graph_ms": g * 1e3,
                             "speedup": e / g, "graph_tokens_per_s": n * bucket / g, "max_abs_dev": deviation})
                print("kernels", rows[-1], flush=True)
        del eager, graphs
        if cuda:
            torch.cuda.empty_cache()
    return rows


def inductor(model_dir: str, cuda: bool, budget_s: float, reps: int) -> list[dict]:
    rows, start, rng = [], time.monotonic(), np.random.default_rng(1)
    enc = encoder(model_dir, {"DTYPE": "bfloat16", "COMPILE": "true"}, cuda)
    vocab = enc.model.config.vocab_size
    for n, bucket in INDUCTOR_SHAPES:
        if time.monotonic() - start > budget_s:
            return rows + [{"note": f"inductor: {budget_s:.0f} s budget spent; remaining shapes skipped"}]
        batch = full_rows(bucket, n, vocab, rng)
        t0 = time.perf_counter()
        enc.run(batch)  # compiles, then captures
        rows.append({"bucket": bucket, "batch": n, "compile_s": time.perf_counter() - t0,
                     "ms": time_run(enc, batch, reps) * 1e3})
        print("inductor", rows[-1], flush=True)
    return rows


def offline(model_dir: str, texts: list[str], dtype: str, device: str) -> dict:
    """The model alone: length-sorted batches, eager; tokens/s with the tokenizer in the loop and
    on pre-tokenized batches (the model's own limit)."""
    from transformers import AutoModel, AutoTokenizer

    from embedserve.pooling import pool

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ordered = sorted(texts, key=len)

    def encode(chunk):
        return tok(chunk, truncation=True, max_length=512, padding=True, return_tensors="pt")

    def forward(enc):
        enc = enc.to(device)
        torch.nn.functional.normalize(pool(model(**enc).last_hidden_state, enc["input_ids"], enc["attention_mask"], "mean"), dim=-1).cpu()
        return int(enc["attention_mask"].sum())

    def rate(batches) -> float:
        t0 = time.perf_counter()
        real = sum(forward(b if not isinstance(b, list) else encode(b)) for b in batches)
        return real / (time.perf_counter() - t0)

    sweep = {}
    with torch.inference_mode():
        for bs in (128, 256, 512):  # the model alone, on pre-tokenized batches
            chunks = [ordered[i : i + bs] for i in range(0, len(ordered), bs)]
            encoded = [encode(c) for c in chunks]
            rate(encoded)  # warm-up: every shape once, so the allocator has grown before timing
            sweep[bs] = rate(encoded)
            print("offline model-only, batch", bs, round(sweep[bs]), flush=True)
        best = max(sweep, key=sweep.get)
        with_tok = rate([ordered[i : i + best] for i in range(0, len(ordered), best)])
    return {"sweep": sweep, "best_batch": best, "model_only": sweep[best], "with_tokenizer": with_tok}


def _client(args) -> dict:
    """One load-generating process: closed loop over its texts, `concurrency` requests in
    flight, until the texts or `duration_s` run out; counts the real tokens it got back."""
    import asyncio

    from embedserve.client import Client

    target, texts, counts, per_request, concurrency, start_at, duration_s = args
    requests = [(texts[i : i + per_request], sum(counts[i : i + per_request])) for i in range(0, len(texts), per_request)]
    requests.reverse()
    done = {"texts": 0, "tokens": 0, "latencies": []}

    async def loop(client, stop_at):
        while requests and time.time() < stop_at:
            batch, tokens = requests.pop()
            t0 = time.perf_counter()
            await client.embed(batch)
            done["latencies"].append(time.perf_counter() - t0)
            done["texts"] += len(batch)
            done["tokens"] += tokens

    async def run():
        async with Client(target, max_attempts=50, timeout_s=120) as client:
            await client.embed(texts[:per_request])
            await asyncio.sleep(max(0.0, start_at - time.time()))  # all clients start together
            t0 = time.time()
            await asyncio.gather(*(loop(client, t0 + duration_s) for _ in range(concurrency)))
            return {"t0": t0, "t1": time.time(), **done}

    return asyncio.run(run())


def served(model_dir: str, texts: list[str], counts: list[int], env: dict, processes: int, per_request: int,
           concurrency: int, duration_s: float) -> dict:
    from tests.conftest import ServerProcess

    t0 = time.monotonic()
    server = ServerProcess({"MODEL_PATH": model_dir, "BATCH_CAPS": "", "MAX_DRAIN_TIME_MS": "600000", **env})
    try:
        try:
            server.wait_ready(300)
        except Exception:
            print(server.log()[-4000:], flush=True)
            raise
        ready_s = time.monotonic() - t0
        start_at = time.time() + 8
        jobs = [(server.target, texts[i::processes], counts[i::processes], per_request, concurrency, start_at, duration_s)
                for i in range(processes)]
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            parts = pool.map(_client, jobs)
        import urllib.request

        metrics = [line for line in urllib.request.urlopen(server.http + "/metrics").read().decode().splitlines()
                   if line.startswith("embedfleet_") and "_bucket{" not in line]
    finally:
        server.stop()
    elapsed = max(p["t1"] for p in parts) - min(p["t0"] for p in parts)
    lat = np.array([x for p in parts for x in p["latencies"]]) * 1e3
    caps = [line.split("batch caps per bucket: ")[1] for line in server.log().splitlines() if "batch caps per bucket" in line]
    return {"tokens_per_s": sum(p["tokens"] for p in parts) / elapsed, "texts_per_s": sum(p["texts"] for p in parts) / elapsed,
            "seconds": elapsed, "ready_s": ready_s, "processes": processes, "texts_per_request": per_request,
            "concurrency_per_process": concurrency, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "caps": caps[:1], "metrics": metrics, "server_log_tail": server.log()[-2500:]}


def write(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2))
    lines = ["| dtype | bucket | batch | eager ms | graph ms | speedup | graph tok/s | max |Δ| |", "|---|---|---|---|---|---|---|---|"]
    for r in results.get("kernels", []):
        lines.append(f"| {r['dtype']} | {r['bucket']} | {r['batch']} | {r['eager_ms']:.2f} | {r['graph_ms']:.2f} | "
                     f"{r['speedup']:.2f} | {r['graph_tokens_per_s']:.0f} | {r['max_abs_dev']:.1e} |" if "dtype" in r else r["note"])
    for r in results.get("inductor", []):
        lines.append(f"inductor bf16 bucket {r['bucket']} batch {r['batch']}: compile {r['compile_s']:.1f} s, "
                     f"{r['ms']:.2f} ms" if "ms" in r else r["note"])
    for name, sv in results.get("served", {}).items():
        off = results.get("offline", {})
        if "tokens_per_s" in sv and off:
            lines.append(f"served [{name}] {sv['tokens_per_s']:.0f} tok/s (ready in {sv['ready_s']:.0f} s; p50 {sv['p50_ms']:.0f} "
                         f"ms, p99 {sv['p99_ms']:.0f} ms) vs offline {off['model_only']:.0f} model-only "
                         f"({sv['tokens_per_s'] / off['model_only']:.2f}), {off['with_tokenizer']:.0f} with tokenizer "
                         f"({sv['tokens_per_s'] / off['with_tokenizer']:.2f})")
        else:
            lines.append(f"served [{name}]: {sv}")
    (out / "table.md").write_text("\n".join(lines) + "\n")


def served_phases(results: dict, model_dir: str, cuda: bool, save) -> None:
    """The offline limit, then the server under two request shapes, on one seeded corpus."""
    from transformers import AutoTokenizer

    from bench.corpus import corpus

    texts = corpus(60000 if cuda else 300, seed=1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    counts = [len(ids) for ids in tok(texts, truncation=True, max_length=512)["input_ids"]]
    results["corpus"] = {"texts": len(texts), "real_tokens": sum(counts)}
    dtype, device = ("bfloat16", "cuda") if cuda else ("float32", "cpu")
    phase(results, "offline", lambda: offline(model_dir, texts, dtype, device), save)
    procs = min(6, max(2, (os.cpu_count() or 2) // 3))
    results["served"] = {}
    # (name, texts per request, requests in flight per client process, server settings)
    for name, per_request, conc, env in (
        ("32 texts/request", 32, 16, {}),
        ("1 text/request", 1, 128, {}),
        ("1 text/request, 2 tokenizer threads", 1, 128, {"TOKENIZATION_WORKERS": "2"}),
    ):
        # The corpus three times over: the clients stop at the deadline, in steady state.
        run = functools.partial(served, model_dir, texts * 3, counts * 3, {"DTYPE": dtype, **env}, procs,
                                per_request, conc, 10 if cuda else 4)
        phase(results["served"], name, run, save)

def phase(store: dict, name: str, fn, save) -> None:
    t0 = time.monotonic()
    try:
        store[name] = fn()
    except Exception as e:  # noqa: BLE001 - one phase failing must not lose the others' figures
        store[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"phase {name} failed:", repr(e), flush=True)
    print(f"phase {name}: {time.monotonic() - t0:.0f} s", flush=True)
    save()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", required=True, help="a tokenizer directory (BERT vocabulary)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, small corpus: checks this script")
    p.add_argument("--phases", default="kernels,served,inductor", help="which of kernels, served, inductor to run")
    a = p.parse_args()
    cuda = not a.dry_run
    assert not cuda or torch.cuda.is_available(), "bench/gpu.sh needs CUDA"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "torch": torch.__version__}
    reps = 20 if cuda else 2

    def save():
        write(out, results)

    with tempfile.TemporaryDirectory() as model_dir:
        save_model(model_dir, a.tokenizer, a.dry_run)
        wanted = a.phases.split(",")
        if "kernels" in wanted:
            phase(results, "kernels", lambda: kernels(model_dir, cuda, 60 if cuda else 20, reps), save)
        if "served" in wanted:
            served_phases(results, model_dir, cuda, save)
        if "inductor" in wanted:
            phase(results, "inductor", lambda: inductor(model_dir, cuda, 60 if cuda else 30, reps), save)
    print((out / "table.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
