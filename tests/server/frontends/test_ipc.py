"""The link between front ends and the model process (embedserve.frontends.ipc), on a real ZeroMQ socket,
and the request key a retry is matched by, which must not depend on the process."""

import asyncio
import json
import os
import subprocess
import sys

import zmq

from embedserve.frontends import ipc
from embedserve.batching.shaping import content_key

REPLIES = 5000  # past ZeroMQ's default high-water marks (1000 per side)


async def test_no_reply_is_dropped_while_a_front_end_reads_nothing(tmp_path):
    """A front end whose event loop is busy reads no replies for a while; the model process
    answers thousands meanwhile. At ZeroMQ's default high-water marks the ROUTER drops what
    does not fit, silently, and those requests would never be answered."""
    answered = 0
    all_answered = asyncio.Event()

    async def echo(header, payload):
        nonlocal answered
        answered += 1
        if answered == REPLIES:
            all_answered.set()
        return {"n": header["n"]}, bytes(payload)

    path = str(tmp_path / "door.ipc")
    door, link = ipc.Door(path, {"echo": echo}), ipc.Link(path)
    door.start()
    try:
        for n in range(REPLIES):  # the link's receiver is not started: nothing reads the replies
            await link.socket.send_multipart([json.dumps({"op": "echo", "id": n + 1, "n": n}).encode(), b"x" * 1024])
        await asyncio.wait_for(all_answered.wait(), 60)
        got = set()
        while await link.socket.poll(1000, zmq.POLLIN):
            header, _ = await link.socket.recv_multipart()
            got.add(json.loads(header)["n"])
        assert len(got) == REPLIES
    finally:
        await link.close()
        await door.close()


def test_a_requests_key_is_the_same_in_every_process():
    """A marked retry may land on another front end: its key must find the booking there."""
    code = ("from embedserve.batching.shaping import Limits, content_key, texts_request; "
            "print(content_key(True, 'query: ', 'a text', b'raw', 3), "
            "texts_request(['a text', 'another'], Limits(8, 256, True), None, None, None).key)")
    keys = {subprocess.check_output([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}).strip()
            for seed in ("1", "2", "random")}
    assert len(keys) == 1
    assert int(keys.pop().split()[0]) == content_key(True, "query: ", "a text", b"raw", 3)
    assert content_key(True, "", "ab") != content_key(True, "", "a", "b")  # parts are delimited


async def test_once_the_model_process_is_gone_every_call_fails_at_once(tmp_path):
    """A front end whose model process died: calls waiting, and calls made later (a request
    still tokenizing then), raise at once. Sent, a later one would wait in ZeroMQ's queue for a
    peer that never comes back, and its caller with it."""
    link = ipc.Link(str(tmp_path / "nobody.ipc"))  # no door: nothing will ever answer
    try:
        waiting = asyncio.ensure_future(link.call({"op": "rows"}))
        while link.pending == 0:
            await asyncio.sleep(0)
        link.fail_all(RuntimeError("gone"))
        for call in (waiting, link.call({"op": "rows"})):
            try:
                await asyncio.wait_for(call, 5)
                raise AssertionError("answered by nobody")
            except RuntimeError as e:
                assert str(e) == "gone"
    finally:
        await link.close()
