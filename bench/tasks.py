"""`python -m bench.tasks`: issue 38's tasks served against the library their users trust, side by
side in one run on this machine (RESULTS §16, one row per task).

For each task, (a) offline: the reference library alone in this process on every item, best of a
batch-size sweep; (b) served: the same items through our Client over gRPC, closed loop at
concurrency C, against a real `python -m embedserve` on the same model directory and device.
Prints items/s of both, the ratio, and the served answers' largest |Δ| from (a).

- multivector: documents' token vectors, `MultiVectorEncoder(path).encode_document` (a ColBERT
  model the tests build: the packaged all-MiniLM-L6-v2 under a random 128-wide Dense);
- llmrerank: (query, document) scores, `CrossEncoder(path).predict` (a tiny Qwen3 LLM reranker
  saved by sentence-transformers, random weights);
- bgem3: BGE-M3's three outputs of one pass (a tiny XLM-R with random heads); offline: its
  published formulas batched (FlagEmbedding cannot import beside transformers 5:
  tests/server/model/m3_models.py), compared on the dense vectors;
- longtext: texts of ~`--long-tokens` tokens embedded whole (LONG_TEXTS=window); offline: the
  same windows through transformers in batches, mean-pooled and pooled by their tokens (the rule
  of docs/api.md, "Long texts"), as `tests/server/test_long_texts.py` computes it.

The models have random weights: throughput and equality are what is measured, not quality.
Usage: python -m bench.tasks [--tasks multivector,llmrerank,bgem3,longtext] [--items 256]
       [--per-request 8] [--concurrency 8] [--device cpu] [--base DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.corpus import corpus  # noqa: E402

TASKS = ("multivector", "llmrerank", "bgem3", "longtext")
CPU_SIZES, CUDA_SIZES = (4, 8, 16, 32), (32, 64, 128, 256)


def sweep(name: str, items: int, run_at, sizes) -> tuple[dict, object]:
    """run_at(batch size) → answers, timed at each size: → (best's figures, best's answers)."""
    run_at(sizes[0])  # first-call costs out of the timing
    best, answers = None, None
    for bs in sizes:
        t0 = time.perf_counter()
        out = run_at(bs)
        rate = items / (time.perf_counter() - t0)
        print(f"  (a) {name} batch {bs:>3}: {rate:8.1f} items/s", flush=True)
        if best is None or rate > best["items_per_s"]:
            best, answers = {"items_per_s": rate, "batch": bs}, out
    return best, answers


async def closed_loop(target: str, calls: list, call, concurrency: int) -> tuple[dict, list]:
    """Each of `calls` through `call(client, c)`, `concurrency` at a time: → (rate, p50/p99), answers."""
    from embedserve.client import Client

    queue, answers, latencies = list(range(len(calls)))[::-1], [None] * len(calls), []

    async def loop(client):
        while queue:
            i = queue.pop()
            t0 = time.perf_counter()
            answers[i] = await call(client, calls[i])
            latencies.append(time.perf_counter() - t0)

    async with Client(target, max_attempts=50, timeout_s=300) as client:
        await call(client, calls[0])  # connection and first-call costs
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    lat = np.array(latencies) * 1000
    return {"seconds": elapsed, "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99))}, answers


def chunks(items: list, n: int) -> list[list]:
    return [items[i:i + n] for i in range(0, len(items), n)]


def multivector(root: Path, texts: list[str], sizes, device: str, base: str):
    from sentence_transformers import MultiVectorEncoder

    from tests.server.model.multivector_models import build_colbert

    path = build_colbert(root / "colbert", base, max_seq_length=256)
    model = MultiVectorEncoder(path, device=device)
    offline = lambda bs: [m.float().cpu().numpy() for m in model.encode_document(texts, batch_size=bs,  # noqa: E731
                                                                                convert_to_numpy=False)]

    async def call(client, chunk):
        return await client.embed_multivector(chunk, is_query=False)

    def diff(a, b):
        return max(float(np.abs(x - y).max()) if x.shape == y.shape else float("inf") for x, y in zip(a, b))
    return path, {}, offline, call, diff


def llmrerank(root: Path, texts: list[str], sizes, device: str, base: str):
    from sentence_transformers import CrossEncoder

    from tests.server.model.llm_reranker_models import build

    path = build(root / "llm")["st"]
    model = CrossEncoder(path, device=device)
    query = "how far away from the earth is the moon"
    offline = lambda bs: model.predict([(query, t) for t in texts], batch_size=bs)  # noqa: E731

    async def call(client, chunk):
        return await client.rerank(query, chunk)
    return path, {}, offline, call, lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max())


def bgem3(root: Path, texts: list[str], sizes, device: str, base: str):
    import torch
    from transformers import AutoModel, AutoTokenizer

    from tests.server.model.m3_models import build_m3

    path = build_m3(root)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).to(device).eval()
    sparse_head, colbert_head = torch.nn.Linear(model.config.hidden_size, 1), torch.nn.Linear(model.config.hidden_size,
                                                                                              model.config.hidden_size)
    sparse_head.load_state_dict(torch.load(Path(path) / "sparse_linear.pt", weights_only=True))
    colbert_head.load_state_dict(torch.load(Path(path) / "colbert_linear.pt", weights_only=True))
    sparse_head, colbert_head = sparse_head.to(device), colbert_head.to(device)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    specials = set(tok.all_special_ids)

    def offline(bs):
        """FlagEmbedding's formulas (m3_models.reference), batched: CLS normalized; relu of the
        sparse head per token, the max per id (specials out); the ColBERT head after CLS, masked,
        normalized. All three computed, as the server computes them; compared on the dense."""
        dense = [None] * len(texts)
        with torch.inference_mode():
            for i in range(0, len(order), bs):
                chunk = order[i:i + bs]
                enc = tok([texts[j] for j in chunk], padding=True, truncation=True, max_length=512,
                          return_tensors="pt").to(device)
                hidden = model(**enc).last_hidden_state
                weights = torch.relu(sparse_head(hidden)).squeeze(-1).cpu().numpy()
                mask = enc["attention_mask"][:, 1:, None]
                colbert = torch.nn.functional.normalize(colbert_head(hidden[:, 1:]) * mask, dim=-1).cpu().numpy()
                vectors = torch.nn.functional.normalize(hidden[:, 0], dim=-1).float().cpu().numpy()
                ids = enc["input_ids"].cpu().numpy()
                for k, j in enumerate(chunk):
                    lexical: dict[int, float] = {}
                    for t, w in zip(ids[k].tolist(), weights[k].tolist()):
                        if t not in specials and w > 0:
                            lexical[t] = max(lexical.get(t, 0.0), w)
                    _ = colbert[k][: int(mask[k].sum())], lexical
                    dense[j] = vectors[k]
        return np.stack(dense)

    async def call(client, chunk):
        return (await client.embed_m3(chunk, outputs=("dense", "sparse", "colbert"))).dense
    return path, {}, offline, call, lambda a, b: float(np.abs(np.concatenate(b) - a).max())


def longtext(root: Path, texts: list[str], sizes, device: str, base: str):
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = base
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).to(device).eval()
    room = max_length(path) - 2
    stride = room - room // 4  # docs/api.md, "Long texts": windows of the max length overlapping by a quarter
    rows, owner = [], []
    for i, text in enumerate(texts):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        start = 0
        while True:
            rows.append([tok.cls_token_id, *ids[start:start + room], tok.sep_token_id])
            owner.append(i)
            if start + room >= len(ids):
                break
            start += stride

    def offline(bs):
        pooled = np.zeros((len(texts), model.config.hidden_size))
        weight = np.zeros(len(texts))
        with torch.inference_mode():
            for i in range(0, len(rows), bs):
                chunk = rows[i:i + bs]
                width = max(map(len, chunk))
                ids = torch.tensor([r + [0] * (width - len(r)) for r in chunk], device=device)
                mask = (ids != 0).long()
                mask[:, 0] = 1
                hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.double()
                u = ((hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).cpu().numpy()
                for k, r in enumerate(chunk):
                    pooled[owner[i + k]] += u[k] * len(r)
                    weight[owner[i + k]] += len(r)
        out = pooled / weight[:, None]
        return (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)

    async def call(client, chunk):
        return await client.embed(chunk, long_text="window")
    env = {"LONG_TEXTS": "window", "MAX_TOKENS_PER_TEXT": str(1 << 16)}
    return path, env, offline, call, lambda a, b: float(np.abs(np.concatenate(b) - a).max())


def max_length(path: str) -> int:
    """Tokens per row as the server reads them: the declared max_seq_length, else the tokenizer's,
    capped by the position table and the largest bucket (512)."""
    from transformers import AutoConfig, AutoTokenizer

    declared = Path(path) / "sentence_bert_config.json"
    limits = [512, AutoTokenizer.from_pretrained(path).model_max_length,
              AutoConfig.from_pretrained(path).max_position_embeddings]
    if declared.is_file():
        limits.append(json.loads(declared.read_text()).get("max_seq_length") or 512)
    return int(min(limits))


def run_task(task: str, args, sizes) -> dict:
    from tests.conftest import ServerProcess  # the same launcher the tests use

    if task == "longtext":
        texts = [" ".join(corpus(40, seed=s)) for s in range(max(2, args.items // 16))]  # ~3-4k tokens each
    else:
        texts = corpus(args.items, seed=7)
    print(f"\n== {task}: {len(texts)} items, {args.per_request} per request, C={args.concurrency}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        path, env, offline, call, diff = globals()[task](Path(scratch), texts, sizes, args.device, args.base)
        a, want = sweep(task, len(texts), offline, sizes)
        server = ServerProcess({"MODEL_PATH": path, "BATCH_CAPS": "", "MAX_DRAIN_TIME_MS": "600000", "DEVICE": args.device,
                                "DTYPE": "float32", "WARM_START": "false", **env})
        try:
            server.wait_ready(900)
            calls = chunks(texts, args.per_request)
            b, got = asyncio.run(closed_loop(server.target, calls, call, args.concurrency))
        finally:
            server.stop()
    flat = [x for answer in got for x in (answer if task == "multivector" else [answer])]
    b["items_per_s"] = len(texts) / b.pop("seconds")
    result = {"offline": a, "served": b, "ratio": b["items_per_s"] / a["items_per_s"],
              "max_abs_diff": diff(want, flat if task == "multivector" else
                                   (np.concatenate(got) if task == "llmrerank" else got))}
    print(f"  (b) served: {b['items_per_s']:8.1f} items/s, p50 {b['p50_ms']:.0f} ms, p99 {b['p99_ms']:.0f} ms; "
          f"served/offline {result['ratio']:.3f}; max |Δ| {result['max_abs_diff']:.2e}", flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--items", type=int, default=256)
    p.add_argument("--per-request", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--base", help="the BERT directory the multivector and longtext models use (default: the "
                                   "packaged all-MiniLM-L6-v2)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not args.base:
        from embedserve.model.source import packaged_model_dir

        args.base = str(packaged_model_dir())
    sizes = CUDA_SIZES if args.device == "cuda" else CPU_SIZES
    results = {task: run_task(task, args, sizes) for task in args.tasks.split(",")}
    print(f"\n{'task':<12}{'offline items/s':>17}{'served items/s':>16}{'ratio':>8}{'max |Δ|':>10}")
    for task, r in results.items():
        print(f"{task:<12}{r['offline']['items_per_s']:>17.1f}{r['served']['items_per_s']:>16.1f}"
              f"{r['ratio']:>8.3f}{r['max_abs_diff']:>10.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": f"{os.cpu_count()} cores", "device": args.device,
                                               "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
