"""Every gRPC method within one budget: a request's wire bytes are counted before they are
decoded, for every method of every service the server registers (embedfleet.v1.Inference,
grpc.health.v1, reflection, and any added later: the interceptor wraps each handler as it is
looked up, not from a list).

Why. gRPC bounds a message's bytes (GRPC_MAX_MESSAGE_BYTES, 17 MiB by default), not what it
holds: 17 MiB of one-character texts are 5.9 M strings, and decoding them held the event loop
0.3-0.7 s before any check could count them. A message's top-level fields are walked first
(a varint key, then a length to skip: a big text costs one step), at most `limit` of them
(MAX_TEXTS_PER_REQUEST texts and a few other fields); past that the call is refused with
INVALID_ARGUMENT naming the count, and the message is never decoded. A packed repeated field
is one field (its values are counted where it is read: batching.infer_decode)."""

from __future__ import annotations

import inspect

import grpc

FIELDS_BESIDE_TEXTS = 64  # the most fields a request has besides its repeated texts (a few, each once)


def top_level_fields(data: bytes, limit: int) -> int:
    """Top-level fields in a protobuf message's wire bytes; a count over `limit` is returned as soon
    as it is reached. Malformed bytes end the walk (the parser refuses them). Pure."""
    pos, count, end = 0, 0, len(data)
    while pos < end:
        count += 1
        if count > limit:
            return count
        key, pos = _varint(data, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length, pos = _varint(data, pos)
            pos += length
        elif wire == 5:
            pos += 4
        else:  # groups (proto2) or garbage: not ours to judge
            return count
    return count


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            break
    return value, len(data)


class _Refused:
    """What a counted-out request decodes to: the call ends INVALID_ARGUMENT with `message`."""

    def __init__(self, message: str):
        self.message = message


class WireBudget(grpc.aio.ServerInterceptor):
    """Each method's request deserializer counts the fields first (at most `limit`). Handlers are
    wrapped once per method and kept."""

    def __init__(self, limit: int):
        self.limit = limit
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        wrapped = self._wrapped.get(details.method)
        if wrapped is None:
            wrapped = self._wrapped[details.method] = self._wrap(handler)
        return wrapped

    def _wrap(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        decode, limit = handler.request_deserializer, self.limit

        def counted(data: bytes):
            if top_level_fields(data, limit) > limit:
                message = (f"the request has more than {limit} fields (MAX_TEXTS_PER_REQUEST texts and "
                           f"{FIELDS_BESIDE_TEXTS} others at most): refused before it was decoded")
                if handler.request_streaming:  # a stream's message: the call fails (gRPC answers INTERNAL)
                    raise ValueError(message)
                return _Refused(message)
            return decode(data)

        if handler.request_streaming:
            return handler._replace(request_deserializer=counted)
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        behavior = getattr(handler, kind)

        if inspect.isasyncgenfunction(behavior):  # replies yielded
            async def guarded(request, context):
                if isinstance(request, _Refused):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                async for reply in behavior(request, context):
                    yield reply
        else:  # a reply returned, or (streaming) written with context.write
            async def guarded(request, context):
                if isinstance(request, _Refused):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await behavior(request, context)

        return handler._replace(request_deserializer=counted, **{kind: guarded})
