"""`python -m embedserve.prefetch`: download what serving needs of MODEL_PATH (at MODEL_REVISION)
into MODEL_CACHE_DIR, print the directory it resolved to, and exit: 0 when the model is there, 1
with the reason when it cannot be fetched. The operator's fill Job runs it in the server image with
the servers' own environment, so that pods mounting the filled cache read-only (HF_HUB_OFFLINE=1)
find exactly the layout they look for."""

from __future__ import annotations

import sys

from embedserve.config import ConfigError, Settings
from embedserve.model.source import ModelSourceError, resolve


def main() -> int:
    try:
        s = Settings.from_env()
        if s.model_path.startswith("sim:"):
            print("MODEL_PATH is a simulated device: nothing to fetch")
            return 0
        path = resolve(s.model_path, s.model_cache_dir, s.trust_remote_code, s.model_revision)
    except (ConfigError, ModelSourceError) as e:
        print(f"prefetch failed: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
