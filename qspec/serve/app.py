"""Routes: validate the request, tokenize it, hand it to the engine thread, answer or stream the deltas.

Handlers never block on the engine: they wait on their ticket's asyncio queue, and on the client going
away at the same time (then the request is aborted and its slot freed at the engine's next step).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from qspec.runtime.engine import Engine, RequestDelta
from qspec.serve.errors import (
    bad_api_key,
    context_exceeded,
    error_response,
    install_error_handlers,
    model_not_found,
)
from qspec.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    Usage,
    new_id,
)
from qspec.serve.worker import EngineWorker, Ticket

DONE = "data: [DONE]\n\n"


def sse(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def deltas_of(worker: EngineWorker, ticket: Ticket, request: Request) -> AsyncIterator[RequestDelta]:
    """A submitted request's deltas up to its last one; ends early (aborting it) when the client goes away."""
    gone = asyncio.ensure_future(_disconnected(request))
    finished = False
    try:
        while not finished:
            get = asyncio.ensure_future(ticket.deltas.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return
            item = get.result()
            if isinstance(item, Exception):
                finished = True  # the engine thread is done with it
                raise item
            finished = item.finished
            yield item
    finally:
        gone.cancel()
        if not finished:
            worker.cancel(ticket)


class Frontend:
    """What the routes share: the served name, the engine's tokenizer and limits, the worker."""

    def __init__(self, engine: Engine, worker: EngineWorker, served_model_name: str):
        self.engine, self.worker, self.name = engine, worker, served_model_name

    def submit(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int]) -> Ticket:
        """Check the request and queue it for the engine (before any response byte: errors keep their status)."""
        if body.model != self.name:
            raise model_not_found(body.model, self.name)
        self.engine.check_prompt(prompt_ids)
        ctx_len, budget = self.engine.model.ctx_len, body.requested_tokens()
        if budget is not None and len(prompt_ids) + budget > ctx_len:
            raise context_exceeded(len(prompt_ids), budget, ctx_len)
        params = body.sampling_params(prompt_tokens=len(prompt_ids), ctx_len=ctx_len)
        ticket = Ticket(prompt_ids, params, asyncio.get_running_loop())
        self.worker.submit(ticket)
        return ticket

    async def collect(self, ticket: Ticket, request: Request) -> tuple[str, int, str] | None:
        """(text, completion tokens, finish reason), or None when the client went away."""
        text, tokens = [], 0
        async for delta in deltas_of(self.worker, ticket, request):
            text.append(delta.text)
            tokens += len(delta.token_ids)
            if delta.finished:
                return "".join(text), tokens, delta.finish_reason
        return None

    async def stream(
        self,
        ticket: Ticket,
        request: Request,
        *,
        include_usage: bool,
        chunk: Callable[..., object],
        usage_chunk: Callable[[Usage], object],
    ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per step with new text, the finish chunk, usage, ``[DONE]``."""
        tokens = 0
        try:
            async for delta in deltas_of(self.worker, ticket, request):
                tokens += len(delta.token_ids)
                if delta.text and not delta.finished:
                    yield sse(chunk(delta.text, None))
                if delta.finished:
                    usage = Usage.of(len(ticket.prompt_ids), tokens)
                    final = chunk(delta.text, delta.finish_reason)
                    if not include_usage:
                        final.usage = usage  # usage once in every stream: here, or in its own chunk
                    yield sse(final)
                    if include_usage:
                        yield sse(usage_chunk(usage))
        except Exception as exc:  # the status line is sent: the error travels as an event
            yield f"data: {error_response(exc).body.decode()}\n\n"
        yield DONE


def create_app(engine: Engine, worker: EngineWorker, *, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The OpenAI-compatible app; its lifespan starts and stops the engine thread. With ``api_key`` every
    ``/v1`` route wants ``Authorization: Bearer <api_key>`` (401 otherwise), as vLLM's ``--api-key``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    app = FastAPI(title="qspec", lifespan=lifespan)
    install_error_handlers(app)
    front = Frontend(engine, worker, served_model_name)

    if api_key is not None:

        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            if request.url.path.startswith("/v1") and request.headers.get("authorization") != f"Bearer {api_key}":
                return error_response(bad_api_key())
            return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if worker.alive() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(worker.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=engine.model.ctx_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt_ids = engine.tokenizer.encode_prompt(body.prompt)
        ticket = front.submit(body, prompt_ids)
        rid = new_id("cmpl")

        def chunk(text: str, finish_reason: str | None) -> CompletionResponse:
            return CompletionResponse(
                id=rid, model=served_model_name, choices=[CompletionChoice(text=text, finish_reason=finish_reason)]
            )

        if body.stream:
            usage_chunk = lambda usage: CompletionResponse(id=rid, model=served_model_name, choices=[], usage=usage)  # noqa: E731
            events = front.stream(
                ticket, request, include_usage=body.include_usage, chunk=chunk, usage_chunk=usage_chunk
            )
            return StreamingResponse(events, media_type="text/event-stream")
        result = await front.collect(ticket, request)
        if result is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        text, tokens, reason = result
        response = chunk(text, reason)
        response.usage = Usage.of(len(prompt_ids), tokens)
        return JSONResponse(response.model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        prompt_ids = engine.tokenizer.encode_chat(body.chat_messages())
        ticket = front.submit(body, prompt_ids)
        rid = new_id("chatcmpl")

        if body.stream:
            started = False

            def chunk(text: str, finish_reason: str | None) -> ChatCompletionChunk:
                nonlocal started
                delta = DeltaMessage(content=text or None, role=None if started else "assistant")
                started = True
                return ChatCompletionChunk(
                    id=rid, model=served_model_name, choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)]
                )

            usage_chunk = lambda usage: ChatCompletionChunk(id=rid, model=served_model_name, choices=[], usage=usage)  # noqa: E731
            events = front.stream(
                ticket, request, include_usage=body.include_usage, chunk=chunk, usage_chunk=usage_chunk
            )
            return StreamingResponse(events, media_type="text/event-stream")
        result = await front.collect(ticket, request)
        if result is None:
            return Response(status_code=499)
        text, tokens, reason = result
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=reason)
        response = ChatCompletionResponse(
            id=rid, model=served_model_name, choices=[choice], usage=Usage.of(len(prompt_ids), tokens)
        )
        return JSONResponse(response.model_dump())

    return app
