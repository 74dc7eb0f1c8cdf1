"""The ASGI application: middleware (request id, auth, body cap), routes, the shared service."""
from __future__ import annotations

import hmac
import logging
import os
import re
import sys
import time
import uuid
from contextlib import asynccontextmanager
from urllib.parse import quote

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import api_docs, batches, inspector
from .body import read_json
from .engine_client import EngineStartFailed
from .errors import APIError
from .generation import ClientGone
from .metrics import CONTENT_TYPE
from .service import Config, Service

log = logging.getLogger("probity.server")


def create_app(config: Config) -> FastAPI:
    svc = Service(config)
    jobs: batches.Batches | None = None

    @asynccontextmanager
    async def lifespan(app):
        # The server listens only once the model is loaded: a model that cannot load is a
        # startup error (non-zero exit), never a server that answers 503 forever.
        await svc.engine.start()
        svc.limits.grammar.start()   # the grammar worker imports beside the engine's load
        try:
            await svc.engine.wait_first_ready()
        except EngineStartFailed as e:
            # the engine's own line above names the cause; one more line, no traceback
            print(f"probity: {e}", file=sys.stderr, flush=True)
            os._exit(3)
        jobs.resume()   # batches a previous server left unfinished go on
        yield
        await jobs.close()
        await svc.engine.stop()
        svc.limits.grammar.close()

    app = FastAPI(title="probity", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="OpenAI- and Anthropic-compatible inference server with exact instrumentation. "
                              "Field-by-field contract: docs/api.md.")
    app.state.svc = svc
    jobs = batches.Batches(batches.Store(config.batch), app, concurrency=lambda: svc.admission.capacity,
                           served=lambda: svc.ready_info()["model"]["id"])
    app.state.batches = jobs
    svc.metrics.routes = app.router.routes
    # `/v1/completions/` is not a route: a 404 in the envelope, not a 307 with an empty body.
    app.router.redirect_slashes = False
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version",
                                          "x-request-id"], expose_headers=["x-request-id", "x-queue-wait-ms"])
    app.add_middleware(Envelope, svc=svc)
    inspector.add_routes(app)
    api_docs.add_routes(app)
    _add_api_routes(app, svc)
    _add_info_routes(app, svc)
    batches.add_routes(app, jobs, config.max_body, config.body_timeout)
    _add_error_handlers(app)
    return app


def _api_routes():
    """(path, endpoint, Anthropic envelope, accepted fields, required fields) of every POST route."""
    from . import anthropic_api, openai_api, tokenizer_api
    from .validation import CHAT_FIELDS, COMPLETION_FIELDS

    return [
        ("/v1/completions", openai_api.completions, False, COMPLETION_FIELDS, {"model", "prompt"}),
        ("/v1/chat/completions", openai_api.chat_completions, False, CHAT_FIELDS, {"model", "messages"}),
        ("/v1/messages", anthropic_api.messages, True, anthropic_api.MESSAGE_FIELDS,
         {"model", "messages", "max_tokens"}),
        ("/v1/messages/count_tokens", anthropic_api.count_tokens, True, anthropic_api.COUNT_TOKENS_FIELDS,
         {"model", "messages"}),
        ("/tokenize", tokenizer_api.tokenize, False, tokenizer_api.TOKENIZE_FIELDS, set()),
        ("/detokenize", tokenizer_api.detokenize, False, tokenizer_api.DETOKENIZE_FIELDS, {"tokens"}),
    ]


def _add_api_routes(app: FastAPI, svc: Service) -> None:
    """The POST routes: each reads its body here (capped, strict), validates it itself and
    answers every error in its API's envelope."""
    config = svc.config

    def endpoint_for(fn, anthropic: bool):
        async def endpoint(request: Request) -> Response:
            try:
                body = await read_json(request, config.max_body, config.body_timeout)
                result = await fn(svc, request, body)
                return JSONResponse(result) if isinstance(result, dict) else result
            except APIError as e:
                return e.response(anthropic)
            except ClientGone:
                return Response(status_code=499)
            except Exception as e:  # a bug: still a named error in the right envelope, never a bare 500
                log.exception("unhandled error on %s", request.url.path)
                return APIError("internal_error", f"internal error: {type(e).__name__}").response(anthropic)
        endpoint.__doc__ = fn.__doc__
        return endpoint

    for path, fn, anthropic, fields, required in _api_routes():
        # The body is validated by probity's own code (named errors, not FastAPI's 422); this
        # schema lists the accepted fields for the OpenAPI page. docs/api.md has their ranges.
        schema = {"type": "object", "additionalProperties": False, "required": sorted(required),
                  "properties": {f: {"description": "see docs/api.md"} for f in sorted(fields)}}
        app.add_api_route(path, endpoint_for(fn, anthropic), methods=["POST"], name=fn.__name__,
                          summary=f"{path} (fields and ranges: docs/api.md)",
                          openapi_extra={"requestBody": {"required": True, "content": {
                              "application/json": {"schema": schema}}}})


def _add_info_routes(app: FastAPI, svc: Service) -> None:
    """The GET routes: the model card, the tokenizer, health and metrics."""
    from . import tokenizer_api

    def served():
        try:
            return svc.ready_info()["model"]
        except APIError as e:
            return e.response()

    @app.api_route("/tokenizer_info", methods=["GET", "HEAD"])
    async def tokenizer_info(request: Request):
        try:
            return JSONResponse(tokenizer_api.tokenizer_info(svc))
        except APIError as e:
            return e.response()

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        m = served()
        return m if isinstance(m, Response) else {"object": "list", "data": [_model_card(m)]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        m = served()
        if isinstance(m, Response):
            return m
        if model_id != m["id"]:
            return APIError("model_not_found", f"model '{model_id}' is not served here", "model").response()
        return _model_card(m)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        e = svc.engine
        body = {"status": "ok" if e.up else e.state, "engine": e.health(),
                "model": e.ready_info["model"]["id"] if e.ready_info else None,
                "capacity": svc.admission.capacity, "active": svc.admission.active, "queued": svc.admission.queued}
        return JSONResponse(body, status_code=200 if e.up else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE)


def _add_error_handlers(app: FastAPI) -> None:
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        anthropic = request.url.path.startswith("/v1/messages")
        if exc.status_code == 405:  # Starlette names the route's methods in exc.headers["Allow"]
            return APIError("method_not_allowed", f"{request.method} is not allowed on {request.url.path}",
                            headers=dict(exc.headers or {})).response(anthropic)
        return APIError("not_found", f"no route {request.method} {request.url.path}").response(anthropic)


class Envelope:
    """Pure ASGI middleware (keeps disconnect detection and streaming intact): request id on
    every response, API-key check, request metrics and a log line."""

    def __init__(self, app, svc: Service):
        self.app = app
        self.svc = svc
        cfg = svc.config
        if "*" in cfg.allowed_hosts:
            self.allowed = None
        elif cfg.allowed_hosts:
            self.allowed = {h.lower() for h in cfg.allowed_hosts}
        elif cfg.host in ("127.0.0.1", "localhost", "::1"):
            self.allowed = {"127.0.0.1", "localhost", "::1"}
        elif cfg.host in ("0.0.0.0", "::"):
            self.allowed = None  # every interface: the operator opted in to remote access and set a key
        else:
            self.allowed = {cfg.host.lower()}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = request_id(headers.get("x-request-id"))
        scope.setdefault("state", {})["request_id"] = rid  # request.state.request_id downstream
        path = scope["path"]
        anthropic = path.startswith("/v1/messages")
        t0 = time.monotonic()
        status = [0]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        refusal = self._refusal(headers, path, scope["method"])
        if refusal is not None:
            resp = refusal.response(anthropic)
            self.svc.metrics.refused(scope, refusal.code, resp.status_code)
            await resp(scope, receive, send_with_id)
            log.info("request_id=%s method=%s path=%s status=%d code=%s duration_s=%.3f", rid, scope["method"],
                     _log_safe(path), status[0], refusal.code, time.monotonic() - t0)
            return
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.svc.metrics.request(scope, status[0])
            log.info("request_id=%s method=%s path=%s status=%d duration_s=%.3f", rid, scope["method"],
                     _log_safe(path), status[0], time.monotonic() - t0)

    def _refusal(self, headers: dict, path: str, method: str) -> APIError | None:
        """The Host guard and the API-key check, which answer before any route runs."""
        host = _hostname(headers.get("host", "")).lower()  # host names are case-insensitive
        if self.allowed is not None and host not in self.allowed:
            # DNS rebinding: a page on another name that resolves to us must not reach the API.
            return APIError("invalid_host", f"Host {host!r} is not allowed; see --allowed-host")
        key = self.svc.config.api_key
        # CORS preflights carry no credentials by design; the CORS layer answers them (only
        # when an origin is configured: without one there is no CORS layer, and an OPTIONS is
        # a request like any other).
        preflight = method == "OPTIONS" and bool(self.svc.config.cors_origins)
        if key and path != "/health" and not inspector.is_public(path) and not preflight:
            given = headers.get("x-api-key")
            auth = headers.get("authorization", "")
            if given is None and auth.lower().startswith("bearer "):
                given = auth[7:].strip()
            if given is None or not hmac.compare_digest(given.encode("latin-1"), key.encode()):
                return APIError("invalid_api_key", "missing or wrong API key")
        return None


# A client's x-request-id is echoed and logged only if it is plainly an id; anything else
# (spaces, '=', quotes, control or non-ASCII characters, overlong) is replaced, so a client
# can neither add fields to a log line nor get back bytes it did not send.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+-]{1,128}")


def request_id(given: str | None) -> str:
    return given if given is not None and _REQUEST_ID.fullmatch(given) else f"req_{uuid.uuid4().hex}"


def _log_safe(path: str) -> str:
    """The request path as one log field: percent-encoded, so it holds no space or '='."""
    return quote(path, safe="/-._~:")


def _hostname(host: str) -> str:
    """The name part of a Host header: 'a:80' -> 'a', '[::1]:80' -> '::1'."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _model_card(m: dict) -> dict:
    return {"id": m["id"], "object": "model", "created": 0, "owned_by": "probity",
            "max_model_len": m["context_length"]}
