"""GPU measurements for bench/gpu.sh, on BERT-base built from a config (random weights, no hub) or
the packaged all-MiniLM-L6-v2 (--model minilm):

1. kernels: the server's own Encoder.run (copy in, forward, pool, copy out), bf16: padded rows
   eager vs a replayed CUDA graph per (bucket, batch); packed rows (ATTENTION=packed: one stream,
   FlashAttention-2 varlen, a graph per stream size) per stream size on rows of the corpus's
   lengths, with their max |Δ| from the padded model on the same rows;
2. offline: the limit — the model alone, eager, length-sorted pre-tokenized batches, best of a
   sweep (and with the tokenizer in the loop) — beside the server's packed encoder over the
   same corpus in arrival order (no sorting), streams filled to a token budget;
3. served: `python -m embedserve` under closed-loop load (bench/gpu_served.py), in this order
   while the time budget lasts: 32 texts/request packed and padded, infinity-emb on the same GPU
   (when INFINITY_PYTHON names a Python with it), single-text packed with FRONTENDS 1/4/8,
   single-text infinity-emb and padded;
4. inductor (only when --phases names it): COMPILE=true compile seconds and time per batch.

MFU beside every throughput: real tokens/s × the model's FLOPs per real token / the GPU's dense
bf16 peak. FLOPs per token: 2 per multiply-add of each matmul a token goes through (QKV and
output projections, FFN: 2·(4h² + 2h·i) per layer) plus attention's QKᵀ and AV (4·h·L per layer
for a row of L tokens, weighted over the corpus's tokens: 4·h·ΣL²/ΣL); embeddings, LayerNorm,
softmax and pooling are left out (< 1%). Padding is not counted: MFU is useful work. Peak: 989
TFLOP/s for H100 and H200 SXM (NVIDIA's datasheets give 1,979 "with sparsity", twice the dense
rate), H100 PCIe 756, H200 NVL 835, A100 312, L40S 362; --peak-tflops for another GPU.

Each phase is time-boxed (--budget-s for the whole run; a served run starts only if the time it
took before still fits) and results are written as soon as a phase ends (results.json,
table.md), so a run cut short still reports. `--dry-run` exercises every phase on the CPU with a
tiny model (no graphs there): a check of this script, not a measurement."""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench import gpu_served
from bench.serve_vs_offline import model_max_length
from embedserve.config import Settings
from embedserve.model.encoder import Encoder, choose_placement
from embedserve.model.batches import PackedBatch, PackSpec, layout, padded_rows
from embedserve.model.worker import WarmupPlan, dummy_batch

BUCKETS = (16, 64, 128, 256, 512)
BATCHES = (8, 32, 128)
MAX_TOKENS = 32768  # the server's default MAX_TOKENS_PER_BATCH
STREAMS = (1024, 4096, 16384, 32768)  # packed stream sizes timed in (1)
# Notes a packed stream whose unit vectors differ from the padded rows' by more than bf16 rounding
# usually does (~1e-3). Not a verdict: the CUDA tests hold the calibrated bound.
PACKED_TOLERANCE = 2e-2
INDUCTOR_SHAPES = ((8, 16), (32, 128), (64, 512))  # (rows, bucket)
PEAK_TFLOPS = (("H100 PCIe", 756), ("H200 NVL", 835), ("H100", 989), ("H200", 989), ("A100", 312), ("L40S", 362))


def peak_flops(device: str, override: float | None) -> float | None:
    """The GPU's dense bf16 peak in FLOP/s, from its name (None: unknown, no MFU)."""
    if override:
        return override * 1e12
    return next((tf * 1e12 for name, tf in PEAK_TFLOPS if name in device), None)


def flops_per_token(config, counts) -> float:
    lengths = np.asarray(counts, dtype=np.float64)
    h, i = config.hidden_size, config.intermediate_size
    return config.num_hidden_layers * (2 * (4 * h * h + 2 * h * i) + 4 * h * float((lengths**2).sum() / lengths.sum()))


def save_model(path: str, tokenizer_dir: str, model: str, dry: bool) -> None:
    from transformers import AutoTokenizer, BertConfig, BertModel

    if model == "minilm":
        import shutil

        from embedserve.model.source import packaged_model_dir

        shutil.copytree(packaged_model_dir(), path, dirs_exist_ok=True)
        return
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


def stream(rows: list[np.ndarray], spec: PackSpec) -> PackedBatch:
    """Token rows (ids, arrival order) → one packed stream as the server lays it out."""
    lengths = np.array([len(r) for r in rows])
    cu, positions, segments, size = layout(lengths, spec)
    ids = np.zeros(size, dtype=np.int64)
    ids[: lengths.sum()] = np.concatenate(rows)
    return PackedBatch(torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(segments),
                       torch.from_numpy(cu), spec.max_len if spec.ladder else int(lengths.max()), len(rows),
                       int(lengths.sum()), [])


def fill(rows: list[np.ndarray], budget: int, max_rows: int) -> list[list[np.ndarray]]:
    """Rows in arrival order into streams of at most `budget` tokens and `max_rows` rows (FIFO,
    as a saturated server fills them: the batcher caps both)."""
    out, current, used = [], [], 0
    for r in rows:
        if current and (used + len(r) > budget or len(current) == max_rows):
            out.append(current)
            current, used = [], 0
        current.append(r)
        used += len(r)
    return out + ([current] if current else [])


def padded_like(batch: PackedBatch):
    """A packed batch's rows as one padded batch (the padded model's own layout)."""
    from embedserve.model.batches import Batch

    return Batch(*padded_rows(batch), batch.rows, batch.real_tokens, [])


def kernels(model_dir: str, rows: list[np.ndarray], cuda: bool, budget_s: float, reps: int, mfu) -> list[dict]:
    out, start, rng = [], time.monotonic(), np.random.default_rng(0)
    eager = encoder(model_dir, {"DTYPE": "bfloat16", "COMPILE": "false", "ATTENTION": "padded"}, cuda)
    graphs = encoder(model_dir, {"DTYPE": "bfloat16", "COMPILE": "graphs", "ATTENTION": "padded"}, cuda)
    vocab = eager.model.config.vocab_size
    for bucket, n in ((b, n) for b in BUCKETS for n in BATCHES if n * b <= MAX_TOKENS):
        if time.monotonic() - start > budget_s / 2:
            out.append({"note": f"kernels: {budget_s / 2:.0f} s for padded shapes spent; the rest skipped"})
            break
        check = random_rows(n, bucket, vocab, rng)
        deviation = float(np.abs(graphs.run(check) - eager.run(check)).max())
        full = full_rows(bucket, n, vocab, rng)
        e, g = time_run(eager, full, reps), time_run(graphs, full, reps)
        out.append({"layout": "padded", "bucket": bucket, "batch": n, "eager_ms": e * 1e3, "graph_ms": g * 1e3,
                    "speedup": e / g, "tokens_per_s": n * bucket / g, "mfu": mfu(n * bucket / g), "max_abs_dev": deviation})
        print("kernels", out[-1], flush=True)
    del graphs
    try:  # refused (ATTENTION=packed: the kernel missing or failing its check): the padded rows above stand
        packed = encoder(model_dir, {"DTYPE": "bfloat16", "COMPILE": "graphs", "ATTENTION": "packed"}, cuda)
    except Exception as e:  # noqa: BLE001
        out.append({"note": f"kernels: packed rows refused: {type(e).__name__}: {e}"})
        return out
    spec = PackSpec.for_plan(512, 512, MAX_TOKENS, cuda)
    for size in STREAMS:
        if time.monotonic() - start > budget_s:
            out.append({"note": f"kernels: {budget_s:.0f} s budget spent; remaining streams skipped"})
            break
        try:  # one stream size failing must not lose the others
            batch = stream(fill(rows, size, spec.max_rows)[0], spec)
            deviation = float(np.abs(packed.run(batch) - eager.run(padded_like(batch))).max())
            t = time_run(packed, batch, reps)
        except Exception as e:  # noqa: BLE001
            out.append({"note": f"kernels: packed stream {size} failed: {type(e).__name__}: {e}"})
            print(out[-1]["note"], flush=True)
            continue
        out.append({"layout": "packed", "stream": batch.padded_tokens, "rows": batch.rows, "real_tokens": batch.real_tokens,
                    "graph_ms": t * 1e3, "tokens_per_s": batch.real_tokens / t, "mfu": mfu(batch.real_tokens / t),
                    "max_abs_dev_vs_padded": deviation})
        print("kernels", out[-1], flush=True)
        if not deviation <= PACKED_TOLERANCE:  # NaN too
            out.append({"note": f"kernels: packed stream {size} differs from padded rows by {deviation:.1e} "
                                f"(> {PACKED_TOLERANCE:.0e}): check it (the CUDA tests hold the calibrated bound)"})
    del eager, packed
    if cuda:
        torch.cuda.empty_cache()
    return out


def inductor(model_dir: str, cuda: bool, budget_s: float, reps: int) -> list[dict]:
    rows, start, rng = [], time.monotonic(), np.random.default_rng(1)
    enc = encoder(model_dir, {"DTYPE": "bfloat16", "COMPILE": "true", "ATTENTION": "padded"}, cuda)
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


def offline(model_dir: str, texts: list[str], rows: list[np.ndarray], dtype: str, cuda: bool, mfu) -> dict:
    """The model alone: length-sorted batches, eager; tokens/s on pre-tokenized batches (the
    model's own limit) and with the tokenizer in the loop. Then the server's packed encoder
    (graphs) on the corpus in arrival order, streams filled to each budget, pre-built."""
    from transformers import AutoModel, AutoTokenizer

    from embedserve.model.pooling import pool

    device = "cuda" if cuda else "cpu"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ordered = sorted(texts, key=len)

    def encode(chunk):
        return tok(chunk, truncation=True, max_length=model_max_length(model_dir), padding=True, return_tensors="pt")

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
    del model
    result = {"sweep": sweep, "best_batch": best, "model_only": sweep[best], "mfu": mfu(sweep[best]), "with_tokenizer": with_tok}
    try:  # the limit above stands even if packed rows fail here
        result["packed_arrival_order"] = packed_offline(model_dir, rows, dtype, cuda, mfu)
    except Exception as e:  # noqa: BLE001
        result["packed_error"] = f"{type(e).__name__}: {e}"
        print("offline packed failed:", result["packed_error"], flush=True)
    return result


def packed_offline(model_dir: str, rows: list[np.ndarray], dtype: str, cuda: bool, mfu) -> dict:
    packed = encoder(model_dir, {"DTYPE": dtype, "ATTENTION": "packed"}, cuda)
    spec = PackSpec.for_plan(512, 512, MAX_TOKENS, cuda)
    streams = {}
    for budget in (8192, 32768):
        batches = [stream(s, spec) for s in fill(rows, budget, spec.max_rows)]
        for b in batches:  # captures every size met, untimed
            packed.run(b)
        t0 = time.perf_counter()
        for b in batches:
            packed.run(b)
        real = sum(b.real_tokens for b in batches)
        streams[budget] = {"tokens_per_s": real / (time.perf_counter() - t0),
                           "real_per_padded": real / sum(b.padded_tokens for b in batches)}
        streams[budget]["mfu"] = mfu(streams[budget]["tokens_per_s"])
        print("offline packed, budget", budget, streams[budget], flush=True)
    return streams


def served_phases(results: dict, model_dir: str, texts, counts, cuda: bool, deadline: float, mfu, save) -> None:
    """The server under two request shapes, packed and padded, FRONTENDS 1/4/8, and infinity-emb,
    most important first, each started only if the time the slowest run took still fits."""
    procs = min(6, max(2, (os.cpu_count() or 2) // 3))
    dtype = "bfloat16" if cuda else "float32"
    duration = 10 if cuda else 4
    corpus3 = texts * 3, counts * 3  # cycled: the clients stop at the deadline, in steady state
    ours = functools.partial(gpu_served.embedserve, model_dir, *corpus3)
    theirs = functools.partial(gpu_served.infinity, os.environ.get("INFINITY_PYTHON"), model_dir, *corpus3,
                               "cuda" if cuda else "cpu")
    packed = {"DTYPE": dtype, "ATTENTION": "packed"}
    runs = [
        ("32 texts/request, packed", functools.partial(ours, packed, procs, 32, 16, duration)),
        ("32 texts/request, padded", functools.partial(ours, {"DTYPE": dtype, "ATTENTION": "padded"}, procs, 32, 16, duration)),
        ("infinity-emb, 32 texts/request", functools.partial(theirs, procs, 32, 16, duration)),
        *((f"1 text/request, packed, FRONTENDS={n}",
           functools.partial(ours, {**packed, "FRONTENDS": str(n)}, procs, 1, 128, duration)) for n in (1, 4, 8)),
        ("infinity-emb, 1 text/request", functools.partial(theirs, procs, 1, 128, duration)),
        ("1 text/request, padded", functools.partial(ours, {"DTYPE": dtype, "ATTENTION": "padded"}, procs, 1, 128, duration)),
    ]
    results["served"] = {}
    took: list[float] = []  # each run's cost: start, warm-up, window, stop
    for name, run in runs:
        left, needed = deadline - time.monotonic(), (max(took) if took else 75.0) if cuda else 0.0
        if left < needed:
            results["served"][name] = {"skipped": f"{left:.0f} s of the budget left, a run takes {needed:.0f} s"}
            save()
            continue
        t0 = time.monotonic()
        phase(results["served"], name, functools.partial(with_mfu, run, mfu), save)
        if "skipped" not in results["served"][name]:
            took.append(time.monotonic() - t0)


def with_mfu(run, mfu) -> dict:
    result = run()
    return {**result, "mfu": mfu(result["tokens_per_s"])} if "tokens_per_s" in result else result


def phase(store: dict, name: str, fn, save) -> None:
    t0 = time.monotonic()
    try:
        store[name] = fn()
    except Exception as e:  # noqa: BLE001 - one phase failing must not lose the others' figures
        store[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"phase {name} failed:", repr(e), flush=True)
    print(f"phase {name}: {time.monotonic() - t0:.0f} s", flush=True)
    save()


def fmt_mfu(x) -> str:
    return f"{x:.1%}" if x is not None else "n/a"


def listed(section) -> list[dict]:
    """A phase's rows; a failed phase (its {"error": ...}) as one note."""
    if isinstance(section, dict):
        return [{"note": f"failed: {section.get('error')}"}]
    return section or []


def write(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2))
    lines = [f"device {results['device']}, model {results.get('model')}, {results.get('flops_per_token', 0) / 1e6:.1f} "
             f"MFLOP per real token, peak {(results.get('peak_flops') or 0) / 1e12:.0f} TFLOP/s (0: unknown)", "",
             "| layout | shape | eager ms | graph ms | speedup | real tok/s | MFU | max |Δ| |", "|---|---|---|---|---|---|---|---|"]
    for r in listed(results.get("kernels")):
        if "note" in r:
            lines.append(r["note"])
        elif r["layout"] == "padded":
            lines.append(f"| padded | {r['bucket']} x {r['batch']} | {r['eager_ms']:.2f} | {r['graph_ms']:.2f} | "
                         f"{r['speedup']:.2f} | {r['tokens_per_s']:.0f} | {fmt_mfu(r['mfu'])} | {r['max_abs_dev']:.1e} |")
        else:
            lines.append(f"| packed | stream {r['stream']} ({r['rows']} rows) | | {r['graph_ms']:.2f} | | "
                         f"{r['tokens_per_s']:.0f} | {fmt_mfu(r['mfu'])} | {r['max_abs_dev_vs_padded']:.1e} vs padded |")
    off = results.get("offline", {})
    if "model_only" in off:
        lines.append(f"\noffline limit (sorted, batch {off['best_batch']}): {off['model_only']:.0f} tok/s, MFU "
                     f"{fmt_mfu(off['mfu'])}; with tokenizer {off['with_tokenizer']:.0f}")
        for budget, p in off.get("packed_arrival_order", {}).items():
            lines.append(f"offline packed, arrival order, budget {budget}: {p['tokens_per_s']:.0f} tok/s, MFU "
                         f"{fmt_mfu(p['mfu'])}, real/padded {p['real_per_padded']:.3f}")
        if "packed_error" in off:
            lines.append(f"offline packed: failed: {off['packed_error']}")
    elif off:
        lines.append(f"\noffline: {off}")
    lines += ["", "| served | real tok/s | vs offline | MFU | requests/s | p50 / p99 ms | GPU busy | real/padded | rows/batch |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, sv in results.get("served", {}).items():
        if "tokens_per_s" not in sv:
            lines.append(f"| {name} | {sv.get('skipped') or sv.get('error')} | | | | | | | |")
            continue
        vs = f"{sv['tokens_per_s'] / off['model_only']:.2f}" if "model_only" in off else ""
        extra = [f"{sv[k]:.2f}" if isinstance(sv.get(k), float) else "" for k in ("gpu_busy", "real_per_padded", "rows_per_batch")]
        lines.append(f"| {name} | {sv['tokens_per_s']:.0f} | {vs} | {fmt_mfu(sv.get('mfu'))} | {sv['requests_per_s']:.0f} | "
                     f"{sv['p50_ms']:.0f} / {sv['p99_ms']:.0f} | {' | '.join(extra)} |")
    for r in listed(results.get("inductor")):
        lines.append(f"inductor bf16 bucket {r['bucket']} batch {r['batch']}: compile {r['compile_s']:.1f} s, "
                     f"{r['ms']:.2f} ms" if "ms" in r else r["note"])
    (out / "table.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", required=True, help="a tokenizer directory (BERT vocabulary)")
    p.add_argument("--model", default="bert-base", choices=("bert-base", "minilm"))
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, small corpus: checks this script")
    p.add_argument("--phases", default="kernels,offline,served", help="of kernels, offline, served, inductor")
    p.add_argument("--budget-s", type=float, default=380, help="the whole run; phases skip what would not fit")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by name)")
    a = p.parse_args()
    start = time.monotonic()
    deadline = start + (a.budget_s if not a.dry_run else 3600)
    cuda = not a.dry_run
    assert not cuda or torch.cuda.is_available(), "bench/gpu.sh needs CUDA"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if cuda else "cpu (dry run)"
    results: dict = {"device": device, "torch": torch.__version__, "model": a.model, "peak_flops": peak_flops(device, a.peak_tflops)}
    reps = 20 if cuda else 2

    def save():
        try:  # results.json is written first; a table that cannot be rendered must not stop the run
            write(out, results)
        except Exception as e:  # noqa: BLE001
            print("writing table.md failed:", repr(e), flush=True)

    from transformers import AutoConfig, AutoTokenizer

    from bench.corpus import corpus

    with tempfile.TemporaryDirectory() as model_dir:
        save_model(model_dir, a.tokenizer, a.model, a.dry_run)
        texts = corpus(60000 if cuda else 300, seed=1)
        rows = [np.asarray(ids, dtype=np.int64) for ids in
                AutoTokenizer.from_pretrained(model_dir)(texts, truncation=True,
                                                         max_length=model_max_length(model_dir))["input_ids"]]
        counts = [len(r) for r in rows]
        per_token = flops_per_token(AutoConfig.from_pretrained(model_dir), counts)
        results.update(corpus={"texts": len(texts), "real_tokens": sum(counts)}, flops_per_token=per_token)

        def mfu(tokens_per_s: float) -> float | None:
            return tokens_per_s * per_token / results["peak_flops"] if results["peak_flops"] else None

        wanted = a.phases.split(",")
        left = lambda: deadline - time.monotonic()  # noqa: E731
        if "kernels" in wanted:
            phase(results, "kernels", lambda: kernels(model_dir, rows, cuda, min(45, left()) if cuda else 30, reps, mfu), save)
        if "offline" in wanted:
            phase(results, "offline", lambda: offline(model_dir, texts, rows, "bfloat16" if cuda else "float32", cuda, mfu), save)
        if "served" in wanted:
            served_phases(results, model_dir, texts, counts, cuda, deadline - (60 if "inductor" in wanted else 0), mfu, save)
        if "inductor" in wanted:
            phase(results, "inductor", lambda: inductor(model_dir, cuda, min(60, left()) if cuda else 30, reps), save)
    print((out / "table.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
