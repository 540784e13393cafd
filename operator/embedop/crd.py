"""The EmbeddingService CustomResourceDefinition, built here once: crds/embeddingservice.yaml is
this rendered (`python -m embedop.crd > crds/embeddingservice.yaml`; a test keeps them equal), and
the operator applies the schema's defaults from the same source."""

from __future__ import annotations

import sys

import yaml

# TASKS and with_defaults are this module's too (spec.defaulted applies the schema's defaults).
from embedop.crd_schema import (TASKS, boolean, int_or_percent, integer, kubernetes, model_fields, number, obj,  # noqa: F401
                                quantity, string, string_map, typed, with_defaults)

GROUP, VERSION, PLURAL, KIND = "embedfleet.dev", "v1alpha1", "embeddingservices", "EmbeddingService"
API_VERSION = f"{GROUP}/{VERSION}"
# The CEL rule's message, and the operator's problem for a server without CEL. The HPA reads the
# same pods (its own scale to zero is the alpha HPAScaleToZero gate, and only on object metrics).
# A Service's name is a DNS label (63 characters); the headless one adds "-headless".
MAX_NAME = 63 - len("-headless")
NAME_RULE = (f"at most {MAX_NAME} characters: the service's headless Service, NAME-headless, must fit a "
             "DNS label (63)")
# Server settings spec.env may not set: the probes, the Services, the NetworkPolicy and the
# autoscaler's scrapes use these ports (envFrom cannot either: Kubernetes lets env win over envFrom).
RESERVED_ENV = ("GRPC_PORT", "HTTP_HEALTH_PORT", "METRICS_PORT")
RESERVED_ENV_RULE = ("set by the operator (the probes, the Services, the NetworkPolicy and the autoscaler's scrapes "
                     "use these ports); spec.env cannot override them")
GPU_RULE = ("at most 1: a server process drives one GPU, so more would be reserved and left idle; "
            "scale with replicas (the autoscaler does)")
MIN_REPLICAS_RULE = ("minReplicas must be at least 1 in modes operator and hpa: demand is read from running pods, "
                     "so 0 pods never scale up; scale to zero is mode keda's (KEDA and its HTTP add-on wake the "
                     "service); to stop a service use mode off with replicas 0")


# A Secret's name (a DNS-1123 subdomain, as the API server checks every object name).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Where the server pods mount spec.auth's and spec.tls's Secrets (render_security.py).
AUTH_DIR, TLS_DIR = "/etc/embedfleet/auth", "/etc/embedfleet/tls"


def secret_name(description: str) -> dict:
    return string(description, minLength=1, maxLength=253, pattern=DNS_SUBDOMAIN)


def peers(description: str) -> dict:
    return kubernetes(description + " Each a Kubernetes NetworkPolicyPeer (podSelector, namespaceSelector, "
                      "both: pods of the selected namespaces, or ipBlock).", "array")


AUTH = obj(
    "API keys: every API route (HTTP) and every gRPC method but grpc.health.v1 and reflection then needs "
    "`Authorization: Bearer <key>` (401 / UNAUTHENTICATED without a valid one). The metrics port (/health, "
    "/metrics) stays open to the kubelet and Prometheus.", {
        "apiKeySecretRef": obj(
            f"The Secret holding the keys, in the service's namespace: mounted read-only at {AUTH_DIR} (a "
            "volume: the kubelet brings a changed Secret to the pods within its sync period, about a minute, "
            "and the servers re-read it without a restart) and given as API_KEYS_FILE. The pods do not start while it is missing.", {
                "name": secret_name("The Secret's name."),
                "key": string("The Secret's key whose value is the keys, one per line (blank lines and lines "
                              "starting with # ignored).", "api-keys", minLength=1, maxLength=253,
                              pattern=r"^[-_a-zA-Z0-9][-._a-zA-Z0-9]*$"),
            }, required=["name"]),
    }, required=["apiKeySecretRef"])

TLS = obj(
    "TLS on the gRPC and HTTP API ports (TLS only, no plain text there); the metrics port stays plain. The "
    "certificate is re-read when the Secret changes (cert-manager renewals need no restart).", {
        "secretRef": obj(
            f"A Secret of cert-manager's shape (tls.crt, tls.key; ca.crt with clientAuth) in the service's "
            f"namespace, mounted read-only at {TLS_DIR} (TLS_CERT_FILE, TLS_KEY_FILE, TLS_CLIENT_CA_FILE). The "
            "pods do not start while it or one of those keys is missing.", {
                "name": secret_name("The Secret's name.")}, required=["name"]),
        "clientAuth": boolean("Require client certificates signed by the Secret's ca.crt (mutual TLS).", False),
    }, required=["secretRef"])

NETWORK_POLICY = obj(
    "A NetworkPolicy for the server pods (ingress only; their egress, to the model hub or S3 and the "
    "trace collector, is left open). Needs a network plugin that enforces NetworkPolicies.", {
        "enabled": boolean("Render it (false: none, and one rendered before is deleted).", False),
        "from": peers("Who may reach the gRPC and HTTP API ports: exactly these peers. Unset or empty: pods of the "
                      "service's own namespace only. Set, it replaces that default: to admit a gateway's namespace "
                      "and the service's own namespace, list both (the latter as {podSelector: {}})."),
        "metricsFrom": peers("Who besides the operator may reach the metrics port (/health, /metrics), e.g. "
                             "Prometheus's pods; with autoscaling.mode hpa it must admit Prometheus, or the "
                             "HorizontalPodAutoscaler gets no metrics. The kubelet's probes need no rule (traffic "
                             "from a pod's own node is always allowed)."),
    })


ROUTING = string(
    "How requests reach the pods. service: the Services the operator renders (clients balance over them). gateway: "
    "also an InferencePool (inference.networking.k8s.io/v1, the Gateway API Inference Extension) named like the "
    "service, selecting its pods on the HTTP API port: a Gateway's HTTPRoute names the pool, and the cluster's "
    "endpoint picker routes each request by the pods' embedfleet_queued_requests / embedfleet_running_requests. The "
    "InferencePool CRD, the endpoint picker and the Gateway are the cluster's to install (docs/gateway.md); without "
    "the CRD the service reports Degraded. Back to service: the pool is deleted.", "service", enum=["service", "gateway"])
ENDPOINT_PICKER = obj(
    "The endpoint picker the InferencePool names (spec.routing gateway): a Service in front of the cluster's "
    "endpoint picker (EPP) deployment, which the operator does not deploy.", {
        "name": string("The picker's Service, in the service's namespace (default: the service's name + \"-epp\").",
                       minLength=1, maxLength=253, pattern=DNS_SUBDOMAIN),
        "port": integer("The picker Service's gRPC ext-proc port (the Service's port, not its target port).", 9002, 1, 65535),
        "failureMode": string("When the picker does not answer: FailClose refuses the request; FailOpen lets the "
                              "Gateway pick a pod itself.", "FailClose", enum=["FailOpen", "FailClose"]),
    }, default={})

# The fields of one model: the spec's own (one model per pod), and each spec.models entry's.
ONE_MODEL = model_fields(
    "What the servers load (MODEL_PATH): a HuggingFace repo id, an s3://bucket/prefix URI, or a directory inside the "
    "image. Exactly one of model and models.",
    "The hub revision of a repo id model (MODEL_REVISION): a branch, tag or commit; default main. A revision a cache "
    "has fetched is read back with no hub call (a branch stays at the commit first fetched): set this to move a fleet "
    "to another commit.",
    "What the servers serve (TASK): embed (vectors), rerank (query-document scores of a cross-encoder or an LLM "
    "reranker), sparse (SPLADE vectors), classify (labels), multivector (token vectors of a ColBERT model, MaxSim "
    "reranking) or bgem3 (BGE-M3's dense, sparse and ColBERT vectors from one pass). Unset: the server infers it from the model's files. status.task says what the pods "
    "serve; a disagreement with this is the TaskMismatch condition.",
    "How token states become one vector. Unset fields serve the model as its authors declared it (sentence-transformers "
    "modules.json, 1_Pooling, Dense, Normalize), as SentenceTransformer(model).encode does.")
# A model's name: a path segment, a gRPC field, a metric label (the server's own rule is wider).
MODEL_NAME = r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$"
MAX_MODELS = 16
MODEL_RULE = "exactly one of model and models: model for one model per pod, models for several"
PER_MODEL_RULE = ("with models, modelRevision, task and pooling are set in each entry of models, not beside it")
MODEL_IMAGE_RULE = ("modelCache.image holds one model: with models, use a claim (claimName) or the default emptyDir")
UNIQUE_MODELS_RULE = "models: each name must be unique"
MODELS = {
    "type": "array", "minItems": 1, "maxItems": MAX_MODELS,
    "description": "Several models served by every pod on its one device (the servers' MODELS, one JSON value), instead "
                   "of model: each admitted on its own drain budget, the device shared by deadline, the fleet scaled on "
                   "their summed demand in busy seconds per second. The first is the default (what a request naming no "
                   "model gets). Their weights must fit one device together: a pod whose models do not fit stops, and "
                   "the service is Degraded (reason ModelsDoNotFit) with the numbers. Exactly one of model and models.",
    "items": obj("One model: its name and the per-model fields of a one-model spec.", {
        "name": string("How clients name it on every transport (the requests' model field) and the model label of its "
                       "metrics: lowercase letters, digits, '.', '_' and '-', at most 63, unique in the list.",
                       minLength=1, maxLength=63, pattern=MODEL_NAME),
        **model_fields(
            "What the servers load for it: a HuggingFace repo id, an s3://bucket/prefix URI, or a directory inside the image.",
            "The hub revision of a repo id model: a branch, tag or commit; default main (as spec.modelRevision).",
            "What it serves: embed, rerank, sparse, classify, multivector or bgem3 (as spec.task). Unset: the server infers it from the model's files. "
            "status.models says what each serves; a disagreement is the TaskMismatch condition.",
            "How its token states become one vector (as spec.pooling). Unset fields: as the model declares."),
    }, required=["name", "model"]),
    "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
    "x-kubernetes-validations": [{"rule": "self.all(m, self.exists_one(n, n.name == m.name))",
                                  "message": UNIQUE_MODELS_RULE}],
}

SPEC = obj(
    "Desired state of an embedding service: the model, how its servers batch and admit, and how the fleet scales.",
    {
        "model": ONE_MODEL["model"],
        "modelRevision": ONE_MODEL["modelRevision"],
        "task": ONE_MODEL["task"],
        "models": MODELS,
        "image": string("Server container image; defaults to the operator's embedserve image.", maxLength=512, pattern=r"^[^\s]+$"),
        "replicas": integer("Server replicas. Mode off: the count, set here, by kubectl scale (the scale subresource) or by an external HPA/KEDA. Modes operator and hpa: a new service starts with it (within min/max), then the autoscaler or the HorizontalPodAutoscaler owns the count and the operator writes the live count here, so a switch to off keeps the fleet as it is; a value set by hand is undone (use mode off to scale by hand; GitOps tools should ignore this field).", 1, 0, 1000),
        "resources": obj("Resources of each server pod.", {
            # Refused above 1 by the operator (spec.problems: InvalidSpec), not by the schema: a
            # tighter schema would refuse every write to an existing service with more, its
            # status included, where the API server does not ratchet validation (before 1.30).
            "gpu": integer("NVIDIA GPUs per pod (nvidia.com/gpu): 1, or 0 to run on CPU. A server process "
                           "drives one GPU (more is refused as an invalid spec): scale with replicas.", 1, 0, 16),
            "cpu": quantity("CPU request and limit, e.g. 4 or 3500m.", "4"),
            "memory": quantity("Memory request and limit, e.g. 16Gi.", "16Gi"),
            "frontends": integer("Front-end processes per pod serving gRPC/HTTP and tokenizing for the one model "
                                 "process (FRONTENDS). Unset: 1 on CPU, on a GPU the pod's cores less two (1-8). "
                                 "Above 1, the CPU request is raised to at least frontends + 2 cores.", None, 1, 32),
        }, default={}),
        "batching": obj("How each server groups token rows into forward passes.", {
            "buckets": {"type": "array", "description": "Padded sequence lengths, ascending; each row goes to the smallest that holds it.",
                        "items": {"type": "integer", "minimum": 2, "maximum": 8192}, "minItems": 1, "maxItems": 16,
                        "default": [16, 32, 64, 128, 256, 512]},
            "maxBatchSize": integer("Most rows in one forward pass.", 512, 1, 4096),
            "maxTokensPerBatch": integer("Most padded tokens (rows x length) in one forward pass.", 32768, 16, 1048576),
            "deadlineWaitMs": integer("Age of a bucket's oldest row that makes it drain before fuller buckets. Keep it at most half of admission.maxDrainTimeMs: its excess adds to the accepted latency bound.", 50, 0, 10000),
        }, default={}),
        "admission": obj("Admission control: refuse work that cannot finish in time (RESOURCE_EXHAUSTED with retry-after-ms).", {
            "throughput": boolean("Refuse a request when the backlog would take longer than maxDrainTimeMs, less the batcher's reorder window, to compute.", True),
            "latency": boolean("Shed 25% of requests above latencySoftMs P95, all above latencyHardMs.", False),
            "maxDrainTimeMs": integer("Drain budget, in milliseconds of model time: accepted requests finish within it plus their batch. The queue a request may join at once is this less the batcher's reorder window (exported as embedfleet_admission_backlog_limit_seconds).", 500, 1, 600000),
            "latencySoftMs": integer("P95 server-side latency above which 25% of requests are shed.", 500, 1, 600000),
            "latencyHardMs": integer("P95 server-side latency above which every request is shed.", 2000, 1, 600000),
        }, default={}, **{"x-kubernetes-validations": [
            {"rule": "self.latencySoftMs <= self.latencyHardMs", "message": "latencySoftMs must not exceed latencyHardMs"}]}),
        "pooling": ONE_MODEL["pooling"],
        "autoscaling": obj("How the operator sizes the fleet.", {
            "mode": string("operator: scale on the servers' service rate and backlog; hpa: render a HorizontalPodAutoscaler on the same signal; keda: render a KEDA ScaledObject whose count is the operator's decision (the operator is its external scaler), with scale to zero through KEDA's HTTP add-on; off: spec.replicas.", "operator", enum=["operator", "hpa", "keda", "off"]),
            "minReplicas": integer("Fewest replicas. At least 1 in modes operator and hpa: demand is read from the running pods, so a fleet of 0 would never scale up (to stop a service, use mode off with replicas 0). 0 in mode keda: scale to zero after idleSeconds without demand, woken by KEDA's HTTP add-on.", 1, 0, 1000),
            "maxReplicas": integer("Most replicas.", 4, 1, 1000),
            "targetUtilization": number("Offered load per replica as a fraction of its measured capacity.", 0.7, 0.05, 1.0),
            "targetDrainTimeMs": integer("Time in which a backlog should be cleared by the added capacity.", 1000, 1, 600000),
            "intervalSeconds": integer("Seconds between autoscaling decisions (demand is each interval's exact mean; its trend spans 75 s whatever the interval).", 5, 1, 3600),
            "scaleUpStabilizationSeconds": integer("Seconds a higher recommendation must persist before scaling up (0: at once).", 0, 0, 3600),
            "scaleDownStabilizationSeconds": integer("The highest recommendation over this window wins when scaling down.", 120, 0, 3600),
            "idleSeconds": integer("Mode keda: seconds without demand before the service counts as idle (KEDA's IsActive false) and, with minReplicas 0, before its last pod goes (the ScaledObject's cooldownPeriod).", 300, 1, 86400),
        }, default={}, **{"x-kubernetes-validations": [
            {"rule": "self.minReplicas <= self.maxReplicas", "message": "minReplicas must not exceed maxReplicas"},
            {"rule": "self.mode in ['off', 'keda'] || self.minReplicas >= 1",
             "message": MIN_REPLICAS_RULE}]}),
        "rollout": obj("How a changed pod template replaces the server pods (the Deployment's rolling update). The default replaces one pod at a time without a spare GPU (maxSurge 0, maxUnavailable 1): it progresses on a full GPU pool, at one pod's capacity less while it runs. With a spare GPU, maxSurge 1 and maxUnavailable 0 keep full capacity. The PodDisruptionBudget allows as many pods down as maxUnavailable (at least 1).", {
            "maxSurge": int_or_percent("Pods above the replica count during a rollout (each needs a free GPU), a number or a percentage.", 0),
            "maxUnavailable": int_or_percent("Pods that may be missing during a rollout, a number or a percentage.", 1),
        }, default={}, **{"x-kubernetes-validations": [
            {"rule": "!(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])",
             "message": "maxSurge and maxUnavailable cannot both be 0: the rollout could never progress"}]}),
        "modelCache": obj("Where servers find the model's files (MODEL_CACHE_DIR, mounted at /models): by default an emptyDir "
                          "per pod, which each pod fills from the hub or S3; a claim (claimName) shared by the pods, or "
                          "filled once by the operator (prefill); or an image volume holding the model (image).", {
            "sizeLimit": quantity("Size of the emptyDir cache when no claim is given.", "20Gi"),
            "claimName": string("An existing PersistentVolumeClaim to use as the cache instead, mounted read-write: "
                                "ReadWriteMany lets every pod on every node share it (the first downloads, the others "
                                "find the model; concurrent downloads are safe).", maxLength=253),
            "prefill": typed("boolean", "With claimName: the operator fills the claim with a Job (the server image running "
                          "python -m embedserve.prefetch) once per model and revision, and the pods mount it read-only "
                          "with HF_HUB_OFFLINE=1, so a new pod never downloads. The pods move to a new model or revision "
                          "only once its Job has succeeded (Progressing: FillingModelCache; a failed Job: Degraded; "
                          "status.modelCache.filled records it). The Job must be able to WRITE the claim: "
                          "ReadWriteMany (or ReadWriteOnce on a one-node cluster: elsewhere the Job and the pods on "
                          "other nodes meet Multi-Attach errors), its root writable by uid/gid 10001 (fsGroup is not "
                          "applied to most RWX volumes: give the volume that owner, e.g. an EFS access point). A "
                          "ReadOnlyMany claim cannot be filled by a Job (drivers publish it read-only): fill a "
                          "ReadWriteOnce volume instead and clone or snapshot it into the ROX claim, then use "
                          "claimName without prefill."),
            "image": obj("An image volume (an OCI image or artifact holding the model, as KServe's modelcar) mounted "
                         "read-only at /model-image; MODEL_PATH is that directory (plus path) and clients still name the "
                         "model spec.model. Needs Kubernetes 1.31+ with the ImageVolume feature gate on the API "
                         "server and the kubelets (alpha in 1.31-1.32, beta but off by default in 1.33-1.34, on by "
                         "default from 1.35) and a container runtime that "
                         "supports image volumes (containerd 2.1+, CRI-O 1.31+). The cache itself stays a writable emptyDir of sizeLimit.", {
                "reference": string("The image reference, e.g. registry.example/models/bge-base:v1.5.", minLength=1,
                                    maxLength=512, pattern=r"^[^\s]+$"),
                "pullPolicy": string("Always, Never or IfNotPresent (default: IfNotPresent; Always for a :latest tag "
                                     "is the kubelet's own rule only when unset, so set it).", enum=["Always", "Never", "IfNotPresent"]),
                "path": string("The model's directory inside the image, relative (e.g. models/bge); default: its root.",
                               maxLength=512, pattern=r"^[^/].*$"),
            }, required=["reference"]),
        }, default={}, **{"x-kubernetes-validations": [
            {"rule": "!(has(self.image) && has(self.claimName))",
             "message": "image and claimName are exclusive (the image holds the model; the cache stays an emptyDir)"},
            {"rule": "!(has(self.prefill) && self.prefill && !has(self.claimName))",
             "message": "prefill needs claimName: the claim the fill Job writes and the pods read"}]}),
        "nodeSelector": {"type": "object", "description": "Node labels the server pods must match.",
                         "additionalProperties": {"type": "string"}},
        "tolerations": {"type": "array", "description": "Tolerations of the server pods (e.g. for GPU node taints).",
                        "items": obj("A Kubernetes toleration.", {
                            "key": string("Taint key."), "operator": string("Exists or Equal.", enum=["Exists", "Equal"]),
                            "value": string("Taint value."), "effect": string("NoSchedule, PreferNoSchedule or NoExecute.", enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
                            "tolerationSeconds": integer("How long a NoExecute taint is tolerated."),
                        })},
        "env": {"type": "array", "description": "Extra environment variables for the server container (any embedserve setting); an entry named like one the operator sets overrides it, but GRPC_PORT, HTTP_HEALTH_PORT and METRICS_PORT (the probes, Services, NetworkPolicy and scrapes use them). API keys and TLS: spec.auth and spec.tls. Secrets: valueFrom.secretKeyRef (e.g. HF_TOKEN, AWS_ACCESS_KEY_ID).",
                "items": obj("A name and either a literal value or valueFrom.", {
                    "name": string("Variable name.", minLength=1, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$"),
                    "value": string("Variable value."),
                    "valueFrom": kubernetes("Where the value comes from: a Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)."),
                }, required=["name"], **{"x-kubernetes-validations": [
                    {"rule": "!(has(self.value) && has(self.valueFrom))", "message": "env: value and valueFrom are exclusive"},
                    {"rule": f"!(self.name in {list(RESERVED_ENV)})", "message": RESERVED_ENV_RULE}]})},
        "envFrom": kubernetes("Whole Secrets or ConfigMaps as environment variables of the server container (Kubernetes EnvFromSource list).", "array"),
        "imagePullSecrets": {"type": "array", "description": "Secrets (in the service's namespace) to pull the server image with.",
                             "items": obj("A Secret of type kubernetes.io/dockerconfigjson.", {
                                 "name": string("Secret name.", minLength=1, maxLength=253)}, required=["name"])},
        "serviceAccountName": string("ServiceAccount the server pods run as (e.g. bound to a cloud identity for s3:// models); the namespace's default when unset.", maxLength=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"),
        "affinity": kubernetes("Scheduling affinity of the server pods (a Kubernetes Affinity: nodeAffinity, podAffinity, podAntiAffinity)."),
        "topologySpreadConstraints": kubernetes("How server pods spread across zones or nodes (Kubernetes TopologySpreadConstraint list).", "array"),
        "priorityClassName": string("PriorityClass of the server pods (e.g. to preempt batch work on GPU nodes).", maxLength=253),
        "runtimeClassName": string("RuntimeClass of the server pods (e.g. nvidia, where the GPU runtime is not the node default).", maxLength=253),
        "podAnnotations": string_map("Extra annotations on the server pods (they may override the prometheus.io/* scrape annotations)."),
        "podLabels": string_map("Extra labels on the server pods; the operator's own labels (which its selectors use) win on a clash."),
        "auth": AUTH,
        "tls": TLS,
        "networkPolicy": NETWORK_POLICY,
        "routing": ROUTING,
        "endpointPicker": ENDPOINT_PICKER,
    }, **{"x-kubernetes-validations": [
        {"rule": "has(self.model) != has(self.models)", "message": MODEL_RULE},
        {"rule": "!has(self.models) || !(has(self.modelRevision) || has(self.task) || has(self.pooling) && "
                 "(has(self.pooling.strategy) || has(self.pooling.normalize) || has(self.pooling.excludeTokens)))",
         "message": PER_MODEL_RULE},
        {"rule": "!has(self.models) || !has(self.modelCache) || !has(self.modelCache.image)", "message": MODEL_IMAGE_RULE}]},
)

CONDITION = obj("A condition of the service.", {
    "type": string("Ready, Progressing, Degraded, ScalingLimited, MetricsUnavailable, TaskMismatch, ModelCacheShared "
                   "or FieldNotPersisted."),
    "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
    "reason": string("CamelCase reason."),
    "message": string("Human-readable detail."),
    "lastTransitionTime": string("When status last changed.", format="date-time"),
    "observedGeneration": integer("Generation the condition was computed for."),
}, required=["type", "status"])

STATUS = obj("Observed state, written by the operator.", {
    "observedGeneration": integer("Last spec generation the operator reconciled."),
    "conditions": {"type": "array", "description": "Ready, Progressing, Degraded, ScalingLimited, MetricsUnavailable (mode operator: no ready pod's /metrics could be scraped, so the count is held), TaskMismatch (mode operator: the pods serve another task than spec.task), ModelCacheShared (spec.modelCache.claimName: whether every pod can mount the claim on any node, by its access mode; False for ReadWriteOnce and ReadWriteOncePod, never a refusal), FieldNotPersisted (True, reason Held: an owned object's field is not stored as the operator sends it, a mutating webhook's rewrite or a field the installed CRD prunes, so it is no longer applied until the render changes or an hour has passed; the message names the JSON path).", "items": CONDITION,
                   "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    "replicas": integer("Server pods that exist."),
    "readyReplicas": integer("Server pods ready to serve."),
    "desiredReplicas": integer("Replicas wanted: the autoscaler's decision (mode operator), spec.replicas (off), the HorizontalPodAutoscaler's (hpa)."),
    "selector": string("Label selector of the server pods (for the scale subresource)."),
    "serviceRateTokensPerSecond": number("Measured capacity of one replica: real (unpadded) tokens computed per second of model-busy time, the unit of the arrival rate. With spec.models: the first (default) model's; each model's is in status.models."),
    "arrivalRateTokensPerSecond": number("Offered load across the fleet: real tokens/s, admitted + rejected (a retry is not new demand). With spec.models: the sum of every model's tokens (each model's is in status.models)."),
    "estimatedDrainMs": number("Largest backlog drain time among the replicas: a pod's device time queued (with spec.models, the sum over its models of queued tokens over service rate), in ms."),
    "lastScaleTime": string("When the operator last changed the replica count.", format="date-time"),
    "lastScaleReason": string("Why it did."),
    "task": string("The task the pods serve (embed, rerank, sparse, classify, multivector or bgem3), from the task label of their "
                   "embedfleet_model_info (mode operator, where the operator scrapes them); with spec.models, each "
                   "model's task in their order, joined by commas (e.g. embed,sparse,rerank)."),
    "modelSummary": string("What the service serves, for the Model column: spec.model, or spec.models' count and "
                           "names (e.g. \"3 models: dense, sparse, rerank\", the last names cut to \"+N\")."),
    "models": {"type": "array", "description": "With spec.models (mode operator): each model as the pods serve it, "
               "in spec.models' order.", "items": obj("One model's measurements.", {
                   "name": string("The model's name (spec.models[].name)."),
                   "task": string("The task its pods serve, from their embedfleet_model_info."),
                   "serviceRateTokensPerSecond": number("Its measured capacity: real tokens computed per second of its "
                                                        "own busy time, the median over the pods that have served it."),
                   "arrivalRateTokensPerSecond": number("Its offered load across the fleet: real tokens/s, admitted + rejected."),
               }, required=["name"]),
               "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    "defaultImage": string("The operator's default server image this service was given (spec.image unset), kept so "
                           "that a Deployment made again runs the same server; set spec.image to move to another."),
    "modelCache": obj("What a pre-filled model cache holds (spec.modelCache.prefill).", {
        "filled": string("The digest (the fill Job's embedfleet.dev/model-cache-fill label) of the last fill that "
                         "succeeded, of the claim's name and uid (a claim made again is filled again): the pods run on "
                         "it, and a fill Job deleted since is not run again."),
    }),
})


def crd() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": "embeddingservice",
                      "shortNames": ["embsvc"], "categories": ["embedfleet"]},
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": obj("An embedding inference service: a fleet of embedserve pods.", {
                    "apiVersion": string("API version."), "kind": string("Kind."), "metadata": {"type": "object"},
                    "spec": SPEC, "status": STATUS,
                }, required=["spec"], **{"x-kubernetes-validations": [
                    {"rule": f"self.metadata.name.size() <= {MAX_NAME}", "message": NAME_RULE}]})},
                "subresources": {"status": {}, "scale": {
                    "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                    "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": [
                    {"name": "Model", "type": "string", "jsonPath": ".status.modelSummary"},
                    {"name": "Task", "type": "string", "jsonPath": ".status.task"},
                    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
                    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas"},
                    {"name": "Service-Rate", "type": "number", "jsonPath": ".status.serviceRateTokensPerSecond"},
                    {"name": "Drain-Ms", "type": "number", "jsonPath": ".status.estimatedDrainMs"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }],
        },
    }


def render_yaml() -> str:
    header = "# Generated by `python -m embedop.crd`; edit operator/embedop/crd.py, not this file.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


# Helm never upgrades a CRD under a chart's crds/ (new fields would be stripped without a word), so
# the chart ships it as a template: upgrades apply it; `keep` leaves it at uninstall, since deleting
# a CRD deletes every EmbeddingService of the cluster, and their fleets with them.
KEEP = {"helm.sh/resource-policy": "keep"}


def render_chart_template() -> str:
    """charts/embedfleet/templates/crd.yaml (`python -m embedop.crd --chart`; a test keeps them equal)."""
    body = crd()
    body["metadata"]["annotations"] = dict(KEEP)
    return ("{{- /* Generated by `python -m embedop.crd --chart`; edit operator/embedop/crd.py, not this file.\n"
            "A template, not crds/: Helm applies templates on upgrade, never what is under crds/. Kept at\n"
            "uninstall (deleting a CRD deletes every EmbeddingService). crds.install=false leaves it to you (unset,\n"
            "as in the values of a release from before it existed, --reuse-values: installed). */ -}}\n"
            "{{- $crds := .Values.crds | default dict }}\n"
            "{{- if or (not (hasKey $crds \"install\")) $crds.install }}\n"
            + yaml.safe_dump(body, sort_keys=False, width=120) + "{{- end }}\n")


if __name__ == "__main__":
    sys.stdout.write(render_chart_template() if sys.argv[1:] == ["--chart"] else render_yaml())
