"""The API reference page at /docs: Swagger UI over /openapi.json, served entirely by probity.

FastAPI's own page loads Swagger UI from a public CDN: broken offline, and a third party's
script running at the API's origin. Here the Swagger UI files come from an installed
package (swagger-ui-py, pinned), the page has no inline script, and a CSP says so. ReDoc
(also CDN-loaded) is not served."""
from __future__ import annotations

from importlib.resources import files

from starlette.responses import HTMLResponse, Response

from ..errors import APIError

ASSET_PREFIX = "/docs/assets/"
_SWAGGER = ("swagger-ui.css", "swagger-ui-bundle.js", "favicon-32x32.png")
MEDIA = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".png": "image/png"}
HEADERS = {
    # Swagger UI sets style attributes from script, hence 'unsafe-inline' for styles only
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _assets() -> dict[str, bytes]:
    swagger = files("swagger_ui").joinpath("static")
    out = {name: swagger.joinpath(name).read_bytes() for name in _SWAGGER}
    out["init.js"] = files(__package__).joinpath("init.js").read_bytes()
    return out


def add_routes(app) -> None:
    page = files(__package__).joinpath("index.html").read_bytes()
    assets = _assets()

    async def docs():
        return Response(page, media_type="text/html; charset=utf-8", headers=HEADERS)

    async def asset(name: str):
        if name not in assets:
            return APIError("not_found", f"no docs file {name!r}").response()
        return Response(assets[name], media_type=MEDIA[name[name.rfind("."):]], headers=HEADERS)

    app.add_api_route("/docs", docs, methods=["GET"], response_class=HTMLResponse, include_in_schema=False)
    app.add_api_route(ASSET_PREFIX + "{name}", asset, methods=["GET"], include_in_schema=False)
