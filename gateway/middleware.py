"""Pure-ASGI middlewares that must act before FastAPI parses anything: API keys and body size.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect detection pass
through untouched. They answer with the same OpenAI-style error bodies as the app.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth import ApiKeyAuth
from gateway.errors import GatewayError, openai_error_body


async def _send_json_error(send: Send, status: int, message: str, code: str | None,
                           headers: dict[str, str] | None = None) -> None:
    """For the pure-ASGI middlewares, which run outside FastAPI's exception handlers."""
    body = json.dumps(openai_error_body(status, message, None, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """413 for bodies over the limit, decided before anything parses them.

    Checks Content-Length, then reads the body itself (covering chunked uploads) and replays it
    to the app; after the replay, receive() is the server's again so disconnects still arrive.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, on_error: Callable[[int], None]) -> None:
        self.app, self.max_bytes, self.on_error = app, max_bytes, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_big = f"request body exceeds the limit of {self.max_bytes} bytes"
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    self.on_error(400)
                    return await _send_json_error(send, 400, "invalid Content-Length header", None)
                if declared > self.max_bytes:
                    self.on_error(413)
                    return await _send_json_error(send, 413, too_big, "request_too_large")
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                self.on_error(413)
                return await _send_json_error(send, 413, too_big, "request_too_large")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


# vLLM's tokenizer endpoints live at the root, where clients look for them; they take keys too
KEYED_ROOT_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})


class AuthMiddleware:
    """Bearer API keys + per-key rate limit on /v1/* and the tokenizer endpoints, checked before
    the body is even read."""

    def __init__(self, app: ASGIApp, auth: ApiKeyAuth, on_error: Callable[[int], None]) -> None:
        self.app, self.auth, self.on_error = app, auth, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.auth.enabled and (
                scope["path"].startswith("/v1/") or scope["path"] in KEYED_ROOT_PATHS):
            header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            try:
                self.auth.check(header)
            except GatewayError as e:
                self.on_error(e.http_status)
                headers = e.http_headers()
                if e.http_status == 401:
                    headers["WWW-Authenticate"] = "Bearer"
                return await _send_json_error(send, e.http_status, e.message, e.err_code, headers)
        return await self.app(scope, receive, send)
