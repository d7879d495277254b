"""Requests and responses of the OpenAI API, as pydantic models: the wire format lives here only.

Requests refuse unknown fields (a clear 400 instead of silently ignoring what a client asked for);
fields clients often send with a neutral value (``presence_penalty: 0``, ``logprobs: null``, ...)
are accepted at that value only. Extensions, as vLLM names them: ``top_k``, ``ignore_eos``.
``logprobs`` are the target model's own log-probabilities (:mod:`qspec.runtime.logprobs`), at most
:data:`MAX_LOGPROBS` alternatives per token.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from qspec.runtime.sampling import SamplingParams

# Fields qspec does not implement, accepted only at the value that means "off".
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "parallel_tool_calls": (None, False),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


MAX_LOGPROBS = 20  # OpenAI's bound for top_logprobs
MAX_CHOICES = 16  # n: choices per request, each a request in the engine


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """What completions and chat completions share: model, sampling, stop, streaming."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # extension; -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension: generate up to max_tokens whatever the model says
    return_spec_metrics: bool = False  # extension: each choice's speculation counts (``spec_decode``)
    user: str | None = None  # accepted and ignored, as an identifier for the client's own logs
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _supported(self) -> _GenerationRequest:
        for name, neutral in NEUTRAL.items():
            value = getattr(self, name, None)
            if value not in neutral:
                raise ValueError(f"{name}={value!r} is not supported by qspec serve; leave it out")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_tokens(self) -> int | None:
        raise NotImplementedError

    def logprobs_wanted(self) -> int | None:
        """None, or how many alternatives each token's log-probability comes with."""
        raise NotImplementedError

    def sampling_params(self, *, prompt_tokens: int, ctx_len: int, choice: int = 0) -> SamplingParams:
        """Engine parameters of choice ``choice`` (of ``n``; a seeded request's choices differ by their seeds);
        without a token budget, the rest of the context."""
        budget = self.requested_tokens()
        if budget is None:
            budget = max(1, ctx_len - prompt_tokens)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=self.temperature or 0.0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            top_k=max(0, self.top_k or 0),
            seed=None if self.seed is None else self.seed + choice,
            max_new_tokens=budget,
            stop=[s for s in stop if s],
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs_wanted(),
        )


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    best_of: int | None = None
    echo: bool = False  # the prompt's text before the completion's
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise ValueError(f"prompt is a batch of {len(self.prompt)}; send one prompt per request")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise ValueError("prompt is empty; give at least one token")
        if self.echo and self.logprobs is not None:
            raise ValueError(
                "echo with logprobs (the prompt's log-probabilities) is not supported; send echo or logprobs"
            )
        return self

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered with the package tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(default=None, ge=1)
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=true")
        return self

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class SpecDecodeStats(BaseModel):
    """One choice's speculation, in /metrics' terms: verify calls that carried drafts, draft tokens verified,
    those accepted, and accepted tokens by draft position (``[i]``: steps whose draft ``i`` was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = Field(default_factory=list)

    def observe(self, proposed: int, accepted: int) -> None:
        """One step's counts; a step without drafts is no draft."""
        if not proposed:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_position[pos] += 1


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: one entry per token in every list."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    spec_decode: SpecDecodeStats | None = None  # with return_spec_metrics, when the choice is finished


class CompletionResponse(BaseModel):
    """A whole completion, or (``choices`` of new text only) one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason
    spec_decode: SpecDecodeStats | None = None  # with return_spec_metrics


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    spec_decode: SpecDecodeStats | None = None  # with return_spec_metrics, in a choice's finish chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "qspec"
    max_model_len: int  # vLLM's field: the package's ctx_len


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
