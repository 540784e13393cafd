"""The model process's answers to its front ends (FRONTENDS > 1): what the model is (once it is
ready), token rows in and vectors or a named refusal out, /health, and the shared signal.
Admission, its estimator and the batcher stay here: one home each, one view for all front ends."""

from __future__ import annotations

import dataclasses

import numpy as np

from embedserve import metrics, tracing
from embedserve.frontends import ipc, token_rows_ipc
from embedserve.model.token_rows import TokenRows
from embedserve.errors import KNOWN, NotReady, to_wire
from embedserve.admission.gate import Caller
from embedserve.model.m3_rows import M3Rows


DRAIN_CAP_S = 1e6  # an infinite drain (no service rate yet) as JSON can carry it: past drain.UNKNOWN_MS


class ModelDoor:
    def __init__(self, server, path: str):
        self.server = server
        # Every reply carries the backlog as it is when sent: a front end answers its caller with
        # it (transports/drain.py), and a queue building shows at once, not 0.25 s later.
        self.door = ipc.Door(path, {"hello": self.hello, "rows": self.rows, "state": self.state},
                             stamp=lambda: {"drain_s": min(server.drain_s(), DRAIN_CAP_S)})

    @property
    def heard(self) -> dict[int, float]:
        """Front end pid → when it last said hello or asked for the state (every STATE_EVERY_S):
        how the model process knows each front end's loop still turns."""
        return self.door.heard

    def start(self) -> None:
        self.door.start()

    async def close(self) -> None:
        await self.door.close()

    async def hello(self, header: dict, payload) -> ipc.Message:
        """Answered once the models are ready: what a front end needs to shape requests for each,
        the default first; their calibrations (if any) end to end in the payload, in that order."""
        await self.server.loaded.wait()
        said = [model_hello(m) for m in self.server.models.values()]
        return {"models": [header for header, _ in said]}, b"".join(data for _, data in said)

    async def rows(self, header: dict, payload) -> ipc.Message:
        ids = np.frombuffer(payload, dtype="<i4").reshape(header["rows"], header["width"])
        lengths = np.asarray(header["lengths"], dtype=np.int64)
        # A traced request (its front end's span): stamped here too, the stamps sent back with the answer.
        trace = tracing.Recorder() if "trace" in header else None
        caller = Caller(header["retry"], header["deadline"], header["waits"], trace, header["hedge"])
        data = b""
        try:
            model = self.server.model(header.get("model"))
            if model.service is None:
                raise NotReady("server is warming up")
            owners = np.asarray(header["owners"], dtype=np.int64) if "owners" in header else None  # windows: their texts
            result = await model.service.rows(ids, lengths, header["key"], caller, owners)
        except KNOWN as e:
            reply = to_wire(e)
        else:
            if isinstance(result.rows, TokenRows):  # token vectors (multivector): offsets and vectors
                reply, data = token_rows_ipc.reply(result.rows, result.tokens)
            elif model.task == "sparse":  # CSR from the worker on (embedserve.model.sparse_rows)
                csr = result.rows
                reply = {"rows": csr.shape[0], "dim": csr.dim, "nnz": len(csr.values), "tokens": result.tokens}
                data = csr.to_bytes()
            elif isinstance(result.rows, M3Rows):  # task bgem3: its three outputs (embedserve.model.m3_rows)
                reply, data = result.rows.wire()
                reply["tokens"] = result.tokens
            else:
                out = np.ascontiguousarray(result.rows, dtype="<f4")
                reply, data = {"rows": out.shape[0], "dim": out.shape[1], "tokens": result.tokens}, out.tobytes()
        if trace is not None:
            reply["trace"] = trace.to_wire()
        return reply, data

    async def state(self, header: dict, payload) -> ipc.Message:
        """/health's fields and the shared signal, for a front end's probes and /metrics."""
        s = self.server
        return {"health": s.health_fields(), "healthy": s.healthy, "signal": metrics.signal(s)}, b""



def model_hello(m) -> tuple[dict, bytes]:
    """One model's part of the hello (a model_stack.ModelStack) and its calibration's bytes."""
    head = dataclasses.asdict(m.head) if m.head else None
    if head:
        head["dense"] = []  # the model process runs the head; front ends only read prompts and lengths
        head.pop("splade", None)
        head.pop("multivector", None)  # a multi-vector model's: its prompts are in `prompts`, its lengths in the tokenizer's spec
        head.pop("logit_score", None)  # an LLM reranker's answer tokens: the model process scores
    q = m.quantization  # int8/uint8's ranges: the calibration's vectors travel in the payload
    calibration = q.calibration if q.calibrated else np.zeros((0, 0), dtype=np.float32)
    return ({"name": m.name, "task": m.task, "labels": m.labels, "activation": m.activation, "head": head,
             "tokenizer": m.service.tokenizer.spec, "simulated": m.service.head is None,
             "model_dimension": m.model_dimension,
             "quantization": {"r": q.r, "normalized": q.normalized, "digest": q.digest, "shape": list(calibration.shape)}},
            np.ascontiguousarray(calibration, "<f4").tobytes())
