"""bench/shared_device.py, run small: its trace is what its docstring says (staggered peaks whose
sum is flat under the target utilization), and one shared pod of four simulated models, replayed a
few seconds of the trace and both isolation runs, reports every model's figures, every model
answered. No timing is judged here: the figures are the bench's to print (the four dedicated pods
take most of a minute to start on two cores, so the bench runs them, not this test)."""

import json

import numpy as np
import pytest

from bench import shared_device as sd


def test_the_trace_staggers_the_peaks_and_keeps_their_sum_under_the_target():
    period = 40.0
    shares = sd.trace(period)
    grid = np.linspace(0, period, 401)
    totals = [sum(f(t) for f in shares.values()) for t in grid]
    assert max(totals) == pytest.approx(min(totals)) and max(totals) <= sd.TARGET_UTILIZATION
    peaks = [float(grid[np.argmax([f(t) for t in grid])]) for f in shares.values()]
    assert peaks == sorted(peaks) and np.diff(peaks) == pytest.approx([period / 4] * 3, abs=0.2)
    assert all(max(f(t) for t in grid) == pytest.approx(sd.PEAK) for f in shares.values())
    # Poisson arrivals at the shares: reproducible, about the expected count for each model.
    schedule = sd.arrivals(shares, 100.0, period, seed=1)
    assert schedule == sd.arrivals(shares, 100.0, period, seed=1) and schedule == sorted(schedule)
    for name in sd.NAMES:
        assert abs(sum(n == name for _, n in schedule) - 100 * period * 0.1725) < 5 * np.sqrt(100 * period * 0.1725)


def test_one_shared_pod_answers_every_model_and_the_bench_reports_each(tmp_path, capsys):
    out = sd.main(["--period", "4", "--isolation", "2", "--no-dedicated", "--json", str(tmp_path / "sd.json")])
    shared = out["trace"]["shared"]
    assert sorted(shared) == sorted(sd.NAMES)
    for name, f in shared.items():
        assert f["sent"] > 10 and f["ok"] > 0 and f["failed"] == 0, (name, f)
        assert f["busy_s"] > 0 and f["p99_ms"] >= f["p50_ms"] > 0 and f["ok_tok_s"] > 0
    assert out["summary"]["shared"]["device_s"] == 4.0
    assert set(out["isolation"]) == {"usual", "flood"}
    for label, run in out["isolation"].items():
        assert sorted(run) == sorted(sd.NAMES) and all(f["sent"] > 0 and f["failed"] == 0 for f in run.values()), label
    # The flooded model offered about ten times what it offers as usual.
    assert out["isolation"]["flood"]["en"]["sent"] > 4 * out["isolation"]["usual"]["en"]["sent"]
    printed = capsys.readouterr().out
    assert "trace: 4 models" in printed and "isolation, shared pod" in printed and "the others, flood / usual" in printed
    assert json.loads((tmp_path / "sd.json").read_text())["bound_ms"] == out["bound_ms"]
