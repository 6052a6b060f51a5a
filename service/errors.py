"""The service's error types and the one place that turns exceptions into HTTP responses.

Native routes answer `{"error": message, "error_type": type}` (TGI/TEI); `/v1` routes answer OpenAI's
`{"error": {"message", "type", "param", "code"}}`. Unexpected exceptions become a generic 500 whose trace
goes only to the log.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from model.tokenizers.text_only import ControlTokenText

log = logging.getLogger("service.errors")


class ServiceError(Exception):
    """An error with a status code and an `error_type` of docs/ERRORS.md's table."""

    status_code = 500
    error_type = "internal"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class ValidationFailed(ServiceError):
    status_code = 422
    error_type = "validation"


class InputTooLong(ServiceError):
    status_code = 422
    error_type = "input_too_long"


class PayloadTooLarge(ServiceError):
    status_code = 413
    error_type = "payload_too_large"


class Unauthorized(ServiceError):
    status_code = 401
    error_type = "unauthorized"


class Overloaded(ServiceError):
    status_code = 429
    error_type = "overloaded"


class Unavailable(ServiceError):
    status_code = 503
    error_type = "unavailable"


class QueueTimeout(ServiceError):
    status_code = 504
    error_type = "timeout"


class InternalError(ServiceError):
    status_code = 500
    error_type = "internal"


class NotFound(ServiceError):
    status_code = 404
    error_type = "not_found"


class ModelNotFound(ServiceError):
    status_code = 404
    error_type = "model_not_found"


class MethodNotAllowed(ServiceError):
    status_code = 405
    error_type = "method_not_allowed"


class BodyTimeout(ServiceError):
    status_code = 408
    error_type = "body_timeout"


GENERIC_INTERNAL_MESSAGE = "internal error; the server log has the details"

# OpenAI's error "type" strings for each of ours.
_OPENAI_TYPES = {
    "validation": "invalid_request_error",
    "input_too_long": "invalid_request_error",
    "payload_too_large": "invalid_request_error",
    "unauthorized": "authentication_error",
    "overloaded": "rate_limit_error",
    "unavailable": "service_unavailable_error",
    "timeout": "timeout_error",
    "internal": "server_error",
    "not_found": "not_found_error",
    "model_not_found": "not_found_error",
    "method_not_allowed": "invalid_request_error",
    "body_timeout": "timeout_error",
}


# native (TGI/TEI) routes' error_type for each of ours, where theirs differs
_NATIVE_TYPES = {"input_too_long": "validation"}


def native_type(error_type: str) -> str:
    """The `error_type` native (TGI/TEI) routes answer for one of ours."""
    return _NATIVE_TYPES.get(error_type, error_type)


def is_openai_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def error_body(path: str, error_type: str, message: str, status_code: int, param: str | None = None) -> dict[str, Any]:
    """The JSON body of an error in the shape the route's clients expect."""
    if is_openai_path(path):
        return {
            "error": {
                "message": message,
                "type": _OPENAI_TYPES.get(error_type, error_type),
                "param": param,
                "code": error_type,
            }
        }
    # TGI answers a too-long input as a validation error, and its clients (huggingface_hub) raise
    # ValidationError only for that type; the message still says which limit was passed
    return {"error": message, "error_type": native_type(error_type)}


def status_for(path: str, status_code: int) -> int:
    """The status a route's clients expect: OpenAI (and vLLM) answer an invalid request with 400, which the
    official client raises as BadRequestError; TGI and TEI answer 422."""
    return 400 if status_code == 422 and is_openai_path(path) else status_code


def error_response(path: str, error: ServiceError) -> JSONResponse:
    body = error_body(path, error.error_type, error.message, error.status_code, error.param)
    return JSONResponse(body, status_code=status_for(path, error.status_code), headers=error.headers)


# Union members pydantic names in an error's location (`bool | int`); no request field has these names.
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _field_path(loc: Any) -> str:
    """`inputs.0` from pydantic's location, without `body` and without the union member tried
    (`function-after[_check_text(), str]`, `list[...]`, `int`), which name our types, not the client's field."""
    return ".".join(
        str(p) for p in loc if p != "body" and not (isinstance(p, str) and ("[" in p or p in _UNION_MEMBERS))
    )


def _is_type_error(err: Any) -> bool:
    return str(err.get("type", "")).endswith("_type")


def describe_validation_errors(errors: list[Any]) -> tuple[str, str | None]:
    """One message naming each failing field (`parameters.top_p: Input should be ...`), and the first field."""
    fields = [_field_path(e.get("loc", ())) for e in errors]
    # A union (a text or a list of texts) reports each member's failure. Where the value had the shape of one
    # member (a failure inside it, or a failed value check), the other members' "should be a valid <type>"
    # only hides the real problem.
    def shadowed(field: str) -> bool:
        return any(
            other.startswith(field + ".") or (other == field and not _is_type_error(e))
            for other, e in zip(fields, errors, strict=True)
        )

    parts: list[str] = []
    first_param: str | None = None
    for err, field in zip(errors, fields, strict=True):
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "invalid JSON")
            parts.append(f"request body is not valid JSON: {detail} (position {field or 0})")
            continue
        if _is_type_error(err) and shadowed(field):
            continue
        if first_param is None and field:
            first_param = field
        part = f"{field or 'body'}: {err.get('msg', 'invalid value')}"
        if part not in parts:
            parts.append(part)
    return "; ".join(parts) or "invalid request", first_param


def body_parse_error(cause: BaseException | None) -> str:
    """Why FastAPI could not decode a body it answers 400 for, in the client's terms."""
    if isinstance(cause, RecursionError):
        return "request body could not be parsed: JSON nested too deeply"
    if isinstance(cause, UnicodeDecodeError):
        return f"request body could not be parsed: not valid UTF-8 (byte {cause.start})"
    return "request body could not be parsed as JSON"


def install_error_handlers(app: FastAPI) -> None:
    """Register every exception -> response mapping of the service."""

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(ControlTokenText)
    async def _control_text(request: Request, exc: ControlTokenText) -> JSONResponse:
        # user text is only text (model/tokenizers/text_only.py); a character this tokenizer has no text id
        # for is the request's problem, not the server's
        return error_response(request.url.path, ValidationFailed(f"the input's {exc}; this tokenizer cannot "
                                                                 "encode it as text"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return error_response(request.url.path, ValidationFailed(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI answers 400 for a body it cannot decode (invalid UTF-8, nesting too deep): for our
        # clients that is a validation error like any other malformed JSON.
        if exc.status_code == 400:
            error: ServiceError = ValidationFailed(body_parse_error(exc.__cause__))
        elif exc.status_code == 404:
            error = NotFound(f"no route {request.url.path}")
        elif exc.status_code == 405:
            error = MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}",
                                     headers=dict(exc.headers or {}))
        elif exc.status_code == 413:
            error = PayloadTooLarge(str(exc.detail))
        else:
            error = ServiceError(str(exc.detail))
            error.status_code = exc.status_code
            error.error_type = "http_error"
        return error_response(request.url.path, error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(request.url.path, InternalError(GENERIC_INTERNAL_MESSAGE))
