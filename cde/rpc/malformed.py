"""Malformed request bytes -> INVALID_ARGUMENT on every cde.v1 server.

grpcio answers UNKNOWN ("Unexpected DecodeError") when a request message does not parse, which
reads like a server fault. `make_server` installs this interceptor, so the public gateway and
the internal services (scheduler, workers, steering, attribution) all say what happened. For a
streamed request (attribution's bidirectional stream) each message is checked as the handler
reads it: the first one that does not parse ends the call with INVALID_ARGUMENT.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc


class _Malformed:
    """Stands in for a request message that failed to parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def wrapper(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as e:  # noqa: BLE001 - DecodeError and whatever else a parser raises
            return _Malformed(e)
    return wrapper


async def _abort_malformed(request: _Malformed, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"malformed request message: {type(request.error).__name__}: {request.error}")


async def _checked(request_iterator, context: grpc.aio.ServicerContext):
    """The request stream, aborting the call at the first message that did not parse."""
    async for request in request_iterator:
        if isinstance(request, _Malformed):
            await _abort_malformed(request, context)
        yield request


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Methods of `prefix` answer INVALID_ARGUMENT to bytes that are not a valid request
    message; grpcio would answer UNKNOWN ("Unexpected DecodeError") for them."""

    def __init__(self, prefix: str = "/cde.v1.") -> None:
        self.prefix = prefix

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or not handler_call_details.method.startswith(self.prefix)
                or handler.request_deserializer is None):
            return handler
        parse = _lenient(handler.request_deserializer)
        if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
            inner_ss = handler.stream_stream

            async def stream_stream(request_iterator, context):
                async for ev in inner_ss(_checked(request_iterator, context), context):
                    yield ev
            return grpc.stream_stream_rpc_method_handler(stream_stream, parse, handler.response_serializer)
        if handler.request_streaming:
            return handler
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request, context):
                if isinstance(request, _Malformed):
                    await _abort_malformed(request, context)
                return await inner_uu(request, context)
            return grpc.unary_unary_rpc_method_handler(unary_unary, parse, handler.response_serializer)
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_us = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Malformed):
                    await _abort_malformed(request, context)
                async for ev in inner_us(request, context):
                    yield ev
            return grpc.unary_stream_rpc_method_handler(unary_stream, parse, handler.response_serializer)
        return handler
