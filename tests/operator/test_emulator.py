"""The test double itself, where it must behave as a real API server and kmock alone does not."""

from __future__ import annotations

import asyncio

import aiohttp
from kmock._internal.rendering import Request

from tests.operator.emulator import new_service, service_path

NS = "emulated"


def test_a_watch_sees_what_is_created_while_it_streams_the_existing_objects(emulator):
    """A real watch resumes from its list's resourceVersion and misses nothing. kmock's streamed
    the existing objects first and only then began following new events: a service created in
    between was never seen, and the operator never made its Deployment (a CI failure)."""
    for name in ("early-a", "early-b"):
        emulator.request("POST", service_path(NS), new_service(name, {"model": "m"}, namespace=NS))
    k8s = emulator.k8s
    resource = next(key[0] for key in k8s._objects if key[0].plural == "embeddingservices")

    async def scenario() -> set[str]:
        watch = k8s._serve_watch(Request(resource=resource, namespace=NS))
        assert await anext(watch) == b""
        await anext(watch)  # the first existing object; the watch is now mid-snapshot
        async with aiohttp.ClientSession() as session:
            # As the tests' own writes are told apart from the operator's (emulator: by User-Agent).
            async with session.post(emulator.url + service_path(NS), json=new_service("late", {"model": "m"}, namespace=NS),
                                    headers={"User-Agent": "Python-urllib/3.11 (a test)"}) as reply:
                assert reply.ok, await reply.text()
        seen = set()
        try:
            while "late" not in seen:  # a lost event: no further one comes, and the wait times out
                seen.add((await asyncio.wait_for(anext(watch), 10))["object"]["metadata"]["name"])
        finally:
            await watch.aclose()
        return seen

    seen = asyncio.run_coroutine_threadsafe(scenario(), emulator._loop).result(30)
    assert seen == {"early-b", "late"}
