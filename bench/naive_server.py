"""The naive baseline: the usual "FastAPI wrapper" design behind our own gRPC transport — a
count-based dynamic batcher that takes requests in arrival order (up to N texts, or whatever came
within W ms), pads the batch to its longest row, and runs it. No length buckets, no admission.

    python -m bench.naive_server --port 50061 [--max-batch 32] [--wait-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import threading

import grpc
import numpy as np
import torch

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class NaiveBatcher:
    def __init__(self, max_batch: int, wait_s: float):
        from transformers import AutoModel, AutoTokenizer

        from embedserve.model.source import packaged_model_dir

        d = str(packaged_model_dir())
        self.tok = AutoTokenizer.from_pretrained(d)
        self.model = AutoModel.from_pretrained(d, dtype=torch.float32).eval()
        self.max_batch, self.wait_s = max_batch, wait_s
        self.inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            items = [self.inbox.get()]
            n = len(items[0][0])
            deadline = self.wait_s
            while n < self.max_batch:
                try:
                    item = self.inbox.get(timeout=deadline)
                except queue.Empty:
                    break
                items.append(item)
                n += len(item[0])
            texts = [t for item in items for t in item[0]]
            try:
                enc = self.tok(texts, truncation=True, max_length=512, padding=True, return_tensors="pt")
                with torch.inference_mode():
                    hidden = self.model(**enc).last_hidden_state
                    mask = enc["attention_mask"].unsqueeze(-1).float()
                    out = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
                pos = 0
                for texts_i, loop, fut in items:
                    loop.call_soon_threadsafe(fut.set_result, out[pos : pos + len(texts_i)])
                    pos += len(texts_i)
            except Exception as e:  # noqa: BLE001
                for _, loop, fut in items:
                    loop.call_soon_threadsafe(fut.set_exception, e)

    async def embed(self, texts: list[str]) -> np.ndarray:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.inbox.put((texts, loop, fut))
        return await fut


class Servicer(pb_grpc.InferenceServicer):
    def __init__(self, batcher: NaiveBatcher):
        self.batcher = batcher

    async def Embed(self, request, context):
        out = await self.batcher.embed(list(request.texts))
        return pb.EmbedResponse(embeddings=out.astype("<f4").tobytes(), shape=out.shape)

    async def HealthCheck(self, request, context):
        return pb.HealthCheckResponse(status="healthy", accepting_requests=True)


async def serve(port: int, max_batch: int, wait_ms: float) -> None:
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(Servicer(NaiveBatcher(max_batch, wait_ms / 1000)), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--wait-ms", type=float, default=5.0)
    a = p.parse_args()
    asyncio.run(serve(a.port, a.max_batch, a.wait_ms))
