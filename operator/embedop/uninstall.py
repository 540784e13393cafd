"""`python -m embedop.uninstall [--namespace NS] [--timeout S]`: the chart's pre-delete hook.

Helm deletes neither the CRD (crds/ is install-only) nor the EmbeddingServices users created, so
without this an uninstall would leave every fleet's GPU pods running, unmanaged. It deletes every
EmbeddingService (in NS, else in all namespaces) with foreground propagation and waits until they
are gone: under foreground deletion a service disappears only after the garbage collector has
deleted what it owns (Deployment → ReplicaSets → pods, each with blockOwnerDeletion), so "gone"
means no server pod is left. It runs while the operator still runs (pre-delete hooks come before
the release's own objects go), though nothing here needs it: services carry no finalizer of ours.
Exit status 1 when some are still there at the timeout (helm uninstall then fails and says why;
`helm uninstall --no-hooks` skips this and leaves the services). Without the CRD (installed with
--skip-crds and never added, or deleted first, which deletes every service with it) there is
nothing to delete: exit status 0, so the uninstall goes on."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from embedop import crd
from embedop.kube import Kube, NotFound

# What the hook's own RBAC grants (the chart's hook Role; a test compares).
CALLS = {(crd.GROUP, crd.PLURAL, "list"), (crd.GROUP, crd.PLURAL, "delete")}


def _key(obj: dict) -> str:
    return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"


async def _services(kube: Kube, namespace: str | None) -> list[dict]:
    """The services there are; none when the API does not know the resource (404: the CRD has
    been deleted meanwhile, and every service with it)."""
    try:
        return await kube.list(crd.KIND, namespace)
    except NotFound:
        return []


async def uninstall(kube: Kube, namespace: str | None, timeout_s: float, poll_s: float = 1.0) -> list[str]:
    """Delete the services and wait. → those still present at the timeout."""
    deadline = time.monotonic() + timeout_s
    try:
        services = await kube.list(crd.KIND, namespace)
    except NotFound:
        print("the API has no EmbeddingService resource (no CRD): nothing to delete", flush=True)
        return []
    for svc in services:
        if not svc["metadata"].get("deletionTimestamp"):
            await kube.delete(crd.KIND, svc["metadata"]["namespace"], svc["metadata"]["name"], foreground=True)
            print(f"deleting EmbeddingService {_key(svc)}", flush=True)
    while left := [_key(s) for s in await _services(kube, namespace)]:
        if time.monotonic() >= deadline:
            return left
        await asyncio.sleep(poll_s)
    return []


async def _main(namespace: str | None, timeout_s: float) -> int:
    kube = Kube.connect()
    try:
        left = await uninstall(kube, namespace, timeout_s)
    finally:
        await kube.close()
    if left:
        print(f"still being deleted after {timeout_s:.0f} s: {', '.join(left)} "
              "(their pods may still be terminating; see kubectl describe)", file=sys.stderr)
        return 1
    print("no EmbeddingService left", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m embedop.uninstall", description=__doc__.splitlines()[0])
    p.add_argument("--namespace", "-n", help="only this namespace (default: all)")
    p.add_argument("--timeout", type=float, default=240, help="seconds to wait for the deletions (default 240)")
    args = p.parse_args(argv)
    return asyncio.run(_main(args.namespace, args.timeout))


if __name__ == "__main__":
    sys.exit(main())
