"""`python -m embedserve.prefetch`: download what serving needs of MODEL_PATH (at MODEL_REVISION)
into MODEL_CACHE_DIR, print the directory it resolved to, and exit: 0 when the model is there,
REFUSED (3) with the reason when asking again cannot help (no such repository, revision, file,
bucket or directory; credentials refused; a bad setting), 1 when it may pass (a connection reset,
a hub 5xx or 429, a timeout; also any traceback, Python's own exit status 1). The operator's fill
Job runs it in the server image with the servers' own environment, so that pods mounting the
filled cache read-only (HF_HUB_OFFLINE=1) find exactly the layout they look for; it fails at once
on REFUSED and retries on anything else.

With QUANTIZE_RANGE=calibrated it also computes the model's calibration for int8/uint8
(embedserve.calibrate: the corpus's float32 vectors on the CPU, a float32 copy of the weights in
its memory, whatever the model's size) into the cache, keyed by the model's revision and how it is
served, so every pod of the revision reads the same one. A calibration that fails (a model that
cannot run on a CPU, say) is a warning, and the exit 0: the model is fetched, and retrying would
fail the same way forever; pods then say at start-up what is missing."""

from __future__ import annotations

import sys

from embedserve.config import ConfigError, Settings
from embedserve.model.declared import DeclarationError
from embedserve.model.source import ModelSourceError, resolve

# The fill Job's podFailurePolicy fails the Job at once on this code (operator/embedop/
# render_cache.py PREFETCH_REFUSED, which must equal it: the operator's image does not hold this
# package). Not 1, which is every uncaught exception's, nor 2, the interpreter's usage error.
REFUSED = 3
FAILED = 1


def main() -> int:
    try:
        s = Settings.from_env()
        if s.model_path.startswith("sim:"):
            print("MODEL_PATH is a simulated device: nothing to fetch")
            return 0
        path = resolve(s.model_path, s.model_cache_dir, s.trust_remote_code, s.model_revision)
        if s.quantize_calibrated:
            calibrate_into_cache(s)
    except (ConfigError, ModelSourceError, DeclarationError) as e:
        print(f"prefetch failed: {e}", file=sys.stderr)
        return FAILED if isinstance(e, ModelSourceError) and not e.permanent else REFUSED
    print(path)
    return 0


def calibrate_into_cache(s: Settings) -> None:
    """QUANTIZE_RANGE=calibrated: the calibration in MODEL_CACHE_DIR (read if there, else computed
    and saved), as a server with these settings would look for it."""
    from embedserve import calibrate
    from embedserve.prepare import prepare

    prepared = prepare(s)  # the model is in the cache now: no network call
    if prepared.task != "embed":
        print(f"QUANTIZE_RANGE=calibrated: a {prepared.task} model has no int8/uint8 encodings, nothing to calibrate",
              file=sys.stderr)
        return
    try:
        calibrate.calibrated(s, prepared, max_compute_bytes=None)
    except Exception as e:  # noqa: BLE001 - the model is fetched: a Job retried on this would fail forever
        print(f"prefetch: warning: QUANTIZE_RANGE=calibrated: the calibration was not computed "
              f"({type(e).__name__}: {e}); the model is fetched, and servers find no calibration in the cache",
              file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
