"""One error type for the whole gateway, and its two renderings (gRPC status, OpenAI JSON).

Validation, steering resolution and the scheduler all fail with a `GatewayError` that carries a
gRPC status code, so the public gRPC API can abort with it unchanged and REST can map it to an
HTTP status the way DESIGN.md's Contracts section says (400/404/429/503).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import grpc

# gRPC code -> HTTP status. Anything not listed is an internal error (500).
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

# The scheduler puts its retry hint for RESOURCE_EXHAUSTED in this (trailing) metadata key.
RETRY_AFTER_MD = "retry-after-ms"
PARAM_MD = "cde-param"            # the offending request field, as the gRPC request spells it
DEFAULT_RETRY_AFTER_MS = 1000


def error_type(status: int) -> str:
    """OpenAI's `error.type` for an HTTP status (clients switch on the status, humans read this)."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


@dataclass
class GatewayError(Exception):
    """A failure the client should see, with the gRPC code that classifies it.

    `param` names the offending request field (OpenAI's `error.param`); `err_code` is the
    machine-readable OpenAI `error.code` (e.g. "model_not_found"); `retry_after_ms` is set for
    RESOURCE_EXHAUSTED when the scheduler (or the rate limiter) gave a hint.
    """

    code: grpc.StatusCode
    message: str
    param: str | None = None
    err_code: str | None = None
    retry_after_ms: int | None = None
    http_status_override: int | None = None

    def __post_init__(self) -> None:
        self.message = clip_message(self.message)
        super().__init__(self.message)

    @property
    def http_status(self) -> int:
        return self.http_status_override or HTTP_STATUS.get(self.code, 500)

    def body(self) -> dict[str, Any]:
        return openai_error_body(self.http_status, clip_message(self.message), self.param, self.err_code)

    def http_headers(self) -> dict[str, str]:
        if self.retry_after_ms is None:
            return {}
        return {"Retry-After": str(retry_after_seconds(self.retry_after_ms))}

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """For gRPC clients: the retry hint and the offending field's gRPC path (`cde-param`)."""
        md: tuple[tuple[str, str], ...] = ()
        if self.retry_after_ms is not None:
            md += ((RETRY_AFTER_MD, str(self.retry_after_ms)),)
        if self.param:
            md += ((PARAM_MD, utf8_safe(grpc_field(self.param))[:256].encode("ascii", "replace").decode()),)
        return md


# The pipeline names fields as the REST API spells them; the public gRPC API's messages spell
# some differently (cde.v1.GenerateRequest). Paths not listed are the same in both.
_GRPC_FIELDS = {
    "messages": "chat", "max_tokens": "decode.max_new_tokens", "tokens_per_step": "decode.tokens_per_step",
    "decode.stride": "decode.isd_stride", "decode.threshold": "decode.confidence_threshold",
    "stop_token_ids": "decode.stop_ids", "seed": "decode.seed",
    "use_entropy_sampling": "sampling.use_entropy_sampling", "temperature": "sampling.temperature",
    "top_p": "sampling.top_p", "repetition_penalty": "sampling.repetition_penalty",
    "steering.cutoff": "steering.cutoff_tokens",
}
_CONCEPT_ID = re.compile(r"^(steering\.concepts\[\d+\])\.id$")


def grpc_field(param: str) -> str:
    """The gRPC request's path for a REST field path (`max_tokens` -> `decode.max_new_tokens`)."""
    m = _CONCEPT_ID.match(param)
    if m:
        return f"{m.group(1)}.concept_id"
    return _GRPC_FIELDS.get(param, param)


def grpc_message(message: str, param: str | None) -> str:
    """The error message as a gRPC client reads it: the REST field's name, where the message
    says it, replaced by the gRPC path."""
    if not param or grpc_field(param) == param:
        return message
    return re.sub(rf"(?<![\w.\[]){re.escape(param)}(?![\w\[])", grpc_field(param), message, count=1)


MESSAGE_MAX_CHARS = 1024   # an error that quotes a client's 1 MiB field must still fit gRPC's 8 KiB metadata


def clip_message(message: str, limit: int = MESSAGE_MAX_CHARS) -> str:
    """An error message cut to `limit` characters: messages quote the client's input (a model name,
    a request id, a chat role), which can be as long as the body allows."""
    if len(message) <= limit:
        return message
    return message[:limit - 40] + f"... [{len(message) - limit + 40} characters cut]"


def retry_after_seconds(ms: int) -> int:
    """HTTP Retry-After is whole seconds; round up and never say 0 (clients would hammer)."""
    return max(1, math.ceil(ms / 1000))


def utf8_safe(text: str) -> str:
    """Lone surrogates (legal JSON escapes such as "\\ud800", but not encodable as UTF-8) become
    U+FFFD, the repair the tokenizers apply, so client text fits a proto string field and an
    error body that quotes it can still be encoded."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def openai_error_body(status: int, message: str, param: str | None = None,
                      code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": utf8_safe(message), "type": error_type(status),
                      "param": None if param is None else utf8_safe(param), "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, message, param, code)


def from_rpc_error(err: grpc.aio.AioRpcError | grpc.RpcError, what: str) -> GatewayError:
    """Translate a backend's gRPC failure; `what` names the backend for the message.

    Codes that describe the request (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED) pass
    through with the backend's own detail; transport failures become UNAVAILABLE so the client
    sees 503 rather than a confusing internal error.
    """
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (err.details() if callable(getattr(err, "details", None)) else None) or ""
    # Without a hint, still tell HTTP clients to back off a little rather than retry at once.
    retry_ms = (_retry_hint(err) or DEFAULT_RETRY_AFTER_MS) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
        return GatewayError(code, details or f"{what} rejected the request")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return GatewayError(code, details or f"{what} is overloaded, retry later",
                            err_code="rate_limit_exceeded", retry_after_ms=retry_ms)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(code, f"{what}: deadline exceeded", err_code="timeout")
    if code == grpc.StatusCode.CANCELLED:
        return GatewayError(code, f"{what}: request cancelled")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                grpc.StatusCode.UNIMPLEMENTED):
        detail = f": {details}" if details else ""
        return GatewayError(grpc.StatusCode.UNAVAILABLE, f"{what} unavailable{detail}",
                            err_code="backend_unavailable")
    return GatewayError(code, details or f"{what} failed ({code.name})")


def _retry_hint(err: Any) -> int | None:
    for getter in ("trailing_metadata", "initial_metadata"):
        fn = getattr(err, getter, None)
        if not callable(fn):
            continue
        try:
            md = fn() or ()
        except Exception:  # noqa: BLE001 - metadata of a failed call may be unavailable
            continue
        for key, value in md:
            if key == RETRY_AFTER_MD:
                try:
                    return max(0, int(value))
                except (TypeError, ValueError):
                    return None
    return None
