"""Warm start on real servers (the packaged model on CPU), in both modes: a first start (FRONTENDS=2)
measures its warm-up and saves it under MODEL_CACHE_DIR; the next (one process) reuses it (no
sweep in its log, the same caps, the same vectors), and each says which in /health. The model-level
cases (other keys, damaged files, the probe) are tests/server/model/test_warm_start.py."""

import json
import re
import urllib.request

from tests.conftest import ServerProcess

SWEEP = re.compile(r"bucket \d+: batch cap \d+ rows \(sweep")
CAPS = re.compile(r"batch caps per bucket: (\{.*\})")


def embed(server: ServerProcess, text: str) -> list[float]:
    with urllib.request.urlopen(server.http + "/v1/models", timeout=30) as r:
        (model,) = [m["id"] for m in json.loads(r.read())["data"]]
    request = urllib.request.Request(server.http + "/v1/embeddings", method="POST",
                                     data=json.dumps({"model": model, "input": [text]}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())["data"][0]["embedding"]


def test_the_next_start_reuses_the_first_ones_warm_up_in_the_other_mode(tmp_path):
    env = {"WARM_START": "true", "MODEL_CACHE_DIR": str(tmp_path)}
    first = ServerProcess({**env, "FRONTENDS": "2"}).wait_ready()
    try:
        assert first.health()[1]["warmup"] == "measured"  # the model process's, through a front end
        expected = embed(first, "warm start")
    finally:
        first.stop()
    (saved,) = (tmp_path / "embedfleet-warmup").glob("*.json")
    assert SWEEP.search(first.log()) and f"saved to {saved}" in first.log()
    caps = CAPS.search(first.log()).group(1)

    # The other mode reuses it: what a warm start does is the model process's in both modes, and
    # /health carrying its state through front ends was seen above (a third start would add ~15 s).
    again = ServerProcess({**env, "FRONTENDS": "1"})
    try:
        again.wait_ready()
        assert again.health()[1]["warmup"] == "reused"
        log = again.log()
        assert f"reused the warm-up measured before ({saved})" in log and not SWEEP.search(log)
        assert CAPS.search(log).group(1) == caps
        assert embed(again, "warm start") == expected
    finally:
        again.stop()
