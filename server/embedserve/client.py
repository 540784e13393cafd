"""Python client for embedfleet servers, and `python -m embedserve.client TEXT...`.

In a cluster, target the headless Service as `dns:///NAME:50051`: the channel resolves every pod
and balances round-robin. Overload (RESOURCE_EXHAUSTED) is retried after the server's
retry-after-ms, with jitter, a bounded number of times; retries are marked so the servers do not
count them as new demand.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import grpc
import numpy as np

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [
    ("grpc.lb_policy_name", "round_robin"),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),  # we retry ourselves, honouring retry-after-ms
]


def retry_after_s(error: grpc.RpcError, default_s: float = 0.1) -> float:
    for key, value in error.trailing_metadata() or ():
        if key == "retry-after-ms":
            try:
                return max(0.0, float(value) / 1000)
            except ValueError:
                break
    return default_s


def decode_embeddings(response: pb.EmbedResponse) -> np.ndarray:
    return np.frombuffer(response.embeddings, dtype="<f4").reshape(tuple(response.shape))


class Client:
    """Async client. `max_attempts` bounds tries per call (1 = no retries)."""

    def __init__(self, target: str, max_attempts: int = 4, max_backoff_s: float = 2.0, timeout_s: float | None = 30.0):
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.max_attempts, self.max_backoff_s, self.timeout_s = max_attempts, max_backoff_s, timeout_s

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def embed(self, texts: list[str]) -> np.ndarray:
        return decode_embeddings(await self._call(self.stub.Embed, pb.EmbedRequest(texts=texts)))

    async def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(input_ids, dtype="<i4")
        mask = np.ascontiguousarray(attention_mask, dtype="<i4")
        request = pb.InferRequest(input_ids=ids.tobytes(), attention_mask=mask.tobytes(), shape=list(ids.shape))
        return decode_embeddings(await self._call(self.stub.Infer, request))

    async def health(self) -> pb.HealthCheckResponse:
        return await self.stub.HealthCheck(pb.HealthCheckRequest(), timeout=self.timeout_s)

    async def _call(self, method, request):
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await method(request, timeout=self.timeout_s, metadata=(("embedfleet-attempt", str(attempt)),))
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or attempt == self.max_attempts:
                    raise
                wait = min(self.max_backoff_s, retry_after_s(e))
                await asyncio.sleep(wait * random.uniform(1.0, 1.5))  # jitter spreads the retries


async def _cli(args) -> int:
    texts = list(args.texts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            texts += [line.rstrip("\n") for line in f if line.strip()]
    if not texts:
        print("no texts given", file=sys.stderr)
        return 2
    async with Client(args.target, timeout_s=args.timeout) as client:
        t0 = time.perf_counter()
        try:
            out = await client.embed(texts)
        except grpc.aio.AioRpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        ms = (time.perf_counter() - t0) * 1000
    print(f"{out.shape[0]} embeddings, dimension {out.shape[1]}, {ms:.1f} ms")
    for text, row in zip(texts, out):
        head = ", ".join(f"{v:+.4f}" for v in row[:5])
        print(f"  [{head}, ...]  {text[:60]!r}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m embedserve.client", description="Embed texts with an embedfleet server.")
    p.add_argument("texts", nargs="*", help="texts to embed")
    p.add_argument("--file", help="a file with one text per line")
    p.add_argument("--target", default="localhost:50051", help="host:port or dns:///name:port")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    return asyncio.run(_cli(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
