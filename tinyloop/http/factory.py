"""The Quart-trio app factory: routers, error model, auth, body limit, CORS, OpenAPI.

``create_app(runtime, model, settings)`` attaches the app to a running runtime (no module-level
engine). ``create_app(None, ...)`` makes an app that has no model yet (``/healthz`` answers 503)
until ``attach`` is called: the lazily built ``tinyloop.http:app`` uses that.
"""

from __future__ import annotations

import hmac
from typing import Any

from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from tinyloop.actors.runtime import Runtime
from tinyloop.errors import TinyLoopError
from tinyloop.http import lmstudio, native, openai, ops
from tinyloop.http.errors import ApiError, error_response, from_exception
from tinyloop.http.openapi import openapi_document
from tinyloop.http.service import Served, ServedModel
from tinyloop.settings import Settings

__all__ = ["create_app", "attach"]

_OPEN_PATHS = frozenset({"/healthz"})


def attach(app: QuartTrio, runtime: Runtime, model: ServedModel, settings: Settings) -> None:
    app.extensions["tinyloop"] = Served(runtime, model, settings)


def create_app(runtime: Runtime | None, model: ServedModel | None = None,
               settings: Settings | None = None) -> QuartTrio:
    settings = settings or (runtime.settings if runtime is not None else Settings())
    app = QuartTrio("tinyloop", static_folder=None)
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=60, MAX_CONTENT_LENGTH=settings.max_body_bytes,
                      JSON_SORT_KEYS=False, PROVIDE_AUTOMATIC_OPTIONS=True)
    app.json.sort_keys = False  # type: ignore[attr-defined]
    if runtime is not None and model is not None:
        attach(app, runtime, model, settings)
    for bp in (ops.blueprint, openai.blueprint, lmstudio.blueprint, native.blueprint):
        app.register_blueprint(bp)
    _install_security(app, settings)
    _install_errors(app)
    _install_connection_close(app)
    from tinyloop.http import web

    web.install(app)

    @app.get("/openapi.json")
    async def openapi() -> dict[str, Any]:
        return openapi_document()

    return app


def _install_security(app: QuartTrio, settings: Settings) -> None:
    origins = {o.strip() for o in (settings.cors_origins or "").split(",") if o.strip()}

    @app.before_request
    async def check_api_key() -> Response | None:
        if settings.api_key is None or request.path in _OPEN_PATHS or request.method == "OPTIONS":
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), settings.api_key.encode()):
            return error_response(ApiError(401, "Incorrect or missing API key: send "
                                           "'Authorization: Bearer <key>'.", code="invalid_api_key"))
        return None

    @app.after_request
    async def cors(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin and ("*" in origins or origin in origins):
            response.headers["Access-Control-Allow-Origin"] = origin if "*" not in origins else "*"
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Vary"] = "Origin"
        return response


def _install_connection_close(app: QuartTrio) -> None:
    @app.after_request
    async def close_if_body_unread(response: Response) -> Response:
        # A response sent before the body arrived (401, 404, 405, 413, 503 not loaded): hypercorn
        # then neither reads the rest nor closes the socket (quart-trio cancels its close), so a
        # client reusing the connection would hang. ``Connection: close`` stops the reuse.
        chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
        if ((request.content_length or 0) > 0 or chunked) and not g.get("body_read", False):
            response.headers["Connection"] = "close"
        return response


def _install_errors(app: QuartTrio) -> None:
    @app.errorhandler(ApiError)
    async def api_error(err: ApiError) -> Response:
        return error_response(err)

    @app.errorhandler(TinyLoopError)
    async def tinyloop_error(err: TinyLoopError) -> Response:
        return error_response(from_exception(err))

    @app.errorhandler(HTTPException)
    async def http_error(err: HTTPException) -> Response:
        status = err.code or 500
        messages = {404: f"Not found: {request.method} {request.path}",
                    405: f"Method {request.method} is not allowed on {request.path}",
                    413: "The request body is larger than the server accepts."}
        allowed = getattr(err, "valid_methods", None)  # a 405 must say what is allowed (RFC 9110)
        headers = {"Allow": ", ".join(sorted(allowed))} if status == 405 and allowed else None
        return error_response(ApiError(status, messages.get(status, err.description or err.name),
                                       headers=headers))

    @app.errorhandler(Exception)
    async def unexpected(err: Exception) -> Response:
        app.logger.exception("unhandled error", exc_info=err)
        return error_response(from_exception(err))
