"""bench/routing.py, run as `python -m bench.routing` in a tiny configuration (one scenario, one
short run per routing): it starts its pods behind the loopback DNS server, drives both routings
and prints the side-by-side table, every call answered."""

import json
import subprocess
import sys


def test_the_routing_bench_runs_both_routings_side_by_side(tmp_path):
    out = tmp_path / "routing.json"
    done = subprocess.run([sys.executable, "-m", "bench.routing", "--scenario", "3x apart", "--duration", "1.5",
                           "--reps", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "P99 round-robin / least-drain" in done.stdout
    results = json.loads(out.read_text())
    assert list(results) == ["3x apart"] and sorted(results["3x apart"]) == ["least-drain", "round-robin"]
    for runs in results["3x apart"].values():
        (run,) = runs
        assert run["requests"] > 20 and run["codes"] == {"OK": run["requests"]}, run
