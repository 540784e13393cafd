"""`python -m bench.overload RATE [RATE ...]`: the accepted requests' latency under open-loop
load on `python -m embedserve` (defaults, the packaged model), at the client and inside the
server (`embedfleet-server-ms`), side by side: where an accepted P99 past the drain budget + one
batch comes from (the server's queue, or the load generator sharing the machine), and the
device's busy fraction meanwhile. Single-text
requests of the side-by-side corpus, Poisson arrivals for 15 s per rate, 3 s of warm-up first.
For 2x overload pass twice the saturation requests/s of `python -m bench`."""

from __future__ import annotations

import asyncio
import sys

import grpc
import numpy as np

from bench.corpus import corpus
from bench.loadgen import call, open_loop
from bench.serve_vs_offline import model_max_length
from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, counter


async def measure(server: ServerProcess, texts: list[str], tokens: list[int], rates: list[float]) -> None:
    target = server.target
    async with grpc.aio.insecure_channel(target) as channel:
        stub, rng = pb_grpc.InferenceStub(channel), np.random.default_rng(7)

        async def send():
            i = int(rng.integers(0, len(texts)))
            return await call(stub.Embed, pb.EmbedRequest(texts=[texts[i]]), tokens[i], 60)

        await open_loop(send, 50, 3)
        print(f"{'rate/s':>7}{'sent':>6}{'ok':>6}{'ok tok/s':>9}{'client p50/p99 ms':>19}{'server p50/p99 ms':>19}"
              f"{'busy':>6}")
        for rate in rates:
            busy0 = counter(server.http, "embedfleet_model_busy_seconds_total")
            outcomes, elapsed = await open_loop(send, rate, 15)
            busy = (counter(server.http, "embedfleet_model_busy_seconds_total") - busy0) / elapsed
            ok = [o for o in outcomes if o.code == "OK"]
            client = np.array([o.latency_s * 1000 for o in ok])
            inside = np.array([o.server_ms for o in ok if o.server_ms is not None])
            print(f"{rate:>7.0f}{len(outcomes):>6}{len(ok):>6}{sum(o.tokens for o in ok) / elapsed:>9.0f}"
                  f"{np.percentile(client, 50):>10.0f} / {np.percentile(client, 99):<6.0f}"
                  f"{np.percentile(inside, 50):>10.0f} / {np.percentile(inside, 99):<6.0f}{busy:>6.2f}")


def main(argv: list[str]) -> int:
    from transformers import AutoTokenizer

    from embedserve.model_source import packaged_model_dir

    model_dir = str(packaged_model_dir())
    tok, limit = AutoTokenizer.from_pretrained(model_dir), model_max_length(model_dir)
    texts = corpus(600, seed=3)
    tokens = [len(tok(t, truncation=True, max_length=limit)["input_ids"]) for t in texts]
    server = ServerProcess({"BATCH_CAPS": ""}).wait_ready(600)
    try:
        asyncio.run(measure(server, texts, tokens, [float(r) for r in argv] or [230.0]))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
