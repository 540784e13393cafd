"""`python -m bench.http_parse`: uvicorn's stock h11 protocol against ours, which parses what a
read brings 4 KiB a turn of the event loop (server/embedserve/transports/http_protocol.py), side
by side in one run.

Each protocol serves an app that reads the body and answers its length, in a process of its own
with a lag probe on its loop (sleep 5 ms, the longest overshoot kept). A client process sends, on
one connection each, `--rounds` of: an 8 MiB body with a Content-Length (the common large
request), and a 1 MiB body in 16-byte chunks (the hostile one). Prints the median time to the
answer of each and the longest loop stall, and ours over stock."""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import time

SERVE = "stock", "sliced"


def serve(kind: str, port_out, stall_out, stop) -> None:
    import asyncio

    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from embedserve.transports.http_protocol import SlicedH11Protocol

    async def app(scope, receive, send):
        size = 0
        while True:
            message = await receive()
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = str(size).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, lifespan="off", log_config=None,
                                http=SlicedH11Protocol if kind == "sliced" else H11Protocol)
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        port_out.send(sock.getsockname()[1])
        worst, loop = 0.0, asyncio.get_running_loop()
        while not stop.is_set():
            t0 = loop.time()
            await asyncio.sleep(0.005)
            worst = max(worst, loop.time() - t0 - 0.005)
            if stall_out.poll():  # asked for the worst since the last ask
                stall_out.recv()
                stall_out.send(worst)
                worst = 0.0
        server.should_exit = True
        await task

    asyncio.run(main())


def post(port: int, body: bytes, chunk: int) -> float:
    head = b"POST / HTTP/1.1\r\nHost: b\r\n%s\r\nConnection: close\r\n\r\n" % (
        b"Transfer-Encoding: chunked" if chunk else b"Content-Length: %d" % len(body))
    wire = head + (b"".join(b"%x\r\n%s\r\n" % (chunk, body[i:i + chunk]) for i in range(0, len(body), chunk))
                   + b"0\r\n\r\n" if chunk else body)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(wire)
        reply = b""
        while data := sock.recv(65536):
            reply += data
    assert reply.endswith(str(len(body)).encode()), reply[-100:]
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cases = {"8 MiB, Content-Length": (b"a" * (8 << 20), 0), "1 MiB, 16-byte chunks": (b"a" * (1 << 20), 16)}
    results = {}
    for kind in SERVE:
        port_in, port_out = multiprocessing.Pipe(duplex=False)
        stall_here, stall_there = multiprocessing.Pipe()
        stop = multiprocessing.Event()
        proc = multiprocessing.Process(target=serve, args=(kind, port_out, stall_there, stop))
        proc.start()
        port = port_in.recv()
        for name, (body, chunk) in cases.items():
            stall_here.send("reset")
            stall_here.recv()
            times = [post(port, body, chunk) for _ in range(args.rounds)]
            stall_here.send("worst")
            results[kind, name] = statistics.median(times), stall_here.recv()
        stop.set()
        proc.join()
    print(f"{'case':<24}{'stock s':>9}{'sliced s':>10}{'ratio':>7}{'stock stall ms':>16}{'sliced stall ms':>17}")
    for name in cases:
        (ts, ss), (tn, sn) = results["stock", name], results["sliced", name]
        print(f"{name:<24}{ts:>9.3f}{tn:>10.3f}{tn / ts:>7.2f}{ss * 1e3:>16.0f}{sn * 1e3:>17.0f}")


if __name__ == "__main__":
    main()
