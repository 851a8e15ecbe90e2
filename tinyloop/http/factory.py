"""The Quart-trio app factory: routers, error model, auth, body limit, CORS, OpenAPI.

``create_app(runtime, model, settings)`` attaches the app to a running runtime (no module-level
engine). ``create_app(None, ...)`` makes an app that has no model yet (``/healthz`` answers 503)
until ``attach`` is called: the lazily built ``tinyloop.http:app`` uses that.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable
from typing import Any

from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from tinyloop.actors.runtime import Runtime
from tinyloop.errors import TinyLoopError
from tinyloop.http import lmstudio, native, openai, ops
from tinyloop.http.access import AccessLog
from tinyloop.http.connection import ConnectionGuard
from tinyloop.http.drain import DRAIN_KEY, Drain
from tinyloop.http.errors import ApiError, error_response, from_exception
from tinyloop.http.openapi import openapi_document
from tinyloop.http.service import Served, ServedModel
from tinyloop.settings import Settings

__all__ = ["create_app", "attach"]

_OPEN_PATHS = frozenset({"/healthz", "/health"})


def attach(app: QuartTrio, runtime: Runtime, model: ServedModel, settings: Settings) -> None:
    app.extensions["tinyloop"] = Served(runtime, model, settings)


def create_app(runtime: Runtime | None, model: ServedModel | None = None,
               settings: Settings | None = None) -> QuartTrio:
    settings = settings or (runtime.settings if runtime is not None else Settings())
    app = QuartTrio("tinyloop", static_folder=None)
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=60, MAX_CONTENT_LENGTH=settings.max_body_bytes,
                      JSON_SORT_KEYS=False, PROVIDE_AUTOMATIC_OPTIONS=True)
    app.json.sort_keys = False  # type: ignore[attr-defined]
    # werkzeug answers a path with an empty segment (/v1//models) with a 308 to the merged path
    # and an HTML body that no error handler sees: matched as sent, it is a 404 error object.
    app.url_map.merge_slashes = False
    app.asgi_app = ConnectionGuard(app.asgi_app)  # type: ignore[method-assign,assignment]
    if settings.access_log:  # outermost: it sees what ConnectionGuard refuses too
        app.asgi_app = AccessLog(app.asgi_app)  # type: ignore[method-assign,assignment]
    app.extensions[DRAIN_KEY] = Drain()
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
    origins = _split(settings.cors_origins)
    host_allowed = _host_check(settings)

    @app.before_request
    async def check_host() -> Response | None:
        # A page on another site that rebinds its DNS name to this address sends its own name
        # as Host: only the names the server is known by get through.
        if host_allowed(request.headers.get("Host", "")):
            return None
        return error_response(ApiError(403, f"Host {request.headers.get('Host')!r} is not allowed: "
                                       "use localhost or the bound address, or add the name to "
                                       "--allowed-hosts (TINYLOOP_ALLOWED_HOSTS).", param="Host",
                                       code="host_not_allowed"))

    @app.before_request
    async def preflight() -> Response | None:
        # A CORS preflight carries no credentials: answered, for an allowed origin only, without
        # saying whether the route exists. Any other OPTIONS is a request like the rest.
        origin = request.headers.get("Origin")
        if (request.method == "OPTIONS" and origin and ("*" in origins or origin in origins)
                and "Access-Control-Request-Method" in request.headers):
            return Response("", status=204, headers={"Access-Control-Max-Age": "600"})
        return None

    @app.before_request
    async def check_api_key() -> Response | None:
        if settings.api_key is None or request.path in _OPEN_PATHS:
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), settings.api_key.encode()):
            return None
        # RFC 6750 section 3: the scheme to use; with a bearer token that is not the key, why
        challenge = 'Bearer error="invalid_token"' if scheme.lower() == "bearer" else "Bearer"
        return error_response(ApiError(401, "Incorrect or missing API key: send "
                                       "'Authorization: Bearer <key>'.", code="invalid_api_key",
                                       headers={"WWW-Authenticate": challenge}))

    @app.before_request
    async def require_json() -> Response | None:
        # A cross-site form or fetch may POST text/plain without a preflight; JSON needs one.
        if request.method != "POST" or request.url_rule is None or request.mimetype == "application/json":
            return None
        return error_response(ApiError(415, "The body must be JSON sent with 'Content-Type: "
                                       f"application/json' (got {request.content_type or 'none'!r}).",
                                       param="Content-Type", code="unsupported_media_type"))

    @app.after_request
    async def cors(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin and ("*" in origins or origin in origins):
            response.headers["Access-Control-Allow-Origin"] = origin if "*" not in origins else "*"
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Vary"] = "Origin"
        return response


def _split(names: str | None) -> set[str]:
    return {n.strip() for n in (names or "").split(",") if n.strip()}


_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
_WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})


def _host_check(settings: Settings) -> Callable[[str], bool]:
    """``allowed(host_header)``: localhost names and loopback addresses, the bound address (any
    IP address when bound to all interfaces), and the names of ``allowed_hosts`` (``*``: all)."""
    extra = {n.lower().rstrip(".") for n in _split(settings.allowed_hosts)}
    bound = settings.host.strip("[]").lower()

    def allowed(header: str) -> bool:
        if "*" in extra or not header:  # no Host: HTTP/1.0, never a browser
            return True
        name = _host_name(header)
        if name in _LOCAL_NAMES or name.endswith(".localhost") or name == bound or name in extra:
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False
        return address.is_loopback or bound in _WILDCARD_BINDS

    return allowed


def _host_name(header: str) -> str:
    """The name or address of a Host header, without port, brackets or trailing dot."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0].rstrip(".") if header.count(":") == 1 else header.rstrip(".")


def _install_connection_close(app: QuartTrio) -> None:
    @app.after_request
    async def close_if_body_unread(response: Response) -> Response:
        # A response sent before the body arrived (401, 404, 405, 413, 415, 503 not loaded):
        # hypercorn does not read the rest, so the connection cannot be reused; it closes it
        # (see ConnectionGuard), and ``Connection: close`` tells the client beforehand.
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
        empty = " (the path has an empty segment: '//')" if "//" in request.path else ""
        messages = {404: f"Not found: {request.method} {request.path}{empty}",
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
