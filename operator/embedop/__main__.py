"""`python -m embedop [--namespace NS]`: run the operator (all namespaces by default)."""

from __future__ import annotations

import argparse
import logging
import sys


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

    kopf.run(
        # No kopf peering: it would pause kopf's handlers but not our own loops; a Lease elects
        # the one operator pod that acts (leader.py).
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace or [],
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(namespaces=args.namespace or []),  # the informers watch the same namespaces
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
