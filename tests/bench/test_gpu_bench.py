"""bench/gpu_bench.py's pure parts: what a GPU run depends on but a CPU dry run (300 short
texts) never reaches, so a lent device's minutes are not lost to them."""

from pathlib import Path

import numpy as np

from bench.gpu_bench import MAX_TOKENS, fill, stream, write
from embedserve.model.batches import PackSpec


def test_streams_are_filled_within_the_row_cap_as_well_as_the_token_budget():
    # The GPU corpus: ~51 tokens per text, so 32,768 tokens would hold ~641 rows, past the
    # server's 512 (MAX_BATCH_SIZE) and the cu_seqlens slots a captured stream has.
    rng = np.random.default_rng(0)
    rows = [np.ones(int(n), dtype=np.int64) for n in rng.integers(20, 80, 3000)]
    spec = PackSpec.for_plan(512, 512, MAX_TOKENS, True)
    streams = fill(rows, MAX_TOKENS, spec.max_rows)
    assert max(len(s) for s in streams) == spec.max_rows
    assert all(sum(map(len, s)) <= MAX_TOKENS for s in streams)
    assert sum(map(len, streams)) == len(rows)  # every row once, in order
    assert np.array_equal(np.concatenate([np.concatenate(s) for s in streams]), np.concatenate(rows))
    for s in streams:  # each lays out as the server's static shapes allow
        batch = stream(s, spec)
        assert batch.rows == len(s) and batch.real_tokens == sum(map(len, s))


def test_a_failed_phase_is_reported_in_the_table_not_raised(tmp_path: Path):
    results = {"device": "cpu", "model": "bert-base", "peak_flops": None, "flops_per_token": 1e6,
               "kernels": {"error": "ValueError: broken"}, "inductor": {"error": "RuntimeError: no compiler"},
               "offline": {"sweep": {128: 10.0}, "best_batch": 128, "model_only": 10.0, "mfu": None,
                           "with_tokenizer": 9.0, "packed_error": "RuntimeError: no varlen kernel"},
               "served": {"1 text/request, padded": {"error": "TimeoutError: slow"}}}
    write(tmp_path, results)
    table = (tmp_path / "table.md").read_text()
    for failure in ("ValueError: broken", "RuntimeError: no compiler", "RuntimeError: no varlen kernel", "TimeoutError: slow"):
        assert failure in table
    assert "offline limit (sorted, batch 128): 10 tok/s" in table
