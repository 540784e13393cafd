"""HTTP for a classifier (TASK=classify): `POST /classify` (the top label and its probability per
input, or every label's) and TEI's predict at `POST /` (every label with its score, best first).
Installed by embedserve.transports.http_api.install_routes, which hands over what both share (the
caller from the headers, the error responses), so this module needs nothing of it."""

from __future__ import annotations

from typing import Callable, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, create_model

from embedserve.admission.gate import Caller
from embedserve.errors import ReplyTooLarge
from embedserve.model import activation
from embedserve.transports import encodings, json_reply
from embedserve.transports.hub import Hub
from embedserve.transports.schema import Text, Texts, texts


class ClassifyRequest(BaseModel):
    inputs: Union[Text, Texts]
    all_scores: bool = Field(False, description="Also return every label's probability.")
    truncate: bool | None = None


class TeiPredictRequest(BaseModel):
    inputs: Union[Text, Texts]
    raw_scores: bool = Field(False, description="Logits instead of probabilities.")
    truncate: bool | None = None


class Prediction(BaseModel):
    label: str
    score: float


class Classification(BaseModel):
    label: str
    score: float
    scores: dict[str, float] | None = None


def _labels_fit(server: Hub, inputs: int, every_label: bool) -> None:
    """A classifier's answer within MAX_REPLY_BYTES: per input its top label, or every label with
    its score (`every_label`), as JSON."""
    label = max((len(json_reply.dumps(name).encode()) for name in server.labels), default=2)
    size = inputs * (label + 64 + (len(server.labels) * (label + encodings.JSON_FLOAT_BYTES + 16) if every_label else 0))
    if size > server.settings.max_reply_bytes:
        raise ReplyTooLarge(f"the answer to {inputs} inputs with the scores of {len(server.labels)} labels would be "
                            f"up to {size} bytes, over MAX_REPLY_BYTES={server.settings.max_reply_bytes}: send fewer "
                            "inputs")


def install(router: APIRouter, server: Hub, service: Callable, caller: Callable[[Request], Caller], errors: dict) -> None:
    """A classifier's routes on `router`: /classify, and TEI's predict at /."""
    s = server.settings
    inputs_field = (Union[Text, texts(s.max_texts_per_request)], ...)
    classify_request = create_model("ClassifyRequest", __base__=ClassifyRequest, inputs=inputs_field)
    predict_request = create_model("TeiPredictRequest", __base__=TeiPredictRequest, inputs=inputs_field)

    async def classify(body, request: Request):
        """Sequence classification (TASK=classify): the top label and its probability per input."""
        svc = service()
        inputs = texts_of(body.inputs)
        _labels_fit(server, len(inputs), body.all_scores)
        probs = activation.apply(server.activation, (await svc.embed_texts(inputs, caller(request), body.truncate)).rows)

        def one(row) -> str:
            top = int(row.argmax())
            scores = {label: float(p) for label, p in zip(server.labels, row)} if body.all_scores else None
            return json_reply.dumps({"label": server.labels[top], "score": float(row[top]), "scores": scores})

        reply = json_reply.Reply(s.max_reply_bytes, "the answer")
        await reply.array(map(one, probs))
        return reply.response()

    classify.__annotations__.update(body=classify_request, request=Request)
    router.post("/classify", response_model=list[Classification], responses=errors)(classify)

    async def predict(body, request: Request):
        """TEI's predict: every label with its score, best first; one list per input when the
        inputs are a list."""
        inputs = texts_of(body.inputs)
        _labels_fit(server, len(inputs), True)
        rows = (await service().embed_texts(inputs, caller(request), body.truncate)).rows
        scores = rows if body.raw_scores else activation.apply(server.activation, rows)

        def one(row) -> str:
            ranked = sorted(zip(server.labels, map(float, row)), key=lambda pair: -pair[1])
            return json_reply.dumps([{"label": label, "score": p} for label, p in ranked])

        reply = json_reply.Reply(s.max_reply_bytes, "the answer")
        if isinstance(body.inputs, str):
            await reply.add(one(scores[0]))
        else:
            await reply.array(map(one, scores))
        return reply.response()

    predict.__annotations__.update(body=predict_request, request=Request)
    router.post("/", response_model=Union[list[Prediction], list[list[Prediction]]], responses=errors,
                summary="Predict (TEI's /)")(predict)


def texts_of(inputs) -> list[str]:
    return [inputs] if isinstance(inputs, str) else list(inputs)
