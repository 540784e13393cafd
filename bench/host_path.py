"""`python -m bench.host_path`: what one server process costs per request, beside what gRPC
itself costs. Side by side in one run, alternating, on this machine:

(a) bare: a grpc.aio server of the same proto whose Embed returns a constant vector (the
    transport's own cost: the ceiling for any Python server on this machine);
(b) embedserve with a free simulated device (MODEL_PATH=sim:1e12): every host-side step of a
    request (validation, admission, tokenization, batching, routing, metrics), no model time.

Single-text Embed requests, closed loop at concurrency C from a separate client process. Prints
requests/s of each and the ratio (b)/(a); the target is >= 0.6.
`--variants off,keys,tls,trace` adds a server with API keys, TLS or OpenTelemetry tracing (to a
loopback OTLP sink) switched on, alternated with the rest, and prints each one's rate beside `off`.
Usage: python -m bench.host_path [--seconds 8] [--concurrency 64] [--rounds 2] [--variants off,...] [--server-env K=V ...]
"""

from __future__ import annotations

import argparse
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
    # A variant's client side: a key in every call's metadata, TLS with the test CA.
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    if ca_file:
        creds = grpc.ssl_channel_credentials(root_certificates=open(ca_file, "rb").read())
        channel = grpc.aio.secure_channel(target, creds)
    else:
        channel = grpc.aio.insecure_channel(target)
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


class Variant:
    """One server of the comparison: `off` is the server as configured; `keys`, `tls` and `trace`
    switch on one guard each (issue 29), so that what each costs is printed beside `off`."""

    def __init__(self, name: str, env: dict, workdir: Path):
        self.name, self.key, self.ca_file, self.sink = name, "", "", None
        env = dict(env)
        if name == "keys":
            self.key = "bench-key-0123456789abcdef"
            env["API_KEYS"] = f"another-key,{self.key}"
        elif name == "tls":
            import trustme

            ca = trustme.CA()
            cert = ca.issue_cert("127.0.0.1", "localhost")
            (workdir / "tls.crt").write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
            cert.private_key_pem.write_to_path(str(workdir / "tls.key"))
            ca.cert_pem.write_to_path(str(workdir / "ca.pem"))
            env.update(TLS_CERT_FILE=str(workdir / "tls.crt"), TLS_KEY_FILE=str(workdir / "tls.key"))
            self.ca_file = str(workdir / "ca.pem")
        elif name == "trace":
            self.sink = OtlpSink()
            env.update(OTEL_EXPORTER_OTLP_ENDPOINT=self.sink.url, OTEL_TRACES_SAMPLER="always_on")
        elif name != "off":
            raise SystemExit(f"unknown variant {name!r}: off, keys, tls, trace")
        from tests.conftest import ServerProcess

        self.server = ServerProcess(env)

    def run(self, seconds: float, concurrency: int) -> dict:
        return load(self.server.target, seconds, concurrency, self.key, self.ca_file)

    def stop(self) -> None:
        self.server.stop()
        if self.sink:
            self.sink.stop()


class OtlpSink:
    """An OTLP/HTTP endpoint that accepts every export and keeps nothing: the exporter's real
    work (encoding, a POST per batch) without a collector."""

    def __init__(self):
        import http.server
        import threading

        class Accept(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Accept)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--server-env", action="append", default=[], metavar="K=V")
    p.add_argument("--variants", default="off", help="comma-separated: off, keys, tls, trace (off first)")
    p.add_argument("--json")
    args = p.parse_args(argv)

    bare = subprocess.Popen([sys.executable, "-c", BARE], stdout=subprocess.PIPE, text=True)
    bare_target = f"127.0.0.1:{bare.stdout.readline().strip()}"
    # The server's defaults (BATCH_CAPS measured at warm-up), a device with no time of its own.
    env = {"MODEL_PATH": "sim:1e12", "MAX_DRAIN_TIME_MS": "600000", "LOG_LEVEL": "WARNING", "BATCH_CAPS": "",
           **dict(kv.split("=", 1) for kv in args.server_env)}
    names = args.variants.split(",")
    runs: dict[str, list[float]] = {"bare": [], **{n: [] for n in names}}
    with tempfile.TemporaryDirectory() as workdir:
        variants = [Variant(n, env, Path(workdir)) for n in names]
        try:
            for v in variants:
                v.server.wait_ready(300)
            for _ in range(args.rounds):  # alternating: all see the same minutes of this machine
                for name, run in (("bare", lambda: load(bare_target, args.seconds, args.concurrency)),
                                  *((v.name, lambda v=v: v.run(args.seconds, args.concurrency)) for v in variants)):
                    r = run()
                    runs[name].append(r["rps"])
                    print(f"  {name:<11} {r['rps']:8.0f} requests/s  ({r['errors']} errors)", flush=True)
                    time.sleep(0.5)
        finally:
            for v in variants:
                v.stop()
            bare.kill()
    best = {k: max(v) for k, v in runs.items()}
    ratio = best[names[0]] / best["bare"]
    print(f"\nsingle-text requests/s, C={args.concurrency}: bare grpc.aio {best['bare']:.0f}, "
          f"embedserve (free device) {best[names[0]]:.0f}; ratio {ratio:.2f} (target >= 0.6)")
    for n in names[1:]:
        print(f"  with {n:<6} {best[n]:8.0f} requests/s: {best[n] / best[names[0]]:.2f} of {names[0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "best": best, "ratio": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
