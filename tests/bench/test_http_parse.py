"""bench.http_parse runs both protocols side by side and every body is answered with its length
(its own check); the figures are the bench's, never asserted here."""

import subprocess
import sys


def test_the_http_parse_bench_runs_both_protocols():
    out = subprocess.run([sys.executable, "-m", "bench.http_parse", "--rounds", "1"], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    assert "8 MiB, Content-Length" in out and "1 MiB, 16-byte chunks" in out, out
