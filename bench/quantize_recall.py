"""`python -m bench.quantize_recall`: what int8 costs in retrieval, fixed ranges against calibrated.

The packaged all-MiniLM-L6-v2 embeds a seeded mixed-length corpus (bench/corpus.py: queries,
titles, passages) as documents and other seeded texts as queries, with sentence-transformers
(float32, normalized). Each query's top 10 documents by cosine in float32 are the truth; recall@10
is the share of them an int8 index finds, for the ranges the server can quantize with:
`QUANTIZE_RANGE=1.0` (the default), `0.3`, and `calibrated` (each dimension's min and max over the
model's vectors of embedserve.model.calibration's corpus, as the server computes them). Two ways to
score an int8 index: the dot product of the int8 codes themselves (what an int8 index such as
usearch or faiss computes), and the cosine of the dequantized vectors. Also the levels used: how
many of the 256 codes occur in the documents' codes. Quantized with the server's own arithmetic
(transports/encodings.py: sentence-transformers' quantize_embeddings, byte for byte).

    python -m bench.quantize_recall [--docs 1000] [--queries 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.corpus import corpus  # noqa: E402

K = 10


def recall_at_k(truth: np.ndarray, scores: np.ndarray, k: int = K) -> float:
    """Mean share of each query's true top k (indices, [q, k]) among the k best by `scores` [q, n]."""
    found = np.argpartition(-scores, k, axis=1)[:, :k]
    return float(np.mean([len(set(t) & set(f)) / k for t, f in zip(truth, found)]))


def dequantized(codes: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """int8 codes back to floats: each at the middle of its level."""
    steps = (ranges[1] - ranges[0]) / 255
    return ranges[0] + (codes.astype(np.float32) + 128 + 0.5) * steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quantize_recall")
    p.add_argument("--docs", type=int, default=1000)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)

    from sentence_transformers import SentenceTransformer

    from embedserve.model import calibration
    from embedserve.model.source import packaged_model_dir
    from embedserve.transports.encodings import Quantization, quantize

    st = SentenceTransformer(str(packaged_model_dir()), device="cpu")
    encode = lambda texts: st.encode(texts, normalize_embeddings=True, convert_to_numpy=True, batch_size=32)  # noqa: E731
    docs = encode(corpus(args.docs, seed=11))
    queries = encode(corpus(args.queries, seed=12))
    calib = encode(list(calibration.CORPUS)).astype(np.float32)
    truth = np.argsort(-(queries @ docs.T), axis=1)[:, :K]

    results = {}
    for name, q in (("1.0", Quantization(1.0)), ("0.3", Quantization(0.3)),
                    ("calibrated", Quantization(calibration=calib, digest=calibration.digest(calib)))):
        dq, qq = quantize(docs, "int8", q), quantize(queries, "int8", q)
        ranges = q.ranges(docs.shape[1])
        codes_scores = qq.astype(np.int32) @ dq.astype(np.int32).T
        deq_d, deq_q = dequantized(dq, ranges), dequantized(qq, ranges)
        cos = (deq_q / np.linalg.norm(deq_q, axis=1, keepdims=True)) @ (deq_d / np.linalg.norm(deq_d, axis=1, keepdims=True)).T
        results[name] = {"recall_at_10_codes": recall_at_k(truth, codes_scores), "recall_at_10_dequantized": recall_at_k(truth, cos),
                         "levels_used": int(len(np.unique(dq))),
                         "clipped_share": float(np.mean((docs < ranges[0]) | (docs > ranges[1])))}
        r = results[name]
        print(f"QUANTIZE_RANGE={name:<10} recall@10 int8 codes {r['recall_at_10_codes']:.3f}  dequantized "
              f"{r['recall_at_10_dequantized']:.3f}  levels used {r['levels_used']:>3}  clipped {r['clipped_share']:.4f}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"docs": args.docs, "queries": args.queries, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
