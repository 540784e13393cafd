from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Output(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DENSE: _ClassVar[Output]
    SPARSE: _ClassVar[Output]
    MULTIVECTOR: _ClassVar[Output]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLOAT: _ClassVar[Encoding]
    INT8: _ClassVar[Encoding]
    UINT8: _ClassVar[Encoding]
    BINARY: _ClassVar[Encoding]
    UBINARY: _ClassVar[Encoding]
DENSE: Output
SPARSE: Output
MULTIVECTOR: Output
FLOAT: Encoding
INT8: Encoding
UINT8: Encoding
BINARY: Encoding
UBINARY: Encoding

class EmbedRequest(_message.Message):
    __slots__ = ("texts", "prompt_name", "dimensions", "encoding", "truncate", "model", "long_text", "outputs")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LONG_TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    prompt_name: str
    dimensions: int
    encoding: Encoding
    truncate: bool
    model: str
    long_text: str
    outputs: _containers.RepeatedScalarFieldContainer[Output]
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., prompt_name: _Optional[str] = ..., dimensions: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., truncate: _Optional[bool] = ..., model: _Optional[str] = ..., long_text: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[Output, str]]] = ...) -> None: ...

class InferRequest(_message.Message):
    __slots__ = ("input_ids", "attention_mask", "shape", "dimensions", "encoding", "model")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    input_ids: bytes
    attention_mask: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dimensions: int
    encoding: Encoding
    model: str
    def __init__(self, input_ids: _Optional[bytes] = ..., attention_mask: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dimensions: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., model: _Optional[str] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "shape", "quantized", "encoding", "sparse", "multivector")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    MULTIVECTOR_FIELD_NUMBER: _ClassVar[int]
    embeddings: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    quantized: bytes
    encoding: Encoding
    sparse: EmbedSparseResponse
    multivector: MultiVectorResponse
    def __init__(self, embeddings: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., quantized: _Optional[bytes] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., sparse: _Optional[_Union[EmbedSparseResponse, _Mapping]] = ..., multivector: _Optional[_Union[MultiVectorResponse, _Mapping]] = ...) -> None: ...

class MultiVectorRequest(_message.Message):
    __slots__ = ("texts", "is_query", "truncate", "encoding", "model")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    IS_QUERY_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    is_query: bool
    truncate: bool
    encoding: Encoding
    model: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., is_query: _Optional[bool] = ..., truncate: _Optional[bool] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., model: _Optional[str] = ...) -> None: ...

class MultiVectorResponse(_message.Message):
    __slots__ = ("vectors", "offsets", "dimension", "quantized", "encoding")
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    vectors: bytes
    offsets: _containers.RepeatedScalarFieldContainer[int]
    dimension: int
    quantized: bytes
    encoding: Encoding
    def __init__(self, vectors: _Optional[bytes] = ..., offsets: _Optional[_Iterable[int]] = ..., dimension: _Optional[int] = ..., quantized: _Optional[bytes] = ..., encoding: _Optional[_Union[Encoding, str]] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("query", "texts", "truncate", "raw_scores", "model")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    query: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    truncate: bool
    raw_scores: bool
    model: str
    def __init__(self, query: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., truncate: _Optional[bool] = ..., raw_scores: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, scores: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedSparseResponse(_message.Message):
    __slots__ = ("indices", "values", "offsets", "dimension")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    indices: bytes
    values: bytes
    offsets: _containers.RepeatedScalarFieldContainer[int]
    dimension: int
    def __init__(self, indices: _Optional[bytes] = ..., values: _Optional[bytes] = ..., offsets: _Optional[_Iterable[int]] = ..., dimension: _Optional[int] = ...) -> None: ...

class HealthCheckRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class HealthCheckResponse(_message.Message):
    __slots__ = ("status", "accepting_requests", "queued_tokens", "service_rate_tokens_per_sec", "arrival_rate_tokens_per_sec", "estimated_drain_time_ms", "p95_server_side_latency_ms", "gpu_queue_depth", "embedding_dimension", "uptime_seconds", "model", "device", "reserved_tokens", "pooling", "normalize", "max_length", "prompts", "default_prompt_name", "sustained_overload", "task", "quantize_range", "quantize_calibration", "models")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_RATE_TOKENS_PER_SEC_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_RATE_TOKENS_PER_SEC_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_DRAIN_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    P95_SERVER_SIDE_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    GPU_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIMENSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RESERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    SUSTAINED_OVERLOAD_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_RANGE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    status: str
    accepting_requests: bool
    queued_tokens: int
    service_rate_tokens_per_sec: float
    arrival_rate_tokens_per_sec: float
    estimated_drain_time_ms: float
    p95_server_side_latency_ms: float
    gpu_queue_depth: int
    embedding_dimension: int
    uptime_seconds: float
    model: str
    device: str
    reserved_tokens: int
    pooling: str
    normalize: bool
    max_length: int
    prompts: _containers.RepeatedScalarFieldContainer[str]
    default_prompt_name: str
    sustained_overload: bool
    task: str
    quantize_range: float
    quantize_calibration: str
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[str] = ..., accepting_requests: _Optional[bool] = ..., queued_tokens: _Optional[int] = ..., service_rate_tokens_per_sec: _Optional[float] = ..., arrival_rate_tokens_per_sec: _Optional[float] = ..., estimated_drain_time_ms: _Optional[float] = ..., p95_server_side_latency_ms: _Optional[float] = ..., gpu_queue_depth: _Optional[int] = ..., embedding_dimension: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., model: _Optional[str] = ..., device: _Optional[str] = ..., reserved_tokens: _Optional[int] = ..., pooling: _Optional[str] = ..., normalize: _Optional[bool] = ..., max_length: _Optional[int] = ..., prompts: _Optional[_Iterable[str]] = ..., default_prompt_name: _Optional[str] = ..., sustained_overload: _Optional[bool] = ..., task: _Optional[str] = ..., quantize_range: _Optional[float] = ..., quantize_calibration: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...

class QuantizationRequest(_message.Message):
    __slots__ = ("dimensions", "normalized", "model")
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    dimensions: int
    normalized: bool
    model: str
    def __init__(self, dimensions: _Optional[int] = ..., normalized: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class QuantizationResponse(_message.Message):
    __slots__ = ("quantize_range", "calibration", "dimensions", "normalized", "ranges")
    QUANTIZE_RANGE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZED_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    quantize_range: float
    calibration: str
    dimensions: int
    normalized: bool
    ranges: bytes
    def __init__(self, quantize_range: _Optional[float] = ..., calibration: _Optional[str] = ..., dimensions: _Optional[int] = ..., normalized: _Optional[bool] = ..., ranges: _Optional[bytes] = ...) -> None: ...
