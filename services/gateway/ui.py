"""The chat web UI (`FLOTILLA_UI`, `flotilla up --ui`): the page at `/`, its files at `/ui/...`,
on the API's own port and origin, so the page calls `v1/...` with no CORS and no other host.

Rules:
- The files are the committed build of `ui/` (services/gateway/ui_static/, package data): the
  router serves exactly the files found there at start-up, from memory, and nothing else (no
  path from the URL ever reaches the filesystem). No CDN, no network: everything the page loads
  comes from here.
- Model output is untrusted (the page sanitises it); every UI response also carries a
  Content-Security-Policy that allows scripts, styles, fonts and fetches from this origin only,
  images from this origin or data: URLs, no inline script or style, no framing, no plugins.
- Each file has an ETag (its content hash) and `Cache-Control: no-cache`: a browser revalidates
  and gets 304 until the package changes. A gzip copy is sent to clients that accept it.
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request, Response

STATIC_DIR = Path(__file__).with_name("ui_static")

CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "font-src 'self'",
    "connect-src 'self'",
    "manifest-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-cache",
}
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".json": "application/json",
}
_COMPRESS_FROM = 1024  # bytes; smaller files go as they are


@dataclass(frozen=True)
class Asset:
    body: bytes
    gzipped: bytes | None
    media_type: str
    etag: str


def load_assets(directory: Path = STATIC_DIR) -> dict[str, Asset]:
    """Every servable file of the build, by file name."""
    assets = {}
    for path in sorted(directory.iterdir()):
        media_type = MEDIA_TYPES.get(path.suffix)
        if not path.is_file() or media_type is None:
            continue
        body = path.read_bytes()
        gzipped = gzip.compress(body, mtime=0) if len(body) >= _COMPRESS_FROM else None
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        assets[path.name] = Asset(body, gzipped, media_type, etag)
    if "index.html" not in assets:
        raise RuntimeError(f"the chat UI's build is missing from {directory} (run make -C ui)")
    return assets


def ui_router(assets: dict[str, Asset]) -> APIRouter:
    router = APIRouter()

    def send(request: Request, asset: Asset) -> Response:
        headers = {**SECURITY_HEADERS, "ETag": asset.etag, "Vary": "Accept-Encoding"}
        if asset.etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        if asset.gzipped is not None and "gzip" in request.headers.get("accept-encoding", ""):
            headers["Content-Encoding"] = "gzip"
            return Response(asset.gzipped, media_type=asset.media_type, headers=headers)
        return Response(asset.body, media_type=asset.media_type, headers=headers)

    @router.get("/", include_in_schema=False)
    async def index(request: Request) -> Response:
        return send(request, assets["index.html"])

    @router.get("/ui/{name}", include_in_schema=False)
    async def asset(request: Request, name: str) -> Response:
        found = assets.get(name)
        if found is None or name == "index.html":
            return Response("not found", status_code=404, media_type="text/plain",
                            headers=SECURITY_HEADERS)
        return send(request, found)

    return router
