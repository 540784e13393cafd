"""`python -m bench.host_path`: what one server process costs per request, beside what gRPC
itself costs. Side by side in one run, alternating, on this machine:

(a) bare: a grpc.aio server of the same proto whose Embed returns a constant vector (the
    transport's own cost: the ceiling for any Python server on this machine);
(b) embedserve with a free simulated device (MODEL_PATH=sim:1e12): every host-side step of a
    request (validation, admission, tokenization, batching, routing, metrics), no model time.

Single-text Embed requests, closed loop at concurrency C from a separate client process. Prints
requests/s of each and the ratio (b)/(a); the target is >= 0.6. `--api-key` gives (b) an API key
(API_KEYS) that its client sends; `--tls` serves (b) over TLS (a throwaway CA, trustme), its
client verifying it: what each costs, against the same bare server.
Usage: python -m bench.host_path [--seconds 8] [--concurrency 64] [--rounds 2] [--server-env K=V ...]
       [--api-key KEY] [--tls]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BARE = """
import asyncio, sys
import grpc, numpy as np
from embedfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc

VECTOR = np.zeros(384, "<f4").tobytes()

class Bare(pb_grpc.InferenceServicer):
    async def Embed(self, request, context):
        return pb.EmbedResponse(embeddings=VECTOR * len(request.texts), shape=[len(request.texts), 384])

async def main():
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_InferenceServicer_to_server(Bare(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""

CLIENT = """
import asyncio, json, sys, time
import grpc
from embedfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc

async def main(target, seconds, concurrency, key, ca_file):
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    credentials = grpc.ssl_channel_credentials(open(ca_file, "rb").read()) if ca_file else None
    channel = grpc.aio.secure_channel(target, credentials) if credentials else grpc.aio.insecure_channel(target)
    async with channel:
        stub = pb_grpc.InferenceStub(channel)
        await stub.Embed(pb.EmbedRequest(texts=["warm up"]), metadata=metadata)
        done, errors = [0], [0]
        stop = time.perf_counter() + seconds

        async def caller(k):
            i = 0
            while time.perf_counter() < stop:
                i += 1
                try:
                    await stub.Embed(pb.EmbedRequest(texts=[f"what is request {k}.{i} about"]), metadata=metadata)
                    done[0] += 1
                except grpc.aio.AioRpcError:
                    errors[0] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(caller(k) for k in range(concurrency)))
        print(json.dumps({"rps": done[0] / (time.perf_counter() - t0), "errors": errors[0]}))

asyncio.run(main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]))
"""


def load(target: str, seconds: float, concurrency: int, key: str = "", ca_file: str = "") -> dict:
    out = subprocess.run([sys.executable, "-c", CLIENT, target, str(seconds), str(concurrency), key, ca_file],
                         capture_output=True, text=True, timeout=seconds + 120)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--server-env", action="append", default=[], metavar="K=V")
    p.add_argument("--json")
    p.add_argument("--api-key", default="", help="serve with this API key (API_KEYS); the client sends it")
    p.add_argument("--tls", action="store_true", help="serve over TLS (a throwaway CA); the client verifies it")
    args = p.parse_args(argv)
    from tests.conftest import ServerProcess

    guards, ca_file = {"API_KEYS": args.api_key} if args.api_key else {}, ""
    if args.tls:
        from tests.server.mounted_secret import Pki

        pki_dir = tempfile.mkdtemp(prefix="host-path-tls-")
        files = Pki(Path(pki_dir)).server_files()
        for name in ("tls.crt", "tls.key"):
            (Path(pki_dir) / name).write_bytes(files[name])
        guards |= {"TLS_CERT_FILE": f"{pki_dir}/tls.crt", "TLS_KEY_FILE": f"{pki_dir}/tls.key"}
        ca_file = f"{pki_dir}/ca.pem"

    bare = subprocess.Popen([sys.executable, "-c", BARE], stdout=subprocess.PIPE, text=True)
    bare_target = f"127.0.0.1:{bare.stdout.readline().strip()}"
    # The server's defaults (BATCH_CAPS measured at warm-up), a device with no time of its own.
    env = {"MODEL_PATH": "sim:1e12", "MAX_DRAIN_TIME_MS": "600000", "LOG_LEVEL": "WARNING", "BATCH_CAPS": "",
           **guards, **dict(kv.split("=", 1) for kv in args.server_env)}
    ours = ServerProcess(env).wait_ready(300)
    runs: dict[str, list[float]] = {"bare": [], "embedserve": []}
    try:
        for _ in range(args.rounds):  # alternating: both see the same minutes of this machine
            for name, target in (("bare", bare_target), ("embedserve", ours.target)):
                r = load(target, args.seconds, args.concurrency,
                         *((args.api_key, ca_file) if name == "embedserve" else ("", "")))
                runs[name].append(r["rps"])
                print(f"  {name:<11} {r['rps']:8.0f} requests/s  ({r['errors']} errors)", flush=True)
                time.sleep(0.5)
    finally:
        ours.stop()
        bare.kill()
    best = {k: max(v) for k, v in runs.items()}
    ratio = best["embedserve"] / best["bare"]
    print(f"\nsingle-text requests/s, C={args.concurrency}: bare grpc.aio {best['bare']:.0f}, "
          f"embedserve (free device{', API key' if args.api_key else ''}{', TLS' if args.tls else ''}) "
          f"{best['embedserve']:.0f}; ratio {ratio:.2f} (target >= 0.6)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "best": best, "ratio": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
