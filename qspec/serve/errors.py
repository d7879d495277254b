"""Every error the server answers with, mapped to an HTTP status and OpenAI's error shape in one place."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from qspec.errors import ConfigError, PromptTooLongError, QSpecError
from qspec.serve.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("qspec.serve")

# status -> OpenAI's error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ServeError(QSpecError):
    """A request the server refuses; ``status`` and ``code`` go to the client with the message."""

    def __init__(self, message: str, *, status: int = 400, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def context_exceeded(prompt_tokens: int, max_tokens: int, ctx_len: int) -> ServeError:
    """vLLM's rule: the prompt plus ``max_tokens`` must fit the model's context (400)."""
    return ServeError(
        f"this model's maximum context length is {ctx_len} tokens, but the request asks for "
        f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} in max_tokens); "
        "lower max_tokens or shorten the prompt",
        code="context_length_exceeded",
        param="max_tokens",
    )


def bad_api_key() -> ServeError:
    return ServeError(
        "missing or wrong API key: send the key the server was started with (--api-key) as 'Authorization: Bearer KEY'",
        status=401,
        code="invalid_api_key",
    )


def model_not_found(name: str, served: str) -> ServeError:
    return ServeError(
        f"model {name!r} does not exist; this server serves {served!r}",
        status=404,
        code="model_not_found",
        param="model",
    )


def queue_full(waiting: int) -> ServeError:
    return ServeError(
        f"server busy: {waiting} requests are already waiting for a slot (its --max-waiting); retry later",
        status=429,
        code="rate_limit_exceeded",
    )


def shutting_down() -> ServeError:
    return ServeError("the server is shutting down; the request was cancelled", status=503, code="shutting_down")


def error_response(exc: Exception) -> JSONResponse:
    """The status and OpenAI-shaped body of ``exc`` (500 for anything not a QSpecError)."""
    if isinstance(exc, ServeError):
        status, code, param = exc.status, exc.code, exc.param
    elif isinstance(exc, PromptTooLongError):
        status, code, param = 400, "context_length_exceeded", "messages"
    elif isinstance(exc, (ConfigError, QSpecError)):
        status, code, param = 400, None, None
    else:
        log.exception("internal error", exc_info=exc)
        status, code, param = 500, "internal_error", None
    message = str(exc) if status != 500 else f"internal error: {type(exc).__name__}: {exc}"
    body = ErrorResponse(
        error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "invalid_request_error"), param=param, code=code)
    )
    return JSONResponse(body.model_dump(), status_code=status)


def validation_message(exc: RequestValidationError) -> str:
    """One line per problem, naming the field: ``max_tokens: Input should be greater than or equal to 1``."""
    parts = []
    for error in exc.errors():
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        field = ".".join(loc)
        if error.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}")
        elif error.get("type") == "extra_forbidden":
            parts.append(f"unsupported field {field!r}: qspec serve does not implement it; leave it out")
        elif error.get("type") == "missing":
            parts.append(f"missing field {field!r}")
        else:
            msg = str(error.get("msg", "invalid")).removeprefix("Value error, ")
            parts.append(f"{field}: {msg}" if field and not msg.startswith(field.split(".")[0]) else msg)
    return "; ".join(dict.fromkeys(parts)) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(ServeError(validation_message(exc)))

    @app.exception_handler(QSpecError)
    async def _qspec(request: Request, exc: QSpecError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)
