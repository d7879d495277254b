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


def context_exceeded(prompt_tokens: int, max_tokens: int | None, ctx_len: int) -> ServeError:
    """vLLM's rule: the prompt plus ``max_tokens`` must fit the model's context (400). The hint is in the
    request's own terms (its prompt and ``max_tokens``), never a command-line flag of the server."""
    budget = max_tokens or 1  # without max_tokens a request still needs room for one token
    asked = f"{prompt_tokens + budget} ({prompt_tokens} in the prompt, {budget} in max_tokens)"
    if max_tokens is None:
        asked = f"at least {prompt_tokens + 1} ({prompt_tokens} in the prompt, one to generate)"
    room = ctx_len - budget
    fix = f"shorten the prompt to {room} tokens or fewer"
    if max_tokens is not None:
        fix = f"{fix} for max_tokens={max_tokens}"
        if prompt_tokens < ctx_len:
            fix = f"lower max_tokens to {ctx_len - prompt_tokens} or {fix}"
    return ServeError(
        f"this model's maximum context length is {ctx_len} tokens, but the request asks for {asked}; {fix}",
        code="context_length_exceeded",
        param="max_tokens" if max_tokens is not None and prompt_tokens < ctx_len else "prompt",
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


def unknown_route_error(method: str, path: str) -> ServeError:
    return ServeError(
        f"unknown route {method} {path}; qspec serve has GET /v1/models, POST /v1/completions, "
        "POST /v1/chat/completions, GET /health and GET /metrics",
        status=404,
        code="unknown_url",
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
