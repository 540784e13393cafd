"""HTTP JSON API: OpenAI-compatible /v1/embeddings and /v1/models, TEI-style /embed (its other
routes: http_tei.py); a classifier's routes are in http_classify.py, a reranker's in
http_rerank.py, a sparse encoder's in http_sparse.py, and which model a request addresses in
http_models.py. Same service, same admission as gRPC; errors as JSON bodies with the right
status codes."""

from __future__ import annotations

import math
import time
from typing import Annotated, Literal, Union

import numpy as np
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, create_model

from embedserve.config import Settings, text_tokens
from embedserve.errors import InvalidInput, ModelFailure, NotReady, Overloaded, UnknownModel, WrongTask
from embedserve.admission.gate import Caller
from embedserve import tracing
from embedserve.transports import (budget, encodings, http_classify, http_embed_all, http_models, http_multivector, http_quantization, http_rerank,
                                   http_sparse, http_tei, json_reply, m3_reply, outcomes)
from embedserve.model.m3_rows import dense_of
from embedserve.transports.http_models import Addressed
from embedserve.transports.http_errors import error_reply
from embedserve.transports.hub import Hub
from embedserve.transports.schema import MAX_ITEMS, Text, Texts, texts
from embedserve.batching.shaping import ID_ROW_BOUND


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 429, 500, 503)}
_STATUS = (  # error → (HTTP status, OpenAI-style type)
    (InvalidInput, 400, "invalid_request_error"),
    (WrongTask, 400, "invalid_request_error"),
    (Overloaded, 429, "rate_limit_error"),
    (NotReady, 503, "service_unavailable"),
    (ModelFailure, 500, "server_error"),
    (UnknownModel, 404, "invalid_request_error"),
)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # Float first: pydantic's smart union tries members in order, and a float row failing list[int]
    # item by item cost 2-4x the whole response's validation (a quantized row is ints either way).
    embedding: Union[list[float], list[int], str]  # float, quantized, base64


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "embedfleet"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


INPUT_DOC = "A text, a list of texts, a list of token ids, or a list of token id lists."


def embeddings_input(ids_per_row: int, rows: int = MAX_ITEMS, vocab_size: int = 2**31):
    """/v1/embeddings' `input`: a text, 1..`rows` texts, or token-id rows (1..`rows` of them) at
    most `ids_per_row` long (shaping.ID_ROW_BOUND): the schema refuses a longer row on its length,
    before its ids are validated one by one. The vocabulary's bound is stated (the tokenizer
    checks it: 400 naming it), as /decode's is."""
    ids = Annotated[list[Annotated[int, Field(ge=0, json_schema_extra={"maximum": vocab_size - 1})]],
                    Field(min_length=1, max_length=ids_per_row, fail_fast=True)]
    return Union[Text, texts(rows), ids, Annotated[list[ids], Field(min_length=1, max_length=rows, fail_fast=True)]]


EmbeddingsInput = embeddings_input(ID_ROW_BOUND * Settings().buckets[-1])  # with the default buckets


class EmbeddingsRequest(BaseModel):
    input: EmbeddingsInput = Field(description=INPUT_DOC)  # each server's own bound: _embed_routes
    model: str = Field(description="The served model's id (GET /v1/models).")
    encoding_format: Literal["float", "base64", "int8", "uint8", "binary", "ubinary"] = Field(
        "float", description="float or base64 (float32 little-endian), as OpenAI's; extension: int8, uint8, binary, "
        "ubinary, quantized as sentence-transformers' quantize_embeddings over [-QUANTIZE_RANGE, QUANTIZE_RANGE] "
        "(lists of ints; binary packs 8 dimensions to a byte).")
    dimensions: int | None = Field(None, ge=1, description="Keep the first N dimensions (re-normalized where the model "
                                   "normalizes; default: the model's declared truncate_dim, else all).")
    user: str | None = None
    prompt_name: str | None = Field(None, description="Extension: one of the model's declared prompts, put "
                                    "before each text (default: its default prompt, if it declares one).")
    long_text: Literal["", "window"] = Field("", description="Extension: \"window\": texts over the model's max length are "
                                             "embedded whole, in windows pooled by their token counts (needs "
                                             "LONG_TEXTS=window; docs/api.md, \"Long texts\"); \"\": cut, or refused "
                                             "with truncate false.")


class TeiEmbedRequest(BaseModel):
    inputs: Union[Text, Texts]
    normalize: bool = True
    truncate: bool | None = Field(None, description="Cut over-long inputs (default: the server's TRUNCATE).")
    truncation_direction: Literal["Right", "right"] = Field("Right", description="Texts are cut at the end, "
                                                             "as sentence-transformers cuts them.")
    prompt_name: str | None = Field(None, description="One of the model's declared prompts, put before each "
                                    "text (default: its default prompt, if it declares one).")
    dimensions: int | None = Field(None, ge=1, description="Keep the first N dimensions (re-normalized where the "
                                   "vectors are normalized; default: the model's declared truncate_dim, else all).")
    encoding: Literal["float", "base64", "int8", "uint8", "binary", "ubinary"] = Field(
        "float", description="Extension: float (lists of floats), base64 (float32 little-endian per row), or "
        "quantized as sentence-transformers' quantize_embeddings over [-QUANTIZE_RANGE, QUANTIZE_RANGE] (lists of ints).")
    long_text: Literal["", "window"] = Field("", description="Extension: \"window\": texts over the model's max length are "
                                             "embedded whole, in windows pooled by their token counts (needs "
                                             "LONG_TEXTS=window; docs/api.md, \"Long texts\"); \"\": cut, or refused "
                                             "with truncate false.")


PROMPT_DOC = ("One of the model's declared prompts, put before each text (default: its default prompt, if "
              "it declares one).")


def _caller(request: Request) -> Caller:
    """A retry is marked by our header or by the openai client's retry counter; a caller that
    waits server-side for booked room says embedfleet-queue: wait."""
    retry = (request.headers.get("embedfleet-attempt", "1") not in ("", "0", "1")
             or request.headers.get("x-stainless-retry-count", "0") not in ("", "0"))
    trace = request.scope.get(tracing.SCOPE_KEY) if tracing.tracer is not None else None  # outcomes.http_begin
    return Caller(retry, waits=request.headers.get("embedfleet-queue") == "wait", trace=trace,
                  hedge=request.headers.get("embedfleet-hedge") == "1")


def _texts(inputs) -> list[str]:
    return [inputs] if isinstance(inputs, str) else list(inputs)


def _l2(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(norms == 0, 1, norms)


def register(app: FastAPI, server: Hub) -> None:
    """Error handlers and request metrics: installed before the app serves its first request."""
    for error, status, kind in _STATUS:
        def handler(request: Request, exc: Exception, status=status, kind=kind):
            headers = {}
            if isinstance(exc, NotReady):  # warming up, draining, a lost device: another pod, or later
                headers["Retry-After"] = "1"
                if server.draining:  # the response closes its connection: the retry reaches another pod
                    headers["retry-after-ms"] = str(DRAINING_RETRY_AFTER_MS)
            if isinstance(exc, Overloaded):
                # Seconds for every HTTP client; milliseconds for those that read them (the
                # openai client prefers retry-after-ms, and waits exactly that long).
                headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_ms / 1000)))
                headers["retry-after-ms"] = str(exc.retry_after_ms)
                if exc.final:  # sustained overload: the openai client obeys this before anything else
                    headers["x-should-retry"] = "false"
            return _error(status, kind, str(exc), getattr(exc, "reason", None), headers, request)

        app.add_exception_handler(error, handler)

    def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        """FastAPI's own 422, ASCII-escaped (the input it echoes back may hold a lone surrogate,
        JSON allows "\\ud800", which UTF-8 cannot encode: that was a 500), and brief: FastAPI
        lists an error per item, each echoing its input (3,000 texts over the limit answered
        620 KB; a 1 MB body, 36 MB)."""
        outcomes.noted_validation(request, exc.errors())
        return Response(error_reply(exc.errors()), status_code=422, media_type="application/json")

    app.add_exception_handler(RequestValidationError, invalid_body)


STARTING_RETRY_AFTER_S = 5
# A draining pod left its Service's endpoints before SIGTERM (preStop): a retry on a new connection
# goes to another pod at once, so the openai client (which prefers retry-after-ms) need not wait 1 s.
DRAINING_RETRY_AFTER_MS = 100
API_PATHS = frozenset(("/", "/embed", "/classify", "/v1/embeddings", "/v1/models", "/embed_sparse", "/rerank",
                       "/v1/rerank", http_quantization.PATH, http_multivector.PATH, http_embed_all.PATH)) | http_tei.PATHS
OBSERVED_PATHS = API_PATHS - {"/v1/models"}  # counted in the request metrics
BODY_PATHS = API_PATHS - {"/v1/models"}  # routes that read a JSON body (their budget: install_routes)
ID_PATHS = frozenset(("/decode",))  # of which token ids only
TEXT_OR_ID_PATHS = frozenset(("/v1/embeddings",))  # texts or token ids


def api_paths(hub) -> frozenset[str]:
    """API_PATHS, and under each model's prefix where several are served (http_models)."""
    return http_models.api_paths(API_PATHS, http_models.names(hub))


def budgets(s: Settings, max_length: int) -> dict[str, budget.Budget]:
    """Each body route's budget (transports/budget.py) for a model of `max_length` tokens."""
    return budget.route_budgets(BODY_PATHS - ID_PATHS - TEXT_OR_ID_PATHS, ID_PATHS, s.max_texts_per_request,
                                max_length, s.http_max_body_bytes, TEXT_OR_ID_PATHS, text_tokens(s, max_length))


def busy(request: Request) -> JSONResponse:
    """The answer past MAX_CONCURRENT_REQUESTS requests in progress on this process: another pod,
    or this one in a moment (the openai client retries a 429 after retry-after-ms)."""
    return _error(429, "rate_limit_error", "too many requests in progress on this server (MAX_CONCURRENT_REQUESTS)",
                  "too_many_requests_in_progress", {"Retry-After": "1", "retry-after-ms": "200"}, request)


def starting(request: Request, server: Hub, paths: frozenset[str] = API_PATHS) -> JSONResponse | None:
    """Before the models have loaded the API's routes do not exist yet (which ones the server
    offers depends on the models' tasks): they answer 503 with Retry-After, not 404. `paths`:
    `api_paths(server)`."""
    if server.service is not None or request.url.path not in paths:
        return None
    return _error(503, "service_unavailable", "server is warming up", None,
                  {"Retry-After": str(STARTING_RETRY_AFTER_S)}, request)


def install_routes(app: FastAPI, hub: Hub) -> None:
    """The API for the loaded models' tasks (known once they have loaded), so the OpenAPI
    document says exactly what this server does. At the root, the default model's routes, as a
    one-model server has them; with several models (http_models) also the routes whose payload
    names its model (/v1/embeddings, /v1/rerank) for every task served, and each model's whole
    API under /models/<name>/."""
    views = [Addressed(hub, m) for m in hub.models.values()]
    default, s = views[0], hub.settings
    router = APIRouter()
    # What a body may hold (transports/budget.py): named from the models' max lengths, now known.
    # At the root a payload may name any model: the longest's.
    app.state.budgets = budgets(s, max(v.service.tokenizer.max_length for v in views))

    @router.get("/v1/models", response_model=ModelList)
    async def models():
        created = int(time.time() - (time.monotonic() - hub.started_at))
        return ModelList(data=[Model(id=v.served_name, created=created) for v in views])

    installed = _model_routes(router, default)
    for task, view in {v.task: v for v in reversed(views[1:])}.items():  # the first of each task
        if task in ("embed", "bgem3") and "/v1/embeddings" not in installed:  # bgem3: dense by default
            _openai_route(router, view, http_models.service_of(view))
        elif task in ("rerank", "multivector") and "/v1/rerank" not in installed:
            http_rerank.install_v1(router, view, http_models.service_of(view), _caller, ERRORS, _error)
    refusals(router, {r.path for r in router.routes}, http_models.service_of(default))
    for view in views if http_models.names(hub) else ():
        prefix = http_models.PREFIX + view.served_name
        own = APIRouter()
        _model_routes(own, view)
        refusals(own, {r.path for r in own.routes}, http_models.service_of(view))
        router.include_router(own, prefix=prefix)
        for route in [r for r in own.routes if r.path == "/"]:  # the prefix itself is TEI's root (a client's base URL)
            router.add_api_route(prefix, route.endpoint, methods=list(route.methods), include_in_schema=False,
                                 response_model=route.response_model,
                                 response_model_exclude_none=route.response_model_exclude_none)
        own_budgets = budgets(s, view.service.tokenizer.max_length)
        app.state.budgets.update({prefix + path: b for path, b in own_budgets.items()})
        app.state.budgets[prefix] = own_budgets["/"]  # the prefix alone is its "/"
    app.include_router(router)
    app.openapi_schema = None  # regenerate with the new routes


def _model_routes(router: APIRouter, server: Addressed) -> set[str]:
    """One model's routes, for its task (a one-model server's API); → the paths installed."""
    service = http_models.service_of(server)
    if server.task == "classify":
        http_classify.install(router, server, service, _caller, ERRORS)
    elif server.task == "sparse":
        http_sparse.install(router, server, service, _caller, Union[Text, texts(server.settings.max_texts_per_request)],
                            _prompt_field(server, PROMPT_DOC), ERRORS)
    elif server.task == "rerank":
        http_rerank.install(router, server, service, _caller, ERRORS, _error)
    elif server.task == "multivector":  # its token vectors, and rerank by MaxSim (/ is its embedding route)
        http_multivector.install(router, server, service, _caller, Union[Text, texts(server.settings.max_texts_per_request)],
                                 ERRORS)
        http_rerank.install(router, server, service, _caller, ERRORS, _error, root=False)
    else:
        _embed_routes(router, server, service)
    if server.task == "embed":  # TEI's raw token states
        http_embed_all.install(router, server, service, _caller, Union[Text, texts(server.settings.max_texts_per_request)],
                               _prompt_field(server, PROMPT_DOC), ERRORS)
    if server.task == "bgem3":  # BGE-M3's lexical weights, as a sparse model answers them (TEI's shape)
        m3_reply.install_sparse(router, server, service, _caller, Union[Text, texts(server.settings.max_texts_per_request)],
                                _prompt_field(server, PROMPT_DOC), ERRORS)
    http_tei.install_tokenizer(router, server, service, lambda description: _prompt_field(server, description), ERRORS)
    return {r.path for r in router.routes}


# Each task's own paths. A server answers another task's with 400 naming what to use (WrongTask),
# not 404: the caller reached the right service for the wrong model.
TASK_PATHS = {"embed": ("/embed", "/v1/embeddings", "/similarity", http_embed_all.PATH), "classify": ("/classify",),
              "rerank": ("/rerank", "/v1/rerank"), "sparse": ("/embed_sparse",), "multivector": (http_multivector.PATH,)}


def refusals(router: APIRouter, installed: set[str], service) -> None:
    """Another task's paths, where nothing serves them: 400 naming what the model serves."""
    def refuse(path: str, task: str) -> None:
        async def wrong_task():
            svc = service()
            svc.require_task(task)  # raises WrongTask: 400, naming what to use
            # A model that also answers `task`'s calls (bgem3: embed's) but not this route of it
            # (/embed_all: an embed model's token states): still a refusal, never a silent 200.
            raise WrongTask(f"{path} is not served for this model (TASK={svc.task}): its routes are in /openapi.json")

        router.post(path, include_in_schema=False)(wrong_task)

    for task, paths in TASK_PATHS.items():
        for path in paths:
            if path not in installed:
                refuse(path, task)


def _prompt_field(server: Hub, description: str):
    """prompt_name as the schema says it: one of the model's declared prompt names (none: only
    null). Any other name is refused with 400, naming the ones there are."""
    names = sorted(server.head.prompts) if server.head else []
    return (str | None, Field(None, description=description, json_schema_extra={"enum": [*names, None]}))


def _dimensions_field(server: Hub, description: str):
    """dimensions as the schema says it: 1 to the model's dimensions. Over that is refused with 400
    naming the limit (encodings.output_dimensions), as an unknown prompt_name is."""
    top = {"maximum": server.model_dimension} if server.model_dimension else {}
    return (int | None, Field(None, ge=1, description=description, json_schema_extra=top))


def _long_text_field(server: Hub, description: str):
    """long_text as the schema says it: "window" only where this server windows (LONG_TEXTS=window,
    task embed); elsewhere "" alone, so asking is a 422 naming the field, as the schema states."""
    windows = server.settings.long_texts == "window" and server.task == "embed"
    return (Literal["", "window"] if windows else Literal[""], Field("", description=description))


def _embed_routes(router: APIRouter, server: Hub, service) -> None:
    s = server.settings
    _openai_route(router, server, service)

    normalized = server.head.normalize if server.head else True
    # A normalizing server cannot return raw vectors: its schema says so (normalize: true only).
    tei_request = create_model("TeiEmbedRequest", __base__=TeiEmbedRequest, normalize=(
        (Literal[True], Field(True, description="This model normalizes (a Normalize module, or NORMALIZE=true).")) if normalized else (bool, True)),
        prompt_name=_prompt_field(server, TeiEmbedRequest.model_fields["prompt_name"].description),
        dimensions=_dimensions_field(server, TeiEmbedRequest.model_fields["dimensions"].description),
        inputs=(Union[Text, texts(s.max_texts_per_request)], ...), outputs=m3_reply.outputs_field(server.task),
        long_text=_long_text_field(server, TeiEmbedRequest.model_fields["long_text"].description))

    async def embed(body, request: Request):
        """TEI-style embeddings: one vector per input."""
        svc = service()
        inputs = _texts(body.inputs)
        asked = m3_reply.wanted(body.outputs, server.task)  # bgem3's outputs (m3_reply); else dense only
        dims = _answer_fits(server, len(inputs), body.dimensions, body.encoding)  # before any work
        out = (await svc.embed_texts(inputs, _caller(request), body.truncate, prompt_name=body.prompt_name,
                                     long_text=body.long_text, outputs=asked)).rows
        rows = dense_of(out)
        rows = _l2(rows) if body.normalize and not normalized else rows
        rows = encodings.truncated(rows, dims, normalized or body.normalize)
        reply = json_reply.Reply(s.max_reply_bytes, "the answer")
        if asked != (m3_reply.DENSE,):
            await reply.array(m3_reply.items(out, rows, asked, body.encoding, server.quantization, s.max_reply_bytes))
            return reply.response()
        await reply.array(json_reply.vectors(rows, body.encoding, server.quantization, normalized or body.normalize))
        return reply.response()

    embed.__annotations__.update(body=tei_request, request=Request)
    answer = Union[list[list[float]], list[list[int]], list[str]]  # float (first: see Embedding), quantized, base64
    router.post("/embed", response_model=answer, responses=ERRORS)(embed)
    # TEI's other routes, and / (its route for the model's task: huggingface_hub's
    # InferenceClient(model=URL) posts there), which takes /embed's and /similarity's payloads.
    http_tei.install(router, server, service, embed, tei_request, _caller,
                     lambda description: _prompt_field(server, description), ERRORS)
    http_quantization.install(router, server, ERRORS)  # GET /quantization: the int8/uint8 ranges


def _openai_route(router: APIRouter, server: Addressed, service) -> None:
    """/v1/embeddings, for the model its payload names (the schema's from `server`'s)."""
    s = server.settings
    openai_request = create_model("EmbeddingsRequest", __base__=EmbeddingsRequest, prompt_name=_prompt_field(
        server, EmbeddingsRequest.model_fields["prompt_name"].description),
        dimensions=_dimensions_field(server, EmbeddingsRequest.model_fields["dimensions"].description),
        input=(embeddings_input(ID_ROW_BOUND * s.buckets[-1], s.max_texts_per_request,
                                server.service.tokenizer.vocab_size), Field(description=INPUT_DOC)),
        outputs=m3_reply.outputs_field(server.task),
        long_text=_long_text_field(server, EmbeddingsRequest.model_fields["long_text"].description))

    async def embeddings(body, request: Request):
        """OpenAI-compatible embeddings."""
        m = server.model(body.model, request)  # UnknownModel: 404 naming the served ones
        svc = http_models.use(request, m, "embed")
        inp = body.input
        ids = isinstance(inp, list) and inp and isinstance(inp[0], (int, list))
        if ids and (body.prompt_name or body.long_text):
            raise InvalidInput(f"{'prompt_name' if body.prompt_name else 'long_text'} applies to texts, not to token ids")
        inputs = ([inp] if isinstance(inp[0], int) else inp) if ids else _texts(inp)
        asked = m3_reply.wanted(body.outputs, m.task)  # bgem3's outputs (m3_reply); else dense only
        dims = _answer_fits(m, len(inputs), body.dimensions, body.encoding_format)  # before any work
        if ids:
            result = await svc.infer_ids(inputs, _caller(request), outputs=asked)
        else:
            result = await svc.embed_texts(inputs, _caller(request), prompt_name=body.prompt_name, long_text=body.long_text,
                                           outputs=asked)
        normalized = bool(m.head and m.head.normalize)
        rows = encodings.truncated(dense_of(result.rows), dims, normalized)
        reply = json_reply.Reply(s.max_reply_bytes, "the answer")
        await reply.add('{"object":"list","data":')
        if asked != (m3_reply.DENSE,):
            await reply.array(m3_reply.items(result.rows, rows, asked, body.encoding_format, m.quantization,
                                             s.max_reply_bytes, "embedding", lambda i: f'"object":"embedding","index":{i},'))
        else:
            await reply.array(f'{{"object":"embedding","index":{i},"embedding":{row}}}' for i, row in
                              enumerate(json_reply.vectors(rows, body.encoding_format, m.quantization, normalized)))
        await reply.add(f',"model":{json_reply.dumps(m.served_name)},"usage":{{"prompt_tokens":{result.tokens},'
                        f'"total_tokens":{result.tokens}}}}}')
        return reply.response()

    embeddings.__annotations__.update(body=openai_request, request=Request)  # classes made here, not names
    # The answer is written as JSON text a row at a time (json_reply.py); its schema is stated.
    router.post("/v1/embeddings", response_model=EmbeddingsResponse, responses=ERRORS)(embeddings)


def _answer_fits(server: Hub, inputs: int, dimensions: int | None, encoding: str) -> int:
    """The dimensions an answer will have (`dimensions`, else the model's declared truncate_dim,
    else all: 400 naming the field above the model's), and that answer within MAX_REPLY_BYTES
    (ReplyTooLarge, 400): both refused before any work."""
    encodings.check_dimensions(dimensions, server.model_dimension)
    declared = server.head.truncate_dim if server.head else None
    dims = encodings.output_dimensions(dimensions, declared, server.model_dimension)
    encodings.check_reply(inputs, dims, encoding, True, server.settings.max_reply_bytes)
    return dims


def _error(status: int, kind: str, message: str, code: str | None = None, headers: dict | None = None,
           request: Request | None = None) -> JSONResponse:
    """An error's JSON answer; `request`: the one it answers, whose log line and span then say why."""
    if request is not None:
        outcomes.note(request, message)
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, code=code)).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)
