"""OpenAI's error object on every route, and the mapping from TinyLoop errors to HTTP.

Every error body is ``{"error": {"message", "type", "param", "code"}}``; a 503 carries
``Retry-After`` (seconds) from the admission predictor when it has one.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import ValidationError
from quart import Response

from tinyloop.errors import (
    AdmissionRejected,
    ChatTemplateError,
    EngineError,
    PromptTooLongError,
    RequestError,
    SchedulerError,
    TokenizerError,
)
from tinyloop.http.schemas import FieldError

__all__ = ["ApiError", "error_response", "error_body", "from_exception", "from_validation"]

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 501: "not_implemented_error",
          503: "overloaded_error",
          403: "permission_error", 415: "invalid_request_error"}


class ApiError(Exception):
    """An HTTP error a route raises; the app turns it into the error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(err: ApiError) -> Response:
    body = json.dumps(error_body(err.status, err.message, err.param, err.code))
    return Response(body, status=err.status, content_type="application/json", headers=err.headers)


def from_validation(exc: ValidationError) -> ApiError:
    """The first problem of a pydantic error, naming its field; unsupported fields come first,
    every one of them named in one message (``param`` is the first)."""
    errors = exc.errors()
    extra = [".".join(str(p) for p in e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if len(extra) > 1:
        names = ", ".join(f"'{name}'" for name in extra)
        return ApiError(400, f"Unsupported parameters: {names} are not supported by this server.",
                        param=extra[0], code="unsupported_parameter")
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    param = ".".join(str(p) for p in first["loc"]) or None
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, FieldError):
        return ApiError(400, f"Invalid value for '{cause.param}': {cause}", param=cause.param,
                        code="invalid_value")
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"Unsupported parameter: '{param}' is not supported by this server.",
                        param=param, code="unsupported_parameter")
    return ApiError(400, f"Invalid value for '{param}': {first['msg']}", param=param,
                    code="invalid_value")


def from_exception(exc: BaseException) -> ApiError:
    """Translate a TinyLoop error raised while serving a request."""
    match exc:
        case PromptTooLongError():
            return ApiError(400, str(exc), param=exc.param, code="context_length_exceeded")
        case RequestError():
            return ApiError(400, str(exc), param=exc.param, code="invalid_value")
        case ChatTemplateError():  # the model's template failed or overran: not the request's fault
            return ApiError(500, f"the model's {exc}", code="chat_template_error")  # "the model's chat template ..."
        case TokenizerError():
            return ApiError(400, str(exc), code="invalid_value")
        case AdmissionRejected():
            wait = exc.predicted_wait_ms
            retry = "1" if wait is None else str(max(1, math.ceil(wait / 1000)))
            return ApiError(503, str(exc), code="slo_unattainable", headers={"Retry-After": retry})
        case SchedulerError():
            return ApiError(503, str(exc), code=type(exc).__name__, headers={"Retry-After": "1"})
        case EngineError():
            return ApiError(500, f"engine error: {exc}", code="engine_error")
    return ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error")
