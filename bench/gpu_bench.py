"""GPU measurements for bench/gpu.sh (CUDA only): per (dtype, bucket, batch) the eager and the
CUDA-graph (torch.compile reduce-overhead) forward+pooling time of a BERT-base-sized encoder with
random weights; then offline vs served throughput on a mixed corpus. Budget-aware: stops adding
shapes when its time is spent, and says so."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

import torch

from embedserve.pooling import pool

BUCKETS = (16, 64, 128, 256, 512)
BATCHES = (8, 32, 128)


def build(dtype):
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    torch.manual_seed(0)
    return BertModel(config).to("cuda", dtype).eval(), config


def timed(fn, ids, mask, reps=20) -> float:
    for _ in range(3):
        fn(ids, mask)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(ids, mask)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def kernels(budget_s: float) -> list[dict]:
    rows, start = [], time.monotonic()
    for dtype in (torch.float16, torch.bfloat16):
        model, config = build(dtype)

        def eager(ids, mask):
            with torch.inference_mode():
                return pool(model(input_ids=ids, attention_mask=mask).last_hidden_state, ids, mask, "mean", True)

        graphed = torch.compile(eager, mode="reduce-overhead", dynamic=False)
        for bucket in BUCKETS:
            for batch in BATCHES:
                if time.monotonic() - start > budget_s:
                    rows.append({"note": "time budget spent; remaining shapes skipped"})
                    return rows
                ids = torch.randint(1000, config.vocab_size, (batch, bucket), device="cuda")
                mask = torch.ones_like(ids)
                e, g = timed(eager, ids, mask), timed(graphed, ids, mask)
                rows.append({"dtype": str(dtype).removeprefix("torch."), "bucket": bucket, "batch": batch,
                             "eager_ms": e * 1000, "graph_ms": g * 1000, "speedup": e / g,
                             "graph_tokens_per_s": batch * bucket / g})
                print(rows[-1], flush=True)
    return rows


def offline_gpu(model_dir: str, texts: list[str]) -> dict:
    """The model alone on the GPU (fp16, eager), length-sorted batches, best of a sweep."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float16).to("cuda").eval()
    ordered = sorted(texts, key=len)
    sweep = {}
    for bs in (32, 128, 256):
        real, t0 = 0, time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(ordered), bs):
                enc = tok(ordered[i : i + bs], truncation=True, max_length=512, padding=True, return_tensors="pt").to("cuda")
                pool(model(**enc).last_hidden_state, enc["input_ids"], enc["attention_mask"], "mean", True)
                real += int(enc["attention_mask"].sum())
        torch.cuda.synchronize()
        sweep[bs] = real / (time.perf_counter() - t0)
    best = max(sweep, key=sweep.get)
    return {"sweep": sweep, "best_batch": best, "tokens_per_s": sweep[best]}


def served_vs_offline(model_dir: str) -> dict:
    from bench.corpus import corpus
    from bench.serve_vs_offline import served
    from tests.conftest import ServerProcess

    texts = corpus(4000, seed=1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    count = lambda t: len(tok(t, truncation=True, max_length=512)["input_ids"])  # noqa: E731
    server = ServerProcess({"MODEL_PATH": model_dir, "BATCH_CAPS": "", "MAX_DRAIN_TIME_MS": "600000",
                            "DTYPE": "float16"}).wait_ready(400)
    try:
        result = asyncio.run(served(texts, server.target, 256, count))
    finally:
        server.stop()
    limit = offline_gpu(model_dir, texts)
    return {"served": result, "offline": limit, "ratio": result["tokens_per_s"] / limit["tokens_per_s"],
            "log_caps": [line for line in server.log().splitlines() if "batch caps" in line]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    assert torch.cuda.is_available(), "bench/gpu.sh needs CUDA"
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kernels": kernels(240)}
    with tempfile.TemporaryDirectory() as d:  # a BERT-base checkpoint the server can load
        model, _ = build(torch.float32)
        model.save_pretrained(d)
        from transformers import AutoTokenizer

        from embedserve.model_source import packaged_model_dir

        AutoTokenizer.from_pretrained(str(packaged_model_dir())).save_pretrained(d)
        results["served"] = served_vs_offline(d)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write("| dtype | bucket | batch | eager ms | graph ms | speedup | graph tok/s |\n|---|---|---|---|---|---|---|\n")
        for r in results["kernels"]:
            if "dtype" in r:
                f.write(f"| {r['dtype']} | {r['bucket']} | {r['batch']} | {r['eager_ms']:.2f} | {r['graph_ms']:.2f} | "
                        f"{r['speedup']:.2f} | {r['graph_tokens_per_s']:.0f} |\n")
        sv = results["served"]
        f.write(f"\nserved {sv['served']['tokens_per_s']:.0f} tok/s vs offline {sv['offline']['tokens_per_s']:.0f} "
                f"tok/s: ratio {sv['ratio']:.2f}\n")


if __name__ == "__main__":
    main()
