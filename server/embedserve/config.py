"""The serving image's configuration: one typed object, read from the environment once at start-up."""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from embedserve import model_list
from embedserve.env_reader import ConfigError, EnvReader

PACKAGED_MODEL = "packaged:all-MiniLM-L6-v2"


# What settings are checked against, kept here so that config imports nothing of the server (every
# stage imports config): the pooling modes a model may declare or POOLING may name
# (model.declared, model.pooling), and the most characters one token may stand for
# (batching.tokenization cuts a text longer than max_seq_length × this before tokenizing; message
# size limits follow from it).
POOLING_MODES = ("cls", "mean", "max", "lasttoken", "weightedmean", "mean_sqrt_len_tokens")
POOLING_ALIASES = {"last": "lasttoken", "mean_sqrt_len": "mean_sqrt_len_tokens"}
CHARS_PER_TOKEN_BOUND = 16
# MAX_TOKENS_PER_TEXT's default under LONG_TEXTS=window: OpenAI's limit on one input.
WINDOWED_TOKENS = 8192
# The most a request may hold by default, whatever the buckets: the event loop reads a body a few
# times over (parsing, hashing what the tokenizer reads) at ~1 GB/s, and a probe waits behind it
# (long-context buckets, 8,192, would otherwise size gRPC's limit at 268 MB).
MAX_DEFAULT_REQUEST_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True)
class Settings:
    model_path: str = PACKAGED_MODEL
    """MODEL_PATH: a local directory, a HuggingFace repo id, an s3://bucket/prefix URI, or
    `sim:<tokens_per_second>` (simulated accelerator, tests only). Default: the packaged
    all-MiniLM-L6-v2."""
    models: tuple[model_list.ModelEntry, ...] = ()
    """MODELS: several models on one device, a JSON list of {name, model, modelRevision, task,
    pooling: {strategy, normalize, excludeTokens}} (the EmbeddingService's spec.models entries;
    embedserve.model_list). Each is served under its name on every transport, the first by
    default; each keeps its own buckets, batch caps, warm-up and admission, and the device runs
    one batch at a time, the one whose oldest row is closest to its drain budget. Unset (the
    default): one model, from MODEL_PATH and the variables beside it, which MODELS excludes."""
    device_memory_bytes: int = 0
    """DEVICE_MEMORY_BYTES: the device memory the models may fill; 0 (default): what CUDA reports
    for the device (unbounded on CPU). Each model's footprint is measured as it loads (weights,
    warm-up, graph pools); the server refuses to start when their sum plus a margin (1 GiB or 5%
    of the device, whichever is more) exceeds this, naming the models and the numbers in its log
    and termination message. With the simulated device (MODEL_PATH=sim:<rate>@<bytes>) it is the
    simulated device's size."""
    model_revision: str = ""
    """MODEL_REVISION: the hub revision of a MODEL_PATH repo id: a branch, tag or commit (default:
    main). Once a revision has been fetched into MODEL_CACHE_DIR, it is read from there with no
    hub call at all (a filled volume serves without the network); a new revision is fetched."""
    model_cache_dir: str = "/tmp/model_cache"
    """MODEL_CACHE_DIR: where hub and s3 downloads are kept."""
    device: str = "auto"
    """DEVICE: auto (cuda when available, else cpu), cpu, cuda, cuda:N."""
    dtype: str = "auto"
    """DTYPE: auto (bfloat16/float16 on GPU, float32 on CPU), float32, float16, bfloat16."""
    compile: str = "auto"
    """COMPILE: auto (graphs on CUDA, false on CPU), graphs, true, false. `graphs` captures one
    CUDA graph of the eager model per shape (warm-up in seconds); `true` also torch.compiles
    each shape with inductor first (fused kernels; warm-up in minutes); `false` runs eagerly."""
    attention: str = "auto"
    """ATTENTION: auto, packed or padded. `packed` lays a batch's rows end to end with no padding
    and runs variable-length attention over them (FlashAttention-2 through torch's varlen_attn
    in bf16/fp16, the memory-efficient kernel in fp32; CUDA graphs per total-token count) for
    BERT-family encoders (bert, roberta, xlm-roberta, camembert) serving embeddings; on CPU it
    runs a per-row reference attention (for tests). `padded` pads rows to a common length.
    auto: packed on CUDA in bf16/fp16 for a model that supports it and whose kernel passes a
    start-up self-check against the reference attention (eager and replayed in a CUDA graph),
    padded otherwise; /health and embedfleet_model_info report which."""
    static_shapes: str = "auto"
    """STATIC_SHAPES: auto (on with graphs or compile), true, false. Pad rows to a fixed length
    ladder (each bucket and the midpoint below it) and batches to the batch-size ladder, so
    captured graphs are reused."""
    warm_start: str = "true"
    """WARM_START: true, false or refresh. true: save the warm-up's measurements (batch caps, token
    budget, service rate) under MODEL_CACHE_DIR/embedfleet-warmup/ and reuse them at the next
    start whose model revision, device, dtype, library versions (and our measuring code) and
    batch-shaping settings match, for up to 7 days: no sweep, only one checked batch per shape.
    With COMPILE_CACHE=shared, torch.compile's caches go there too. refresh: measure and replace
    the file (a sweep taken on a busy host). false: every start measures, nothing is saved."""
    compile_cache: str = "pod"
    """COMPILE_CACHE: pod or shared. Where torch.compile's caches (COMPILE=true on CUDA) are kept.
    pod (default): in their defaults in the container's own /tmp; each pod compiles again.
    shared: under MODEL_CACHE_DIR/embedfleet-warmup/compile/ (unless TORCHINDUCTOR_CACHE_DIR /
    TRITON_CACHE_DIR are set, or the directory cannot be written), kept for the next pod.
    Inductor unpickles and imports what it finds there: whoever can write MODEL_CACHE_DIR then
    runs code in this pod. Only where every writer of the cache is trusted as much as this pod's
    own code."""
    grpc_port: int = 50051
    """GRPC_PORT: the gRPC listening port."""
    http_port: int = 8001
    """HTTP_HEALTH_PORT: the API's HTTP port (the JSON API, and /health and /metrics too, behind
    the key and TLS when those are on: callers and gateways may health-check the port they use)."""
    host: str = ""
    """BIND_HOST: the address the servers bind; empty (the default): every address, IPv4 and IPv6
    (a dual-stack `::` socket, or 0.0.0.0 on a host without IPv6), so IPv6-only pods are reachable."""
    # Who may call: the metrics port, API keys, TLS (transports/auth.py, tls.py, metrics_port.py).
    metrics_port: int = 8002
    """METRICS_PORT: plain-text HTTP serving only GET /health and GET /metrics, never behind a key
    or TLS: kubelet's probes and Prometheus need neither, and a NetworkPolicy can open it to them
    alone. 0: an ephemeral port (tests; with front ends each would get its own)."""
    api_keys: tuple[str, ...] = ()
    """API_KEYS: comma-separated API keys (e.g. from a Secret through env valueFrom; changing
    them needs a restart). With any key (here or in API_KEYS_FILE), every route of the API port
    and every gRPC method but grpc.health.v1 and reflection needs `Authorization: Bearer <key>`."""
    api_keys_file: str = ""
    """API_KEYS_FILE: a file of API keys, one per line (blank lines and lines starting with #
    ignored), read again when it changes (a mounted Secret, which kubelet updates: checked once a
    second; an unreadable or empty file keeps the last keys, with a warning). With API_KEYS: both."""
    tls_cert_file: str = ""
    """TLS_CERT_FILE: PEM certificate chain (cert-manager's tls.crt); with TLS_KEY_FILE, the gRPC
    and API HTTP ports serve TLS only, and new handshakes get the files' new certificate when
    they change (checked once a second). The metrics port stays plain."""
    tls_key_file: str = ""
    """TLS_KEY_FILE: its PEM private key (tls.key)."""
    tls_client_ca_file: str = ""
    """TLS_CLIENT_CA_FILE: PEM CA bundle (cert-manager's ca.crt): when set, callers must present a
    client certificate it signed (mutual TLS). Needs TLS_CERT_FILE."""
    max_batch_size: int = 512
    """MAX_BATCH_SIZE: most rows in one forward pass."""
    max_tokens_per_batch: int = 32768
    """MAX_TOKENS_PER_BATCH: most padded tokens (rows × padded length) in one forward pass."""
    buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    """BUCKETS: padded sequence lengths, ascending; rows go to the smallest that fits."""
    batch_caps: Mapping[int, int] | None = None
    """BATCH_CAPS: `len:rows,...` fixes each bucket's batch cap and skips the warm-up sweep
    that otherwise measures where bigger batches stop paying."""
    deadline_wait_ms: float = 50.0
    """DEADLINE_WAIT_MS: oldest-row age that makes a bucket stale (drained first)."""
    gpu_queue_maxsize: int = 4
    """GPU_QUEUE_MAXSIZE: cap of the worker's input queue."""
    batch_lookahead: int | None = None
    """BATCH_LOOKAHEAD: batches formed ahead of the running one (the batcher pauses beyond).
    Default: 2 on GPU and the simulated accelerator (the host prepares while the device
    computes), 0 on CPU (nothing to overlap; a batch formed later is fuller)."""
    backpressure_throughput: bool = True
    """BACKPRESSURE_THROUGHPUT_ENABLED: reject when admitting would push drain time past
    MAX_DRAIN_TIME_MS less the batcher's reorder window (batching.decisions.reorder_window)."""
    backpressure_latency: bool = False
    """BACKPRESSURE_LATENCY_ENABLED: shed by windowed P95 latency (25% at soft, all at hard)."""
    max_drain_time_ms: float = 500.0
    """MAX_DRAIN_TIME_MS: the drain budget, in milliseconds of model time: accepted requests finish
    within it plus their own work. A request may join while the backlog ahead of it is under this
    less the reorder window, whatever its own size."""
    reservation_horizon_ms: float = 10_000.0
    """RESERVATION_HORIZON_MS: how far ahead a refused request may book room for its retry
    (retry-after-ms is then the moment the queue ahead of it drains below the limit). A burst up
    to this much model time is scheduled; past it a request is told when booking is possible, so
    a flood cannot book the future. Full, with demand over capacity for as long, it starts
    sustained-overload refusals (nothing booked, told not to retry; admission/policy.py). 0 books
    nothing (refusals say when there will be room)."""
    max_connection_age_s: float = 30.0
    """MAX_CONNECTION_AGE_S: gRPC and HTTP keep-alive connections are closed gracefully after
    about this long (gRPC adds ±10% jitter), so long-lived clients re-resolve and reach pods
    added since they connected. 0 keeps connections forever."""
    max_connection_age_grace_s: float = 15.0
    """MAX_CONNECTION_AGE_GRACE_S: how long calls in flight on an aged gRPC connection may
    still run before it is closed. At least RESERVATION_HORIZON_MS + MAX_DRAIN_TIME_MS (the
    server warns otherwise): a call held for its booked room may wait that long, then run."""
    latency_soft_ms: float = 500.0
    """LATENCY_SOFT_MS: P95 above this sheds 25% of requests."""
    latency_hard_ms: float = 2000.0
    """LATENCY_HARD_MS: P95 above this sheds every request."""
    latency_window_s: float = 10.0
    """LATENCY_WINDOW_S: the sliding window for P95."""
    pooling: str = ""
    """POOLING: empty (default) pools as the model declares (sentence-transformers 1_Pooling;
    mean for a plain checkpoint); else cls, mean, max, lasttoken, weightedmean or
    mean_sqrt_len_tokens, several joined by + (concatenated). Logged when it overrides."""
    normalize: bool | None = None
    """NORMALIZE: unset (default) L2-normalises when the model declares a Normalize module;
    true or false overrides (logged)."""
    exclude_tokens: tuple[str, ...] = ()
    """EXCLUDE_TOKENS: comma-separated token strings left out of mean pooling (a deliberate
    deviation from sentence-transformers, which pools every token)."""
    truncate: bool = True
    """TRUNCATE: cut inputs longer than the model's max_seq_length (capped by the largest bucket)
    to it, as sentence-transformers does; false refuses them (INVALID_ARGUMENT)."""
    max_texts_per_request: int = 512
    """MAX_TEXTS_PER_REQUEST: most texts (or rows) in one request."""
    long_texts: str = "off"
    """LONG_TEXTS: `off` (default): a text over the model's max length is cut (or refused with
    truncate false), whatever the request asks; `window`: a request may ask for its long texts to
    be embedded whole (gRPC EmbedRequest.long_text, HTTP `long_text`: "window"): split into
    windows of the max length, pooled by their token counts (embedserve.batching.windows). A
    request that does not ask is served as under `off`: no client sees a change it did not ask for."""
    max_tokens_per_text: int = 0
    """MAX_TOKENS_PER_TEXT: the most tokens a windowed text is embedded with (past it: cut, or
    refused with truncate false); its characters are read up to this × CHARS_PER_TOKEN_BOUND,
    and the default message limits (GRPC_MAX_MESSAGE_BYTES, the HTTP routes' budgets) hold one
    such text at least (the rest of their bound as ever: the event loop reads a body a few times
    over, and 32 MiB of escaped characters held it ~0.35 s in json.loads). 0
    (default): 8,192 under LONG_TEXTS=window (OpenAI's limit on one input), never below the
    model's max length; with LONG_TEXTS=off it may not be set (nothing is windowed)."""
    quantize_range: float = 1.0
    """QUANTIZE_RANGE: r > 0, the fixed range [-r, r] of every dimension that int8 and uint8
    encodings map onto their 256 levels (sentence-transformers' quantize_embeddings with
    `ranges` [-r, r]); 1.0 covers every component of a unit vector. Fixed, not calibrated on the
    request: the same vector quantizes the same in every request and on every pod. Changing it
    changes every int8/uint8 code: an index built before must be re-encoded. An index that ranks
    by the codes' own dot product wants a fixed r tuned to the model (0.3 for the packaged MiniLM:
    bench/RESULTS.md § 11). `calibrated`: see quantize_calibrated (this field keeps its default
    then, and /health's quantize_range says 0)."""
    quantize_calibrated: bool = False
    """QUANTIZE_RANGE=calibrated: each dimension's own range, the min and max of the model's float32
    vectors of a fixed corpus (embedserve.model.calibration), the same on every pod of a model
    revision and its weights: read from MODEL_CACHE_DIR (python -m embedserve.prefetch computes it
    there), else computed at start-up on the CPU and saved (the first pod to save one is the one
    every pod that can write the cache serves); a model whose float32 copy is over 4 GiB is not
    computed at start-up: the start fails, saying to run prefetch. /health names it by a digest
    (quantize_calibration), gRPC Quantization and GET /quantization give the ranges. For indexes
    that dequantize (or rescore with float queries): ranking by the codes' own dot product with
    per-dimension ranges drops recall@10 from 0.94 to 0.77 on the packaged model (bench/RESULTS.md
    § 11); such an index wants a fixed QUANTIZE_RANGE."""
    max_message_bytes: int = 0
    """GRPC_MAX_MESSAGE_BYTES: the largest gRPC request accepted. Default: sized from what a request
    can usefully hold, MAX_TEXTS_PER_REQUEST texts of the largest bucket's tokens at 16 characters
    of 4 UTF-8 bytes each (texts are cut there before tokenizing), plus 1 MiB (17 MiB with the
    defaults), at most 32 MiB. Responses: MAX_REPLY_BYTES."""
    http_max_body_bytes: int = 0
    """HTTP_MAX_BODY_BYTES: the most any HTTP route reads (413 above). Default: twice the gRPC
    limit (JSON escapes), at most 32 MiB. Each route reads less, by its own budget named from the model's max
    length (transports/budget.py), and a body's JSON items are counted before it is parsed."""
    max_reply_bytes: int = 64 * 2**20
    """MAX_REPLY_BYTES: the largest answer any route or RPC gives (64 MiB: 512 float vectors of
    4,096 dimensions as JSON fit). A request whose answer would be larger is refused before any
    work where its size is known from the request (vectors: rows × dimensions × encoding), else
    as soon as it is known (sparse rows, /tokenize, /decode): 400 / INVALID_ARGUMENT naming the
    size, never cut silently. Also gRPC's largest message sent."""
    http_body_timeout_s: float = 60.0
    """HTTP_BODY_TIMEOUT_S: a request body not sent whole within this is refused (408): a caller
    trickling its body holds no request slot, nor its buffer, for ever."""
    max_concurrent_requests: int = 1024
    """MAX_CONCURRENT_REQUESTS: per serving process (each front end with FRONTENDS > 1), the most
    requests in progress on the API ports: past it an HTTP request is answered 429 (idle
    connections are not counted; /health and /metrics always answered), a gRPC call
    RESOURCE_EXHAUSTED. Each request in progress may hold its body (up to the route's limit,
    docs/api.md): this bounds what a flood of slow or large callers holds."""
    served_model_name: str = ""
    """SERVED_MODEL_NAME: the model id HTTP clients use (default: from MODEL_PATH)."""
    task: str = "auto"
    """TASK: auto, embed, classify, rerank, sparse, multivector or bgem3 (auto: sparse for a
    sentence-transformers SparseEncoder; multivector for a MultiVectorEncoder or PyLate model;
    bgem3 for a checkpoint with BGE-M3's sparse_linear.pt and colbert_linear.pt; rerank for a
    CrossEncoder, or a *ForSequenceClassification checkpoint of one label; classify for one of
    several labels; else embed)."""
    trust_remote_code: bool = False
    """TRUST_REMOTE_CODE: let model repos run their own code."""
    tokenization_workers: int = 2
    """TOKENIZATION_WORKERS: threads that tokenize. More is not faster by default: on a 16-core
    GPU host 2 threads served 20% more single-text requests than 8 (bench/RESULTS.md), since
    every thread also needs the GIL the event loop runs on."""
    watchdog_multiple: float = 20.0
    """WATCHDOG_MULTIPLE: a batch running this many times longer than warm-up says it should
    means the device hangs: its requests fail with UNAVAILABLE and the server reports
    NOT_SERVING, so the liveness probe restarts it."""
    watchdog_floor_s: float = 30.0
    """WATCHDOG_FLOOR_S: the watchdog never fires on a batch younger than this (at least 1)."""
    frontends: int = 0
    """FRONTENDS: processes serving gRPC and HTTP on the pod's ports (SO_REUSEPORT), tokenizing and
    handing token rows to the one model process (admission, batching, the device). 1: all in
    one process. 0 (default): 1 on CPU; on a GPU, the container's cores less two (one for the
    model process's loop and worker), at most 8: one event loop serves ~1,300-2,500 single-text
    requests/s, a GPU can compute far more."""
    frontend_unresponsive_s: float = 20.0
    """FRONTEND_UNRESPONSIVE_S: a front end that has not asked the model process for its state
    (it does every 0.25 s) for this long is stuck: it is killed and started again. The pod's
    probes cannot tell: each reaches one of the N front ends."""
    gil_switch_interval_ms: float = 1.0
    """GIL_SWITCH_INTERVAL_MS: how long a thread may hold the GIL while another waits for it
    (Python's default is 5). The busy event loop holds it; the model worker waits for it to hand
    every batch over. 1 ms: host path 0.58-0.63 of a bare gRPC server's single-text rate against
    0.56 at 5 ms (bench/host_path.py, RESULTS)."""
    shutdown_grace_s: float = 20.0
    """SHUTDOWN_GRACE_S: how long SIGTERM waits for in-flight requests."""
    # Traces and logs (embedserve.tracing, embedserve.logs; docs/operations.md, "Traces and logs").
    log_format: str = "text"
    """LOG_FORMAT: text (default) or json: every line of the process and its front ends one JSON
    object (time, level, logger, message; a request's line adds rpc or method and route, status,
    reason, trace_id, duration_ms)."""
    access_log: bool = False
    """ACCESS_LOG: a line per served request too. Refused and failed requests always log one."""
    tracing: bool = False
    """Traces on: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is set, and
    neither OTEL_SDK_DISABLED=true nor OTEL_TRACES_EXPORTER=none. Spans go over OTLP/HTTP
    (protobuf): OTEL_EXPORTER_OTLP(_TRACES)_PROTOCOL, if set, must say http/protobuf. The other
    OTEL_* variables (service name, resource attributes, sampler, headers, batching) are the
    OpenTelemetry SDK's own."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        d = cls()
        s = EnvReader(env)
        settings = cls(
            model_path=s.str("MODEL_PATH", d.model_path),
            models=model_list.parse(s.str("MODELS", ""), env, POOLING_MODES, POOLING_ALIASES),
            device_memory_bytes=s.int("DEVICE_MEMORY_BYTES", d.device_memory_bytes),
            model_revision=s.str("MODEL_REVISION", d.model_revision),
            model_cache_dir=s.str("MODEL_CACHE_DIR", d.model_cache_dir),
            device=s.str("DEVICE", d.device),
            dtype=s.choice("DTYPE", d.dtype, ("auto", "float32", "float16", "bfloat16")),
            compile=s.choice("COMPILE", d.compile, ("auto", "graphs", "true", "false")),
            static_shapes=s.choice("STATIC_SHAPES", d.static_shapes, ("auto", "true", "false")),
            attention=s.choice("ATTENTION", d.attention, ("auto", "packed", "padded")),
            # true/false in any of the boolean spellings, as when it was one.
            warm_start={"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}.get(
                w := s.choice("WARM_START", d.warm_start, ("true", "false", "refresh", "1", "yes", "on", "0", "no", "off")),
                w),
            compile_cache=s.choice("COMPILE_CACHE", d.compile_cache, ("pod", "shared")),
            grpc_port=s.int("GRPC_PORT", d.grpc_port),
            http_port=s.int("HTTP_HEALTH_PORT", d.http_port),
            host=s.str("BIND_HOST", d.host),
            metrics_port=s.int("METRICS_PORT", d.metrics_port),
            api_keys=s.keys("API_KEYS"),
            api_keys_file=s.file("API_KEYS_FILE"),
            tls_cert_file=s.file("TLS_CERT_FILE"),
            tls_key_file=s.file("TLS_KEY_FILE"),
            tls_client_ca_file=s.file("TLS_CLIENT_CA_FILE"),
            max_batch_size=s.int("MAX_BATCH_SIZE", d.max_batch_size, low=1),
            max_tokens_per_batch=s.int("MAX_TOKENS_PER_BATCH", d.max_tokens_per_batch, low=1),
            buckets=s.int_list("BUCKETS", d.buckets),
            batch_caps=s.caps("BATCH_CAPS"),
            deadline_wait_ms=s.float("DEADLINE_WAIT_MS", d.deadline_wait_ms),
            gpu_queue_maxsize=s.int("GPU_QUEUE_MAXSIZE", d.gpu_queue_maxsize, low=1),
            batch_lookahead=s.optional_int("BATCH_LOOKAHEAD"),
            backpressure_throughput=s.bool("BACKPRESSURE_THROUGHPUT_ENABLED", d.backpressure_throughput),
            backpressure_latency=s.bool("BACKPRESSURE_LATENCY_ENABLED", d.backpressure_latency),
            max_drain_time_ms=s.float("MAX_DRAIN_TIME_MS", d.max_drain_time_ms, positive=True),
            reservation_horizon_ms=s.float("RESERVATION_HORIZON_MS", d.reservation_horizon_ms),
            max_connection_age_s=s.float("MAX_CONNECTION_AGE_S", d.max_connection_age_s),
            max_connection_age_grace_s=s.float("MAX_CONNECTION_AGE_GRACE_S", d.max_connection_age_grace_s),
            latency_soft_ms=s.float("LATENCY_SOFT_MS", d.latency_soft_ms, positive=True),
            latency_hard_ms=s.float("LATENCY_HARD_MS", d.latency_hard_ms, positive=True),
            latency_window_s=s.float("LATENCY_WINDOW_S", d.latency_window_s, positive=True),
            pooling=s.pooling("POOLING", POOLING_MODES, POOLING_ALIASES),
            normalize=s.optional_bool("NORMALIZE"),
            exclude_tokens=s.str_list("EXCLUDE_TOKENS"),
            truncate=s.bool("TRUNCATE", d.truncate),
            max_texts_per_request=s.int("MAX_TEXTS_PER_REQUEST", d.max_texts_per_request, low=1),
            long_texts=s.choice("LONG_TEXTS", d.long_texts, ("off", "window")),
            max_tokens_per_text=s.int("MAX_TOKENS_PER_TEXT", d.max_tokens_per_text),
            # `calibrated`, or r > 0 (read first: keyword arguments are evaluated in order).
            quantize_calibrated=(calibrated := s.str("QUANTIZE_RANGE", "").strip().lower() == "calibrated"),
            quantize_range=d.quantize_range if calibrated else s.float("QUANTIZE_RANGE", d.quantize_range, positive=True),
            max_message_bytes=s.int("GRPC_MAX_MESSAGE_BYTES", d.max_message_bytes),
            http_max_body_bytes=s.int("HTTP_MAX_BODY_BYTES", d.http_max_body_bytes),
            max_reply_bytes=s.int("MAX_REPLY_BYTES", d.max_reply_bytes, low=2**20),
            max_concurrent_requests=s.int("MAX_CONCURRENT_REQUESTS", d.max_concurrent_requests, low=1),
            http_body_timeout_s=s.float("HTTP_BODY_TIMEOUT_S", d.http_body_timeout_s, positive=True),
            served_model_name=s.str("SERVED_MODEL_NAME", d.served_model_name),
            task=s.choice("TASK", d.task, model_list.TASKS),
            trust_remote_code=s.bool("TRUST_REMOTE_CODE", d.trust_remote_code),
            tokenization_workers=s.int("TOKENIZATION_WORKERS", d.tokenization_workers, low=1),
            watchdog_multiple=s.float("WATCHDOG_MULTIPLE", d.watchdog_multiple, positive=True),
            # The watchdog looks every floor / 4 s (at most 1 s): under a second it would spin the
            # loop for nothing, and no device hang is told from a slow batch in less.
            watchdog_floor_s=s.float("WATCHDOG_FLOOR_S", d.watchdog_floor_s, low=1.0),
            frontends=s.int("FRONTENDS", d.frontends),
            # Front ends ask for the model's state every 0.25 s: below 1 s, every one would be killed.
            frontend_unresponsive_s=s.float("FRONTEND_UNRESPONSIVE_S", d.frontend_unresponsive_s, low=1.0),
            gil_switch_interval_ms=s.float("GIL_SWITCH_INTERVAL_MS", d.gil_switch_interval_ms),
            shutdown_grace_s=s.float("SHUTDOWN_GRACE_S", d.shutdown_grace_s),
            log_format=s.choice("LOG_FORMAT", d.log_format, ("text", "json")),
            access_log=s.bool("ACCESS_LOG", d.access_log),
            tracing=tracing_on(
                s.str("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "") or s.str("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
                s.bool("OTEL_SDK_DISABLED", False), s.str("OTEL_TRACES_EXPORTER", "otlp").lower(),
                s.str("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "") or s.str("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")),
        )
        if settings.latency_soft_ms > settings.latency_hard_ms:
            raise ConfigError("LATENCY_SOFT_MS must not exceed LATENCY_HARD_MS")
        _check_guards(settings)
        if settings.max_tokens_per_text and settings.long_texts == "off":
            raise ConfigError("MAX_TOKENS_PER_TEXT bounds windowed texts: it needs LONG_TEXTS=window")
        if not settings.max_message_bytes:
            text_bytes = settings.buckets[-1] * CHARS_PER_TOKEN_BOUND * 4
            # A windowed text may be read further (MAX_TOKENS_PER_TEXT): a message holds one such text
            # at least; the rest is the same bound as ever (the loop reads a message a few times over).
            most = max(settings.max_texts_per_request * text_bytes, text_tokens(settings) * CHARS_PER_TOKEN_BOUND * 4)
            settings = dataclasses.replace(settings, max_message_bytes=min(most + 2**20, MAX_DEFAULT_REQUEST_BYTES))
        if not settings.http_max_body_bytes:
            settings = dataclasses.replace(settings, http_max_body_bytes=min(2 * settings.max_message_bytes,
                                                                             MAX_DEFAULT_REQUEST_BYTES))
        return settings


def text_tokens(s: Settings, max_length: int = 0) -> int:
    """The most tokens one text is read for (MAX_TOKENS_PER_TEXT): a model's max length, or more
    for windowed texts (LONG_TEXTS=window). What the cut before tokenizing and the message limits
    follow. Pure."""
    if s.long_texts == "off":
        return max_length
    return max(s.max_tokens_per_text or WINDOWED_TOKENS, max_length)


def _check_guards(s: Settings) -> None:
    """The ports apart, and TLS's files in the pairs they only work in (what the files hold is
    checked as the server starts: transports/auth.py, tls.py)."""
    ports = {"GRPC_PORT": s.grpc_port, "HTTP_HEALTH_PORT": s.http_port, "METRICS_PORT": s.metrics_port}
    taken = [name for name, port in ports.items() if port and list(ports.values()).count(port) > 1]
    if taken:
        raise ConfigError(f"{' and '.join(taken)} are the same port ({ports[taken[0]]}): each needs its own")
    if bool(s.tls_cert_file) != bool(s.tls_key_file):
        given, missing = ("TLS_CERT_FILE", "TLS_KEY_FILE") if s.tls_cert_file else ("TLS_KEY_FILE", "TLS_CERT_FILE")
        raise ConfigError(f"{given} is set without {missing}: TLS needs both the certificate and its key")
    if s.tls_client_ca_file and not s.tls_cert_file:
        raise ConfigError("TLS_CLIENT_CA_FILE is set without TLS_CERT_FILE and TLS_KEY_FILE: client certificates "
                          "are asked for in a TLS handshake, which needs the server's own certificate")


def tracing_on(endpoint: str, sdk_disabled: bool, exporter: str, protocol: str) -> bool:
    """Whether spans are exported, from the standard OTEL_* variables (an endpoint, the SDK not
    disabled, the exporter not `none`); an exporter or protocol this server does not ship is a
    start-up error rather than spans silently sent nowhere."""
    if not endpoint or sdk_disabled or exporter == "none":
        return False
    if exporter != "otlp":
        raise ConfigError(f"OTEL_TRACES_EXPORTER={exporter!r}: this server exports otlp (or none)")
    if protocol.lower() != "http/protobuf":
        raise ConfigError(f"OTEL_EXPORTER_OTLP(_TRACES)_PROTOCOL={protocol!r}: this server exports OTLP over HTTP "
                          "(http/protobuf; a collector's port 4318)")
    return True


def served_model_name(settings: Settings) -> str:
    """The model id HTTP clients name (OpenAI `model`): SERVED_MODEL_NAME, else from MODEL_PATH."""
    if settings.served_model_name:
        return settings.served_model_name
    path = settings.model_path
    if path == PACKAGED_MODEL:
        return path.split(":", 1)[1]
    return path.rstrip("/").split("/")[-1] if path.startswith(("/", ".", "s3://")) else path
