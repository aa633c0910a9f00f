"""The live view: static HTML/CSS/JS modules under gateway/static, served at /ui (linked from /).

No build step and nothing fetched from elsewhere: the files present at start-up form an
allowlist (a request can only name one of them, so there is no path to traverse; each is read
when asked for, so an edited file shows on reload) and are served
with a strict Content-Security-Policy: scripts, styles and API calls from this origin only, no
inline script or style, no framing. The page calls the same REST API as any client.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

STATIC_DIR = Path(__file__).resolve().parent / "static"

# 'self' only; connect-src covers the page's fetch() calls to /v1. No 'unsafe-inline' anywhere:
# the page sets sizes through the CSSOM (element.style.width), which CSP does not restrict.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",   # small files; a new gateway version is picked up at once
}
_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}


@dataclass(frozen=True)
class Asset:
    path: Path
    media_type: str


def load_assets(root: Path = STATIC_DIR) -> dict[str, Asset]:
    """Relative path ('js/main.js') -> file, for every servable file under `root`."""
    out: dict[str, Asset] = {}
    for path in sorted(root.rglob("*")):
        media_type = _TYPES.get(path.suffix)
        if path.is_file() and media_type is not None:
            out[path.relative_to(root).as_posix()] = Asset(path, media_type)
    return out


_LANDING = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>CDE gateway</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="/ui/ui.css"><link rel="icon" href="/ui/favicon.svg" type="image/svg+xml"></head>
<body class="landing"><main>
<h1>CDE gateway</h1>
<p>Interpretable, steerable block-diffusion generation behind an OpenAI-compatible API.</p>
<ul>
<li><a href="/ui">Live view</a>: watch blocks come into focus with their concepts, steered beside default</li>
<li><a href="/docs">API reference</a> (<a href="/openapi.json">OpenAPI schema</a>)</li>
<li><a href="/v1/models">/v1/models</a>, <a href="/health">/health</a>, <a href="/metrics">/metrics</a></li>
</ul></main></body></html>
"""


def ui_router(assets: dict[str, Asset] | None = None) -> APIRouter:
    """GET / (links), /ui (the page) and /ui/<asset>; all outside the OpenAPI schema."""
    files = load_assets() if assets is None else assets
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    async def landing() -> Response:
        return HTMLResponse(_LANDING, headers=SECURITY_HEADERS)

    @router.get("/ui")
    async def page() -> Response:
        return _serve(files, "index.html")

    @router.get("/ui/{name:path}")
    async def asset(name: str) -> Response:
        return _serve(files, name)

    return router


def _serve(files: dict[str, Asset], name: str) -> Response:
    found = files.get(name)
    if found is None:
        return Response(b"not found\n", status_code=404, media_type="text/plain", headers=SECURITY_HEADERS)
    return Response(found.path.read_bytes(), media_type=found.media_type, headers=SECURITY_HEADERS)
