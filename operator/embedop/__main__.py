"""`python -m embedop [--namespace NS]`: run the operator (all namespaces by default)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

# Exit status of an operator that refuses to start, or stops on becoming the leader: another
# release's operator covers its scope.
REFUSED = 2
log = logging.getLogger("embedop")


async def _scope_check(settings, namespaces: list[str]) -> str | None:
    """scope.check with the operator's own client, before kopf starts (nothing written yet). The
    API not answering for ~30 s is an error (exit 1: the pod restarts), not a pass."""
    from embedop import scope
    from embedop.kube import Kube, Retryable

    kube = Kube.connect(settings.api_timeout_s)
    own = scope.own_claim(settings.pod_namespace, settings.scope_claim)
    try:
        for attempt in range(6):
            try:
                return await scope.check(kube, own, namespaces)
            except Retryable as e:
                if attempt == 5:
                    raise
                log.warning("checking other operators' scope claims: %s; again in 5 s", e)
                await asyncio.sleep(5)
    finally:
        await kube.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="embedop", description="The embedfleet operator.")
    p.add_argument("--namespace", "-n", action="append", help="watch only this namespace (repeatable)")
    p.add_argument("--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import kopf

    import embedop.handlers  # noqa: F401 - registers the handlers

    if refused := asyncio.run(_scope_check(embedop.handlers.SETTINGS, args.namespace or [])):
        log.error("%s", refused)
        return REFUSED
    kopf.run(
        # No kopf peering: it would pause kopf's handlers but not our own loops; a Lease elects
        # the one operator pod that acts (leader.py).
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace or [],
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(namespaces=args.namespace or []),  # the informers watch the same namespaces
        stop_flag=embedop.handlers.STOP,  # set on a refusal found at the start of a leadership term
    )
    return REFUSED if embedop.handlers.refusal else 0


if __name__ == "__main__":
    sys.exit(main())
