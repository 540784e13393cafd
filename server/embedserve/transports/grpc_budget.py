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
is one field (its values are counted where it is read: batching.infer_decode). Messages shorter
than two bytes a field past the limit cannot hold more: not walked (a 512-text Embed of short
texts costs nothing here).

And streams: a streaming method (health's Watch, reflection, any added later) holds its call for as
long as its caller likes, and these are open without a key: at most MAX_OPEN_STREAMS of them at
once per process (RESOURCE_EXHAUSTED past it), so they cannot take the calls in progress
(MAX_CONCURRENT_REQUESTS) from the API's own."""

from __future__ import annotations

import inspect

import grpc

FIELDS_BESIDE_TEXTS = 64  # the most fields a request has besides its repeated texts (a few, each once)
MAX_OPEN_STREAMS = 64  # streaming calls at once, every streaming method together


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
        self.streams = 0  # streaming calls open now

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
            if len(data) > 2 * limit and top_level_fields(data, limit) > limit:
                message = (f"the request has more than {limit} fields (MAX_TEXTS_PER_REQUEST texts and "
                           f"{FIELDS_BESIDE_TEXTS} others at most): refused before it was decoded")
                if handler.request_streaming:  # a stream's message: the call fails (gRPC answers INTERNAL)
                    raise ValueError(message)
                return _Refused(message)
            return decode(data)

        if handler.request_streaming or handler.response_streaming:
            return self._streaming(handler, counted)
        behavior = handler.unary_unary

        async def guarded(request, context):
            if isinstance(request, _Refused):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await behavior(request, context)

        return handler._replace(request_deserializer=counted, unary_unary=guarded)

    def _streaming(self, handler: grpc.RpcMethodHandler, counted) -> grpc.RpcMethodHandler:
        """A streaming method's behavior counted among the MAX_OPEN_STREAMS; a unary request of
        one (Watch) is refused when counted out, a stream's messages end the call."""
        kind = {(False, True): "unary_stream", (True, False): "stream_unary", (True, True): "stream_stream"}[
            (handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, kind)
        budget = self

        async def admit(request, context) -> None:
            if isinstance(request, _Refused):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            if budget.streams >= MAX_OPEN_STREAMS:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_OPEN_STREAMS} streaming calls are "
                                    "open on this server already: retry later (a health check: use Check)")
            budget.streams += 1

        if inspect.isasyncgenfunction(behavior):  # replies yielded
            async def guarded(request, context):
                await admit(request, context)
                try:
                    async for reply in behavior(request, context):
                        yield reply
                finally:
                    budget.streams -= 1
        else:  # replies written with context.write (or one returned)
            async def guarded(request, context):
                await admit(request, context)
                try:
                    return await behavior(request, context)
                finally:
                    budget.streams -= 1

        return handler._replace(request_deserializer=counted, **{kind: guarded})
