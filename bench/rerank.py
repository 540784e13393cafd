"""`python -m bench.rerank`: rerank pairs/s served vs offline, side by side in one run on this machine.

(a) offline: the cross-encoder alone in this process on every (query, document) pair, the pairs
    length-sorted, tokenized as pairs (token types; `longest_first` truncation, as CrossEncoder
    does) in the loop, its default activation (sigmoid for one label) applied; best of a
    batch-size sweep, as the embedding bench's offline limit (bench/serve_vs_offline.py);
(b) served: the same pairs as gRPC Rerank requests (a query and its documents each), closed loop
    at concurrency C, against a real `python -m embedserve` serving the same model directory.
Prints pairs/s (and real tokens/s) of both, the ratio, and the served scores' max |Δ| from (a).

The model: --model DIR, else a cross-encoder the bench builds in a temporary directory:
`--build minilm` (default) the packaged all-MiniLM-L6-v2 weights under a one-label
BertForSequenceClassification head (the head is random: fine for throughput, and a cross-encoder
by TEI's rule); `--build bert-base` or `tiny` from a config with the vocabulary of --tokenizer
(bench/gpu.sh, where the package is not carried). Until the server serves Rerank (issue 28),
(b) reports UNIMPLEMENTED and the run still prints (a). Usage:
    python -m bench.rerank [--queries 40] [--docs 20] [--concurrency 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.corpus import corpus  # noqa: E402

CPU_SIZES, CUDA_SIZES = (1, 4, 8, 16, 32), (16, 32, 64, 128, 256)
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}


class Unimplemented(Exception):
    """The server answers UNIMPLEMENTED for Rerank: it does not serve it (yet)."""


def build_model(path: str, build: str = "minilm", tokenizer_dir: str | None = None) -> str:
    """A one-label cross-encoder saved with its tokenizer at `path` (→ `path`)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from embedserve.model.source import packaged_model_dir

    torch.manual_seed(0)  # the random head (and the random weights of a built model) repeat
    if build == "minilm":
        source = str(packaged_model_dir())
        model = BertForSequenceClassification.from_pretrained(source, num_labels=1)
        tok = AutoTokenizer.from_pretrained(tokenizer_dir or source)
    else:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir or str(packaged_model_dir()))
        model = BertForSequenceClassification(BertConfig(vocab_size=len(tok), num_labels=1,
                                                         **(TINY if build == "tiny" else {})))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def requests(queries: int, docs: int, seed: int = 5) -> list[tuple[str, list[str]]]:
    """Rerank calls as a retrieval stack makes them: a short query and the `docs` passages its
    vector search found (the corpus's mixed lengths: titles, passages, a long tail)."""
    short = [t for t in corpus(queries * 8, seed=seed) if len(t.split()) <= 10][:queries]
    texts = corpus(queries * docs, seed=seed + 1)
    return [(q, texts[i * docs:(i + 1) * docs]) for i, q in enumerate(short)]


def max_length(model_dir: str) -> int:
    """The pairs' token budget: the tokenizer's and the position embeddings' bound, at most 512."""
    from transformers import AutoConfig, AutoTokenizer

    tok, config = AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir)
    return min(512, tok.model_max_length or 512, getattr(config, "max_position_embeddings", 512) or 512)


def offline(model_dir: str, calls: list[tuple[str, list[str]]], sizes=CPU_SIZES, device: str = "cpu",
            dtype: str = "float32") -> dict:
    """The model alone on every pair: → pairs/s and real tokens/s per batch size, the best, and
    the scores of every pair (in the calls' order, flattened)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    limit = max_length(model_dir)
    pairs = [(q, d) for q, docs in calls for d in docs]
    lengths = [len(ids) for ids in tok([q for q, _ in pairs], [d for _, d in pairs], truncation="longest_first",
                                       max_length=limit)["input_ids"]]
    order = sorted(range(len(pairs)), key=lambda i: lengths[i])
    sweep, scores_by_size = {}, {}
    with torch.inference_mode():
        model(**tok(["warm"], ["up"], return_tensors="pt").to(device))
        for bs in sizes:
            scores = np.zeros(len(pairs), dtype=np.float32)
            real, t0 = 0, time.perf_counter()
            for i in range(0, len(order), bs):
                chunk = order[i:i + bs]
                enc = tok([pairs[j][0] for j in chunk], [pairs[j][1] for j in chunk], truncation="longest_first",
                          max_length=limit, padding=True, return_tensors="pt").to(device)
                # CrossEncoder's default activation for one label: sigmoid.
                scores[chunk] = torch.sigmoid(model(**enc).logits[:, 0].float()).cpu().numpy()
                real += int(enc["attention_mask"].sum())
            elapsed = time.perf_counter() - t0
            sweep[bs] = {"pairs_per_s": len(pairs) / elapsed, "tokens_per_s": real / elapsed}
            scores_by_size[bs] = scores
            print(f"  offline batch {bs:>3}: {sweep[bs]['pairs_per_s']:8.1f} pairs/s "
                  f"{sweep[bs]['tokens_per_s']:9.0f} real tokens/s", flush=True)
    best = max(sweep, key=lambda b: sweep[b]["pairs_per_s"])
    return {"sweep": sweep, "best_batch": best, **sweep[best], "pairs": len(pairs),
            "real_tokens": sum(lengths), "scores": scores_by_size[best]}


async def _rerank(client, query: str, texts: list[str]) -> np.ndarray:
    """Our Client's rerank where it has one; else the Rerank RPC through its retrying call."""
    if hasattr(client, "rerank"):
        return np.asarray(await client.rerank(query, texts), dtype=np.float32)
    from embedfleet.v1 import inference_pb2 as pb

    response = await client._call(client.stub.Rerank, pb.RerankRequest(query=query, texts=texts))
    return np.asarray(response.scores, dtype=np.float32)


async def served(calls: list[tuple[str, list[str]]], target: str, concurrency: int) -> dict:
    """The calls over gRPC, closed loop at `concurrency`: → pairs/s, requests/s, latency, and the
    scores in the calls' order. Unimplemented when the server does not serve Rerank."""
    import grpc

    from embedserve.client import Client

    queue = list(range(len(calls)))[::-1]
    results: list[np.ndarray | None] = [None] * len(calls)
    latencies: list[float] = []

    async def loop(client):
        while queue:
            i = queue.pop()
            t0 = time.perf_counter()
            results[i] = await _rerank(client, *calls[i])
            latencies.append(time.perf_counter() - t0)

    async with Client(target, max_attempts=50, timeout_s=300) as client:
        try:
            await _rerank(client, calls[0][0], calls[0][1][:2])  # connection and first-call costs
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise Unimplemented(f"the server answers UNIMPLEMENTED for Rerank: {e.details()}") from None
            raise
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    pairs = sum(len(docs) for _, docs in calls)
    lat = np.array(latencies) * 1000
    return {"pairs_per_s": pairs / elapsed, "requests_per_s": len(calls) / elapsed,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "scores": np.concatenate(results)}


def run(model_dir: str, calls, sizes, concurrency: int, device: str, dtype: str, server_env: dict) -> dict:
    """(a), then (b) against a server started here on `model_dir`. → the results (no scores)."""
    from tests.conftest import ServerProcess  # the same launcher the tests use

    print(f"pairs: {len(calls)} queries x {len(calls[0][1])} documents", flush=True)
    print("(a) offline, length-sorted pairs:", flush=True)
    a = offline(model_dir, calls, sizes, device, dtype)
    print("(b) served: starting embedserve on the same model ...", flush=True)
    # The server computes in the offline half's dtype (DTYPE=auto would differ from it on a GPU
    # without bf16), unless --server-env says otherwise.
    server = ServerProcess({"MODEL_PATH": model_dir, "BATCH_CAPS": "", "MAX_DRAIN_TIME_MS": "600000",
                            "DTYPE": dtype, **server_env})
    try:
        server.wait_ready(600)
        b = asyncio.run(served(calls, server.target, concurrency))
    except Unimplemented as e:
        b = {"unavailable": str(e)}
    finally:
        server.stop()
    scores = a.pop("scores")
    out = {"offline": a, "served": b}
    if "scores" in b:
        b["max_abs_diff_vs_offline"] = float(np.max(np.abs(b.pop("scores") - scores)))
        b["tokens_per_s"] = a["real_tokens"] * b["pairs_per_s"] / a["pairs"]
        out["ratio"] = b["pairs_per_s"] / a["pairs_per_s"]
    return out


def report(r: dict, concurrency: int) -> None:
    a, b = r["offline"], r["served"]
    print(f"\n{'system':<34}{'pairs/s':>10}{'real tokens/s':>15}")
    print(f"{'(a) offline best (batch ' + str(a['best_batch']) + ')':<34}{a['pairs_per_s']:>10.1f}{a['tokens_per_s']:>15.0f}")
    if "unavailable" in b:
        print(f"{'(b) embedserve Rerank, C=' + str(concurrency):<34}  not measured: {b['unavailable']}")
        return
    print(f"{'(b) embedserve Rerank, C=' + str(concurrency):<34}{b['pairs_per_s']:>10.1f}{b['tokens_per_s']:>15.0f}")
    print(f"ratio served/offline = {r['ratio']:.3f}; served: {b['requests_per_s']:.1f} req/s, p50 {b['p50_ms']:.0f} ms, "
          f"p99 {b['p99_ms']:.0f} ms; scores max |served - offline| {b['max_abs_diff_vs_offline']:.2e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a cross-encoder directory (default: one built from --build)")
    p.add_argument("--build", default="minilm", choices=("minilm", "bert-base", "tiny"))
    p.add_argument("--tokenizer", help="the tokenizer for --build (default: the packaged model's)")
    p.add_argument("--queries", type=int, default=40)
    p.add_argument("--docs", type=int, default=20, help="documents per query (one Rerank call)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sizes", help="offline batch sizes, comma-separated (default: by device)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, help="offline dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--json")
    p.add_argument("--server-env", action="append", default=[], metavar="K=V", help="extra server settings")
    args = p.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else (CUDA_SIZES if args.device == "cuda" else CPU_SIZES)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    env = {"DEVICE": args.device, **dict(kv.split("=", 1) for kv in args.server_env)}
    calls = requests(args.queries, args.docs)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model or build_model(scratch, args.build, args.tokenizer)
        results = run(model_dir, calls, sizes, args.concurrency, args.device, dtype, env)
    results.update(model=args.model or f"built: {args.build}", concurrency=args.concurrency, machine=f"{os.cpu_count()} cores")
    report(results, args.concurrency)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
