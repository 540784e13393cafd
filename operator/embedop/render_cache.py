"""spec.modelCache → the pod's model cache volumes, mounts and server settings, and the Job that
fills a pre-filled claim. Pure: dicts in, dicts out.

Four kinds (`kind`):
- emptyDir (no claim, no image): each pod downloads into its own cache of sizeLimit;
- claim: an existing PersistentVolumeClaim, mounted read-write; ReadWriteMany lets every pod on
  every node share it: the first pod downloads, later ones find the model (the server's source
  reads a fetched model back with no network call; concurrent downloads are safe, huggingface_hub
  locks each file);
- prefilled (claim + prefill): the operator fills the claim once per model revision with a Job
  running the server image's `python -m embedserve.prefetch`; the server pods mount it read-only,
  with HF_HUB_OFFLINE=1, and are not rolled onto a revision before its Job has succeeded;
- image: a Kubernetes image volume (an OCI artifact holding the model, as KServe's modelcar),
  mounted read-only; MODEL_PATH is the mounted directory, and the cache stays a writable emptyDir
  (the warm-start file and torch.compile caches live there).
"""

from __future__ import annotations

import hashlib
import json

from embedop import render_models

MODEL_CACHE = "/models"  # MODEL_CACHE_DIR
MODEL_IMAGE = "/model-image"  # where an image volume's artifact is mounted
CACHE_VOLUME, IMAGE_VOLUME = "model-cache", "model-image"
FILL_LABEL = "embedfleet.dev/model-cache-fill"  # on fill Jobs and their pods: the digest they fill for
# The settings that decide what a fill downloads: a Job (its pod template immutable) per distinct set.
FILLED_BY = ("MODEL_PATH", "MODEL_REVISION", "TRUST_REMOTE_CODE")
# The cache's layout as the server's model source writes and reads it (hub snapshots, the s3://
# marker): part of the fill digest, so that a server whose layout changes (raise this with it)
# gets its claims filled again rather than pods that find nothing they can read.
FILL_LAYOUT = 1
# What the fill Job's container gets of the server's environment: the fill settings above, where
# they go, and progress bars off. Nothing else the operator renders for serving: the files of
# spec.auth and spec.tls (API_KEYS_FILE, TLS_*) live in Secret volumes the Job does not mount, and
# prefetch's Settings.from_env would refuse to start on a file it cannot open; the batching and
# admission settings mean nothing to a download.
FILL_ENV = (*FILLED_BY, "MODEL_CACHE_DIR", "HF_HUB_DISABLE_PROGRESS_BARS")
# Of spec.env, what the Job does not get: the server's own files (mounted only in server pods),
# and offline mode (the Job is the one that goes online).
NOT_FOR_FILL = ("API_KEYS_FILE", "TLS_CERT_FILE", "TLS_KEY_FILE", "TLS_CLIENT_CA_FILE", "HF_HUB_OFFLINE")
FILL_BACKOFF_LIMIT = 4
FILL_DEADLINE_S = 6 * 3600  # a download that runs longer than this has failed
# prefetch's exit status for a fill that cannot succeed by retrying (no such repository, revision,
# file, bucket or path; credentials refused; a bad setting): the Job fails at once rather than
# after FILL_BACKOFF_LIMIT pods. Anything else (1: a connection reset, a hub 5xx or 429, a
# timeout, any traceback) is retried. Must equal server/embedserve/prefetch.py's REFUSED: the
# operator's image does not hold the server package to import it from (a test compares the two).
PREFETCH_REFUSED = 3


SHARED = "ModelCacheShared"  # the condition: whether every pod can mount the claim, on any node


def claim_access(spec: dict, claim: dict | None, pods: list[dict] = ()) -> tuple[bool | None, str, str] | None:
    """The ModelCacheShared condition of a spec that mounts a claim (kinds claim and prefilled),
    from the claim's access modes (those of the bound volume, else those asked for): (True,
    False or None for Unknown; reason: the mode; message naming the claim and what the mode does
    to the pods). Never a refusal: a ReadWriteOnce claim serves pods on one node. `pods`: the
    server pods (how many nodes they run on). None: the spec mounts no claim."""
    cache = spec["modelCache"]
    if kind(cache) not in ("claim", "prefilled"):
        return None
    name, prefilled = cache["claimName"], kind(cache) == "prefilled"
    if claim is None:
        return None, "ClaimNotFound", f"claim {name} does not exist: pods that mount it stay Pending until it does"
    modes = set((claim.get("status") or {}).get("accessModes") or (claim.get("spec") or {}).get("accessModes") or [])
    nodes = {n for p in pods if (n := (p.get("spec") or {}).get("nodeName"))}
    counted = "the autoscaler counts them as capacity on its way"
    if "ReadWriteMany" in modes:
        return True, "ReadWriteMany", f"claim {name} is ReadWriteMany: every pod mounts it, on any node"
    if modes == {"ReadOnlyMany"}:
        if prefilled:
            return (False, "ReadOnlyMany", f"claim {name} is ReadOnlyMany: every pod reads it, on any node, but the fill "
                    "Job cannot write it: fill it out of band and drop modelCache.prefill (docs/operator.md)")
        return True, "ReadOnlyMany", f"claim {name} is ReadOnlyMany: every pod reads it, on any node"
    if "ReadWriteOnce" in modes:
        # A count, not the nodes' names: the message is rewritten (a status write) when it changes.
        where = f"; the pods now run on {len(nodes)} nodes" if len(nodes) > 1 else ""
        return (False, "ReadWriteOnce", f"claim {name} is ReadWriteOnce: it is attached to one node at a time; pods "
                f"scheduled on another (and a fill Job there) wait in ContainerCreating (Multi-Attach) and {counted}. "
                f"It works with every pod on one node (a single-node cluster, a nodeSelector); to spread the pods, use a "
                f"ReadWriteMany claim{where}")
    if "ReadWriteOncePod" in modes:
        return (False, "ReadWriteOncePod", f"claim {name} is ReadWriteOncePod: one pod at a time mounts it; a second "
                f"server pod (a scale-up, a rollout's surge){' or the fill Job while a server pod runs' if prefilled else ''} "
                f"stays Pending and {counted}. It serves one replica; use a ReadWriteMany claim for more")
    return None, "AccessModesUnknown", f"claim {name} states no access mode ({sorted(modes)}): whether pods on several nodes can mount it is unknown"


def kind(cache: dict) -> str:
    if cache.get("image"):
        return "image"
    if cache.get("claimName"):
        return "prefilled" if cache.get("prefill") else "claim"
    return "emptyDir"


def problems(spec: dict) -> list[str]:
    cache = spec["modelCache"]
    out = []
    if cache.get("image") and cache.get("claimName"):
        out.append("modelCache: image and claimName are exclusive (the image holds the model; the cache stays an emptyDir)")
    if cache.get("prefill") and not cache.get("claimName"):
        out.append("modelCache.prefill needs claimName: the claim the fill Job writes and the pods read")
    path = (cache.get("image") or {}).get("path") or ""
    if path.startswith("/") or ".." in path.split("/"):
        out.append(f"modelCache.image.path {path!r}: a relative path inside the image, without ..")
    return out


def volumes(spec: dict) -> list[dict]:
    cache = spec["modelCache"]
    k = kind(cache)
    if k in ("claim", "prefilled"):
        claim = {"claimName": cache["claimName"], **({"readOnly": True} if k == "prefilled" else {})}
        return [{"name": CACHE_VOLUME, "persistentVolumeClaim": claim}]
    out = [{"name": CACHE_VOLUME, "emptyDir": {"sizeLimit": str(cache["sizeLimit"])}}]
    if k == "image":
        image = cache["image"]
        out.append({"name": IMAGE_VOLUME, "image": {"reference": image["reference"],
                                                     "pullPolicy": image.get("pullPolicy") or "IfNotPresent"}})
    return out


def mounts(spec: dict) -> list[dict]:
    k = kind(spec["modelCache"])
    out = [{"name": CACHE_VOLUME, "mountPath": MODEL_CACHE, **({"readOnly": True} if k == "prefilled" else {})}]
    if k == "image":
        out.append({"name": IMAGE_VOLUME, "mountPath": MODEL_IMAGE, "readOnly": True})
    return out


def model_dir(spec: dict) -> str:
    """Where an image volume's model is, inside the pod: the mount plus the optional path in the artifact."""
    path = (spec["modelCache"].get("image") or {}).get("path") or ""
    return f"{MODEL_IMAGE}/{path.strip('/')}" if path.strip("/") else MODEL_IMAGE


def env(spec: dict) -> dict:
    """The server settings the cache decides (render.server_env puts them in place)."""
    k = kind(spec["modelCache"])
    if k == "image":
        # Clients keep naming the model as spec.model says, not after the mount's directory.
        return {"MODEL_PATH": model_dir(spec), "SERVED_MODEL_NAME": spec["model"], "MODEL_CACHE_DIR": MODEL_CACHE}
    # With spec.models, each model's source and revision are in MODELS (render_models), never here.
    values = {} if render_models.several(spec) else {"MODEL_PATH": spec["model"]}
    values["MODEL_CACHE_DIR"] = MODEL_CACHE
    if spec.get("modelRevision"):
        values["MODEL_REVISION"] = spec["modelRevision"]
    if k == "prefilled":
        values["HF_HUB_OFFLINE"] = "1"  # read-only: what the Job fetched is all there is
    return values


def fill_digest(service: str, spec: dict, server_env: list[dict], claim_uid: str = "") -> str:
    """What a fill is for: the service (a Job's name holds only the start of a long one, so two
    services with a long common prefix must still differ; the namespace is the Job's own), the
    claim, by name and uid (a claim deleted and made again under its name is another, empty one:
    it is filled again), the settings (as the pods get them, spec.env included) that decide what
    is downloaded, and the cache layout. Without `claim_uid`: the digest operators of chart 0.2.x
    keyed fills by (no uid in the key at all), which fill.read still honours once."""
    wanted = [e for e in server_env if e["name"] in FILLED_BY]
    # With spec.models, every model's source and revision (a one-model spec's key is as it was).
    several = [render_models.fetches(spec)] if render_models.several(spec) else []
    key = json.dumps([FILL_LAYOUT, service, spec["modelCache"]["claimName"], *([claim_uid] if claim_uid else []),
                      sorted(wanted, key=lambda e: e["name"]), *several], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def fill_job_name(service: str, spec: dict, server_env: list[dict], claim_uid: str = "") -> str | None:
    """`<service>-fill-<digest>` (at most 63 characters, as a Job's name must be, for its pods'
    job-name label), or None when the spec has no claim to fill."""
    if kind(spec["modelCache"]) != "prefilled":
        return None
    return f"{service[:63 - 16]}-fill-{fill_digest(service, spec, server_env, claim_uid)}"


def fill_env(server_env: list[dict], spec_env: list[dict]) -> list[dict]:
    """The fill Job's environment: FILL_ENV as the servers get it, and spec.env (credentials:
    HF_TOKEN, HF_ENDPOINT, AWS_*, S3 endpoints; proxies) but NOT_FOR_FILL and what describes the
    server container (a resourceFieldRef: the Job's container is another)."""
    own = [e for e in server_env if e["name"] in FILL_ENV]
    names = {e["name"] for e in own}
    extra = [e for e in spec_env if e["name"] not in names and e["name"] not in NOT_FOR_FILL
             and "resourceFieldRef" not in (e.get("valueFrom") or {})]
    return own + extra


def fill_job(meta: dict, spec: dict, image: str, server_env: list[dict], pod: dict, container: dict,
             claim_uid: str = "") -> dict | None:
    """The Job that fills the claim: the server image, the fill's settings and spec.env (fill_env)
    and envFrom (credentials), the claim mounted read-write. `meta`: the owned-object metadata
    (named by fill_job_name); `pod` and `container`: the server pod's spec and container, whose
    security and scheduling fields it keeps. Its pod template is immutable, and so is its name for
    one digest: a changed model is a new Job. No ttlSecondsAfterFinished: the Job stays (owned by
    the service) until a later fill has succeeded; the record that a digest was filled is the
    service's status.modelCache.filled, so a Job deleted by someone else (a TTL policy) is not
    run again. Retries (backoffLimit) are for what may pass (a node lost, an OOM kill, a network
    error, a hub 5xx); prefetch's refusal (PREFETCH_REFUSED: no such model or revision) fails the Job at once
    (podFailurePolicy, which needs restartPolicy Never), and a pod disrupted by Kubernetes (drain,
    preemption) does not count against the retries."""
    if meta is None or kind(spec["modelCache"]) != "prefilled":
        return None
    digest = fill_digest(meta["labels"]["app.kubernetes.io/instance"], spec, server_env, claim_uid)
    job_env = fill_env(server_env, spec.get("env") or [])
    filler = {
        "name": "fill", "image": image, "imagePullPolicy": container.get("imagePullPolicy", "IfNotPresent"),
        "command": ["python", "-m", "embedserve.prefetch"],
        "env": job_env,
        **({"envFrom": container["envFrom"]} if container.get("envFrom") else {}),
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}},
        "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": MODEL_CACHE}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": container["securityContext"],
    }
    fillers = per_model(filler, spec) if render_models.several(spec) else [filler]
    # The server pods' token setting too: none mounted with the default account, the account's own
    # setting with spec.serviceAccountName (render._pod_spec).
    kept = ("securityContext", "nodeSelector", "tolerations", "affinity", "imagePullSecrets", "serviceAccountName",
            "priorityClassName", "automountServiceAccountToken")
    pod_spec = {k: pod[k] for k in kept if k in pod}
    labels = {**meta["labels"], FILL_LABEL: digest}
    # Its pod must not carry the server pods' selector labels: the Services would send it requests,
    # the PodDisruptionBudget count it and the autoscaler scrape it.
    # The managed-by label puts it in the operator's watched copies (its Pending reason is told).
    pod_labels = {"app.kubernetes.io/name": "embedserve-fill",
                  "app.kubernetes.io/instance": meta["labels"]["app.kubernetes.io/instance"],
                  "app.kubernetes.io/managed-by": meta["labels"]["app.kubernetes.io/managed-by"], FILL_LABEL: digest}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {**meta, "labels": labels},
        "spec": {
            "backoffLimit": FILL_BACKOFF_LIMIT,
            "activeDeadlineSeconds": FILL_DEADLINE_S,
            "podFailurePolicy": {"rules": [
                # With several models, any of the fill's containers (its init containers too).
                {"action": "FailJob", "onExitCodes": {**({} if len(fillers) > 1 else {"containerName": "fill"}),
                                                      "operator": "In", "values": [PREFETCH_REFUSED]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {**pod_spec, "restartPolicy": "Never", "enableServiceLinks": False,
                         **({"initContainers": fillers[:-1]} if len(fillers) > 1 else {}), "containers": fillers[-1:],
                         "volumes": [{"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": spec["modelCache"]["claimName"]}},
                                     {"name": "tmp", "emptyDir": {}}]},
            },
        },
    }


def per_model(filler: dict, spec: dict) -> list[dict]:
    """With spec.models: the fill container once per model, in order, each with that model's
    MODEL_PATH and MODEL_REVISION (render_models.fetches): init containers `fill-0`, `fill-1`, ...
    one after the other, the last model's the container `fill`. One download at a time (one
    container's resources, whatever the count), each what a one-model fill runs, so prefetch reads
    the settings it always has."""
    fetches = render_models.fetches(spec)
    base = [e for e in filler["env"] if e["name"] not in ("MODEL_PATH", "MODEL_REVISION")]
    return [{**filler, "name": "fill" if i == len(fetches) - 1 else f"fill-{i}",
             "env": [*[{"name": k, "value": v} for k, v in fetch.items()], *base]}
            for i, fetch in enumerate(fetches)]


def fill_state(job: dict | None) -> str:
    """A fill Job's state as its controller writes it: Complete (condition Complete, or
    SuccessCriteriaMet, or a succeeded pod), Failed (condition Failed: backoffLimit or the deadline
    exceeded), else Running (Missing when there is no Job)."""
    if job is None:
        return "Missing"
    st = job.get("status") or {}
    true = {c.get("type") for c in st.get("conditions") or [] if c.get("status") == "True"}
    if true & {"Complete", "SuccessCriteriaMet"} or int(st.get("succeeded") or 0) > 0:
        return "Complete"
    if true & {"Failed", "FailureTarget"}:
        return "Failed"
    return "Running"


def waiting(pods: list[dict]) -> str | None:
    """Why a fill Job's pod has not started downloading, as the scheduler and kubelet put it in its
    status (Unschedulable: an unbound claim, no node for its tolerations; ErrImagePull,
    CreateContainerConfigError: a missing Secret), or None. A claim that cannot attach (an RWO
    volume on another node: Multi-Attach) is only an Event on the pod, which the status cannot show."""
    for pod in pods:
        st = pod.get("status") or {}
        if st.get("phase") not in (None, "Pending"):
            continue
        unscheduled = next((c for c in st.get("conditions") or []
                            if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)
        if unscheduled:
            return f"its pod {pod['metadata']['name']} is not scheduled: {unscheduled.get('message') or unscheduled.get('reason', '')}"
        # Several models: each but the last fetched by an init container, the main one waiting
        # (PodInitializing) meanwhile; what stops an init container is the news.
        for c in [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]:
            w = (c.get("state") or {}).get("waiting") or {}
            if w.get("reason") and w["reason"] not in ("ContainerCreating", "PodInitializing"):
                return f"its pod {pod['metadata']['name']} is waiting: {w['reason']} {w.get('message', '')}".rstrip()
    return None


def no_claim_message(spec: dict, namespace: str) -> str:
    claim = spec["modelCache"]["claimName"]
    return (f"claim {claim} does not exist in namespace {namespace}: its fill Job is made once it does (create the "
            f"PersistentVolumeClaim, or correct spec.modelCache.claimName)")


def fill_message(job: dict | None, name: str, spec: dict, pods: list[dict] = ()) -> str:
    what = f"{render_models.described(spec)} into claim {spec['modelCache']['claimName']}"
    state = fill_state(job)
    if state == "Failed":
        cond = next((c for c in (job.get("status") or {}).get("conditions") or []
                     if c.get("type") in ("Failed", "FailureTarget") and c.get("status") == "True"), {})
        return (f"Job {name} failed to fill {what}: {cond.get('reason', '')} {cond.get('message', '')}".rstrip()
                + f"; see `kubectl logs job/{name}{' --all-containers' if render_models.several(spec) else ''}`, fix the "
                "cause and delete the Job to run it again")
    why = waiting(list(pods))
    return f"Job {name} is filling {what}; the pods move to it once it has succeeded" + (f" ({why})" if why else "")
