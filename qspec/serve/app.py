"""Routes: validate the request, tokenize it, hand it to the engine thread, answer or stream the deltas.

Handlers never block on the engine: they wait on their ticket's asyncio queue, and on the client going
away at the same time (then the request is aborted and its slot freed at the engine's next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from qspec.runtime.engine import Engine
from qspec.runtime.logprobs import TokenLogprob
from qspec.runtime.request import RequestDelta
from qspec.serve.errors import (
    bad_api_key,
    context_exceeded,
    error_response,
    install_error_handlers,
    model_not_found,
    unknown_route_error,
)
from qspec.serve.logprobs import chat_logprobs, completion_logprobs
from qspec.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    SpecDecodeStats,
    Usage,
    new_id,
)
from qspec.serve.worker import EngineWorker, Ticket

DONE = "data: [DONE]\n\n"


def dumped(response, *, usage: bool = True, spec: bool = False) -> dict:
    """``response`` as JSON data: ``usage`` only when there is one to send, each choice's ``spec_decode`` only
    when the request asked for it (``return_spec_metrics``); OpenAI's own fields as OpenAI sends them."""
    exclude: dict = {} if usage else {"usage": True}
    if not spec:
        exclude["choices"] = {"__all__": {"spec_decode"}}
    return response.model_dump(mode="json", exclude=exclude or None)


def sse(chunk, *, include_usage: bool, spec: bool = False) -> str:
    """One server-sent event. As OpenAI sends them: a chunk has a ``usage`` field (``null`` but in the last
    chunk) only when the request asked for ``stream_options.include_usage``."""
    return f"data: {json.dumps(dumped(chunk, usage=include_usage, spec=spec))}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def deltas_of(
    worker: EngineWorker, tickets: list[Ticket], request: Request
) -> AsyncIterator[tuple[int, RequestDelta]]:
    """``(choice, delta)`` of the submitted requests (one per choice) up to the last one of each, as they come;
    ends early (aborting what is still running) when the client goes away."""
    gone = asyncio.ensure_future(_disconnected(request))
    pending = {i: asyncio.ensure_future(t.deltas.get()) for i, t in enumerate(tickets)}
    finished: set[int] = set()
    try:
        while pending:
            await asyncio.wait({*pending.values(), gone}, return_when=asyncio.FIRST_COMPLETED)
            ready = [i for i, get in pending.items() if get.done()]
            if not ready:
                return  # the client is gone
            for i in ready:
                item = pending.pop(i).result()
                if isinstance(item, Exception):
                    finished.add(i)  # the engine thread is done with it
                    raise item
                if item.finished:
                    finished.add(i)
                else:
                    pending[i] = asyncio.ensure_future(tickets[i].deltas.get())
                yield i, item
    finally:
        gone.cancel()
        for get in pending.values():
            get.cancel()
        for i, ticket in enumerate(tickets):
            if i not in finished:
                worker.cancel(ticket)


@dataclass
class Choice:
    """One finished choice: its text, token count, finish reason and (when asked) log-probabilities."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    spec: SpecDecodeStats | None = None


ChunkMaker = Callable[[int, str, "str | None", list[TokenLogprob]], object]  # (choice, text, finish, logprobs)


class Frontend:
    """What the routes share: the served name, the engine's tokenizer and limits, the worker."""

    def __init__(self, engine: Engine, worker: EngineWorker, served_model_name: str):
        self.engine, self.worker, self.name = engine, worker, served_model_name

    def spec_stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(accepted_per_position=[0] * self.engine.k_max)

    def submit(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int]) -> list[Ticket]:
        """Check the request and queue its ``n`` choices for the engine (before any response byte: errors keep
        their status)."""
        if body.model != self.name:
            raise model_not_found(body.model, self.name)
        ctx_len, budget = self.engine.model.ctx_len, body.requested_tokens()
        if len(prompt_ids) + (budget or 1) > ctx_len:
            raise context_exceeded(len(prompt_ids), budget, ctx_len)
        loop, tickets = asyncio.get_running_loop(), []
        try:
            for choice in range(body.n):
                params = body.sampling_params(prompt_tokens=len(prompt_ids), ctx_len=ctx_len, choice=choice)
                tickets.append(Ticket(prompt_ids, params, loop))
                self.worker.submit(tickets[-1])
        except Exception:
            for ticket in tickets[:-1]:
                self.worker.cancel(ticket)
            raise
        return tickets

    async def collect(self, tickets: list[Ticket], request: Request) -> list[Choice] | None:
        """Every choice once finished, or None when the client went away."""
        choices = [Choice(spec=self.spec_stats()) for _ in tickets]
        async for i, delta in deltas_of(self.worker, tickets, request):
            choice = choices[i]
            choice.spec.observe(delta.proposed, delta.accepted)
            choice.text += delta.text
            choice.tokens += len(delta.token_ids)
            choice.logprobs += delta.logprobs
            choice.finish_reason = delta.finish_reason
        return choices if all(c.finish_reason is not None for c in choices) else None

    async def stream(
        self,
        tickets: list[Ticket],
        request: Request,
        *,
        include_usage: bool,
        spec: bool,
        chunk: ChunkMaker,
        usage_chunk: Callable[[Usage], object],
    ) -> AsyncIterator[str]:
        """Server-sent events: per choice one chunk per step with new text, its finish chunk (with its
        ``spec_decode`` when asked); then usage if asked, ``[DONE]``."""
        tokens, stats = 0, [self.spec_stats() for _ in tickets]
        try:
            async for i, delta in deltas_of(self.worker, tickets, request):
                tokens += len(delta.token_ids)
                stats[i].observe(delta.proposed, delta.accepted)
                if (delta.text or delta.logprobs) and not delta.finished:
                    yield sse(chunk(i, delta.text, None, delta.logprobs), include_usage=include_usage)
                if delta.finished:
                    final = chunk(i, delta.text, delta.finish_reason, delta.logprobs)
                    final.choices[0].spec_decode = stats[i]
                    yield sse(final, include_usage=include_usage, spec=spec)
            if include_usage:
                yield sse(usage_chunk(Usage.of(len(tickets[0].prompt_ids), tokens)), include_usage=True)
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
        tickets = front.submit(body, prompt_ids)
        rid = new_id("cmpl")
        echo = (
            ""
            if not body.echo
            else body.prompt
            if isinstance(body.prompt, str)
            else engine.tokenizer.decode(prompt_ids)
        )
        sent = [0] * body.n  # characters of each choice's text streamed so far (logprobs' text_offset)

        def chunk(i: int, text: str, finish_reason: str | None, logprobs: list) -> CompletionResponse:
            if sent[i] == 0:
                text = echo + text
            entries = None
            if body.logprobs is not None:
                entries = completion_logprobs(engine.tokenizer, logprobs, offset=sent[i])
            sent[i] += len(text)
            choice = CompletionChoice(index=i, text=text, logprobs=entries, finish_reason=finish_reason)
            return CompletionResponse(id=rid, model=served_model_name, choices=[choice])

        if body.stream:
            usage_chunk = lambda usage: CompletionResponse(id=rid, model=served_model_name, choices=[], usage=usage)  # noqa: E731
            events = front.stream(
                tickets,
                request,
                include_usage=body.include_usage,
                spec=body.return_spec_metrics,
                chunk=chunk,
                usage_chunk=usage_chunk,
            )
            return StreamingResponse(events, media_type="text/event-stream")
        done = await front.collect(tickets, request)
        if done is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        choices = [chunk(i, c.text, c.finish_reason, c.logprobs).choices[0] for i, c in enumerate(done)]
        for choice, c in zip(choices, done):
            choice.spec_decode = c.spec
        response = CompletionResponse(
            id=rid,
            model=served_model_name,
            choices=choices,
            usage=Usage.of(len(prompt_ids), sum(c.tokens for c in done)),
        )
        return JSONResponse(dumped(response, spec=body.return_spec_metrics))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        prompt_ids = engine.tokenizer.encode_chat(body.chat_messages())
        tickets = front.submit(body, prompt_ids)
        rid = new_id("chatcmpl")

        def logprobs_of(entries: list) -> ChatLogprobs | None:
            return chat_logprobs(engine.tokenizer, entries) if body.logprobs else None

        if body.stream:
            started = [False] * body.n

            def chunk(i: int, text: str, finish_reason: str | None, logprobs: list) -> ChatCompletionChunk:
                delta = DeltaMessage(content=text or None, role=None if started[i] else "assistant")
                started[i] = True
                choice = ChatChunkChoice(
                    index=i, delta=delta, logprobs=logprobs_of(logprobs), finish_reason=finish_reason
                )
                return ChatCompletionChunk(id=rid, model=served_model_name, choices=[choice])

            usage_chunk = lambda usage: ChatCompletionChunk(id=rid, model=served_model_name, choices=[], usage=usage)  # noqa: E731
            events = front.stream(
                tickets,
                request,
                include_usage=body.include_usage,
                spec=body.return_spec_metrics,
                chunk=chunk,
                usage_chunk=usage_chunk,
            )
            return StreamingResponse(events, media_type="text/event-stream")
        done = await front.collect(tickets, request)
        if done is None:
            return Response(status_code=499)
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content=c.text),
                logprobs=logprobs_of(c.logprobs),
                finish_reason=c.finish_reason,
                spec_decode=c.spec,
            )
            for i, c in enumerate(done)
        ]
        usage = Usage.of(len(prompt_ids), sum(c.tokens for c in done))
        response = ChatCompletionResponse(id=rid, model=served_model_name, choices=choices, usage=usage)
        return JSONResponse(dumped(response, spec=body.return_spec_metrics))

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def unknown_route(path: str, request: Request) -> Response:
        return error_response(unknown_route_error(request.method, f"/{path}"))

    return app
