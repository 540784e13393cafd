"""bench/startup.py, run small (one cold/warm pair, one process, the simulated device): a cold start
measures and writes the warm-up file, the warm one reuses it (the bench checks /health's `warmup`
of each and fails otherwise), and both times are reported with their ratio; a third start, from
zero, to the answer of its first request."""

from bench import startup


def test_one_cold_and_one_warm_start_are_timed(tmp_path, capsys):
    out = startup.main(["--runs", "1", "--frontends", "1", "--model", "sim:5000000", "--timeout-s", "120",
                        "--json", str(tmp_path / "startup.json")])
    (r,) = out["results"]
    assert r["frontends"] == 1 and len(r["cold_s"]) == len(r["warm_s"]) == 1
    assert r["warm_over_cold"] == r["warm_median_s"] / r["cold_median_s"] > 0
    assert len(r["zero_s"]) == 1 and r["zero_median_s"] > 0  # a warm start to its first answer (from zero)
    assert "warm/cold" in capsys.readouterr().out and (tmp_path / "startup.json").is_file()
