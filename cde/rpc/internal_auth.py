"""Service-to-service authentication: a shared token that every internal call carries.

The internal services (scheduler, workers, steering, attribution) trust their callers with
prompts, placements and forged-looking results, so on a shared network they must know who
is calling. With ``CDE_INTERNAL_TOKEN_FILE`` set (a secret file holding one token of at
least 32 characters; compose mounts ``./secrets/internal_token``, the local launcher writes
one per run), every cde server refuses a ``cde.v1`` call without ``x-cde-internal-token:
<token>`` metadata (UNAUTHENTICATED), and every internal client channel (`internal_channel`)
sends it. Left out of the check: the health service (compose/Kubernetes probes), reflection,
and the public ``cde.v1.Generation`` (the gateway's API keys guard that one). Unset: no
check. mTLS is the alternative where the deployment provides certificates; see
docs/ARCHITECTURE.md "Failure behaviour".
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from pathlib import Path

import grpc

from cde.rpc.transport import channel_options

TOKEN_FILE_ENV = "CDE_INTERNAL_TOKEN_FILE"
TOKEN_MD = "x-cde-internal-token"
MIN_TOKEN_CHARS = 32
# Methods anyone may call: probes, schema reflection, the public API (API keys).
OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.", "/cde.v1.Generation/")


class TokenError(ValueError):
    """The token file is missing, unreadable or too short."""


def load_token(path: str | os.PathLike | None = None) -> str | None:
    """The shared token from ``path`` (default: $CDE_INTERNAL_TOKEN_FILE); None when unset."""
    path = path if path is not None else os.environ.get(TOKEN_FILE_ENV) or None
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise TokenError(f"{TOKEN_FILE_ENV}: cannot read {path}: {e}") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise TokenError(f"{TOKEN_FILE_ENV}: the token in {path} must be one line of at least "
                         f"{MIN_TOKEN_CHARS} non-space characters (e.g. `openssl rand -hex 32`)")
    return token


# ---- server side ------------------------------------------------------------------------------

async def _deny(context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        f"internal service: missing or wrong {TOKEN_MD} (set {TOKEN_FILE_ENV} on the caller)")


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that refuses the call."""
    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        async def uu(request, context):
            await _deny(context)
        return grpc.unary_unary_rpc_method_handler(uu, des, ser)
    if handler.unary_stream is not None:
        async def us(request, context):
            await _deny(context)
            yield  # pragma: no cover - abort raises
        return grpc.unary_stream_rpc_method_handler(us, des, ser)
    if handler.stream_unary is not None:
        async def su(request_iterator, context):
            await _deny(context)
        return grpc.stream_unary_rpc_method_handler(su, des, ser)

    async def ss(request_iterator, context):
        await _deny(context)
        yield  # pragma: no cover
    return grpc.stream_stream_rpc_method_handler(ss, des, ser)


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call outside OPEN_PREFIXES without the token."""

    def __init__(self, token: str, open_prefixes: Sequence[str] = OPEN_PREFIXES) -> None:
        self._token = token.encode()
        self.open_prefixes = tuple(open_prefixes)

    def allowed(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == TOKEN_MD:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._token)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.open_prefixes):
            return handler
        if self.allowed(handler_call_details.invocation_metadata):
            return handler
        return _denying_handler(handler)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """[InternalTokenInterceptor] when a token is configured, else []."""
    token = load_token()
    return [InternalTokenInterceptor(token)] if token else []


# ---- client side ------------------------------------------------------------------------------

def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    md = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()))
    md[TOKEN_MD] = token
    return grpc.aio.ClientCallDetails(details.method, details.timeout, md, details.credentials,
                                      details.wait_for_ready)


class _TokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self.token), request)


class _TokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self.token), request)


class _TokenStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self.token), request_iterator)


def internal_channel(target: str, options: Sequence[tuple] | None = None,
                     token: str | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to another cde service that sends the internal token (when one is
    configured: ``token`` or $CDE_INTERNAL_TOKEN_FILE)."""
    token = token if token is not None else load_token()
    opts = list(options) if options is not None else channel_options()
    if not token:
        return grpc.aio.insecure_channel(target, options=opts)
    interceptors = [_TokenUnaryUnary(token), _TokenUnaryStream(token), _TokenStreamStream(token)]
    return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)


def token_metadata() -> tuple[tuple[str, str], ...]:
    """Metadata for a synchronous internal call (tests, tools): the token, when configured."""
    token = load_token()
    return ((TOKEN_MD, token),) if token else ()


__all__ = ["TOKEN_FILE_ENV", "TOKEN_MD", "InternalTokenInterceptor", "TokenError", "internal_channel",
           "load_token", "server_interceptors", "token_metadata"]
