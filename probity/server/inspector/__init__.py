"""The logprob inspector: one static page (this folder's files) served by probity itself, so it
works offline. It talks to the API like any client; serving it needs no key (it holds no data,
and a browser cannot send a key when it navigates), the API calls it makes do."""
from __future__ import annotations

from importlib.resources import files

from starlette.responses import HTMLResponse, PlainTextResponse, Response

from ..errors import APIError

PAGE_PATHS = ("/", "/inspect")
ASSET_PREFIX = "/inspector/"
ASSETS = {"inspector.css": "text/css", "inspector.js": "text/javascript", "api.js": "text/javascript",
          "tokens.js": "text/javascript"}
HEADERS = {
    # Everything comes from probity: no CDN, no inline script, and no other page may frame it.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def is_public(path: str) -> bool:
    return path in PAGE_PATHS or (path.startswith(ASSET_PREFIX) and path[len(ASSET_PREFIX):] in ASSETS)


def _read(name: str) -> bytes:
    return files(__package__).joinpath(name).read_bytes()


def add_routes(app) -> None:
    page = _read("index.html")
    assets = {name: (_read(name), media) for name, media in ASSETS.items()}

    async def index():
        return Response(page, media_type="text/html; charset=utf-8", headers=HEADERS)

    async def asset(name: str):
        if name not in assets:
            return APIError("not_found", f"no inspector file {name!r}").response()
        body, media = assets[name]
        return Response(body, media_type=f"{media}; charset=utf-8", headers=HEADERS)

    for path in PAGE_PATHS:
        app.add_api_route(path, index, methods=["GET"], response_class=HTMLResponse,
                          summary="The logprob inspector page (HTML; needs no key, its API calls do)")
    app.add_api_route(ASSET_PREFIX + "{name}", asset, methods=["GET"], response_class=PlainTextResponse,
                      summary="The inspector's script and style files: " + ", ".join(sorted(ASSETS)))
