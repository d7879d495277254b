"""A request in the engine: its state while in flight, what it produced, and what each step added.

:class:`SequenceState` is the engine's per-request record (slot, position, output, stream, metrics);
:class:`RequestOutput` is the finished request, :class:`RequestDelta` what one scheduler step added.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qspec.errors import ConfigError, PromptTooLongError
from qspec.runtime.logprobs import TokenLogprob, token_logprobs
from qspec.runtime.metrics import RequestMetrics
from qspec.runtime.sampling import SamplingParams
from qspec.runtime.tokenizer import TextStream, Tokenizer

Prompt = str | Sequence[int] | list[dict[str, str]]
TextCallback = Callable[[int, str], None]  # (request index, new text)


@dataclass
class RequestOutput:
    """What one request produced."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens or ctx_len)
    metrics: RequestMetrics

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "prompt_tokens": len(self.prompt_token_ids),
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics.to_dict(),
        }


@dataclass
class RequestDelta:
    """What one request produced in one scheduler :meth:`Engine.step`."""

    request_id: int
    token_ids: list[int]  # new in this step
    text: str  # new in this step (held back mid-character, cut before a stop string)
    proposed: int = 0  # drafts verified for it in this step
    accepted: int = 0  # of which accepted
    finish_reason: str | None = None  # on its last delta: "stop", "length" or "abort"
    output: RequestOutput | None = None  # on its last delta: the whole request
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, when the request asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SequenceState:
    """A request in flight."""

    index: int
    prompt: list[int]
    params: SamplingParams
    slot: int = -1  # its KV slot
    row: int = -1  # its row in the last decode call (the slot, unless the cache has more slots than a call rows)
    prefilled: int = 0  # prompt tokens written to the KV slot
    position: int = 0
    last: int = -1
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stream: TextStream | None = None
    rng: np.random.Generator | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    new_tokens: list[int] = field(default_factory=list)  # since the last delta
    new_text: str = ""
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # of new_tokens, when params.logprobs is set

    @property
    def prefill_done(self) -> bool:
        """Its whole prompt is in the KV slot: it decodes."""
        return self.prefilled == len(self.prompt)

    def cached_tokens(self) -> list[int]:
        """The tokens whose KV this request wrote to its slot, by position (what a later request may reuse)."""
        written = self.position if self.prefill_done else self.prefilled
        return (self.prompt + self.output)[:written]

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output)

    def append(
        self, tokens: list[int], eos_token_ids: frozenset[int], ctx_len: int, logits: np.ndarray | None = None
    ) -> list[int]:
        """Append ``tokens`` until a stop (EOS, the token budget, a stop string, the context's end);
        returns the tokens kept, the last of which becomes ``last``. ``logits`` [>= len(tokens), vocab]: the
        rows the tokens were picked from, for the log-probabilities a request with ``params.logprobs`` wants."""
        kept = []
        for token in tokens:
            kept.append(token)
            self.output.append(token)
            if token in eos_token_ids and not self.params.ignore_eos:
                self.finish_reason = "stop"
                break
            if self.remaining <= 0:
                self.finish_reason = "length"
                break
        self.last = kept[-1]
        self.new_tokens.extend(kept)
        if self.params.logprobs is not None and logits is not None:
            self.new_logprobs.extend(token_logprobs(logits, kept, top=self.params.logprobs))
        if self.finish_reason is None and self.position >= ctx_len:
            self.finish_reason = "length"  # `last` has no slot left to be written to
        if self.stream is not None:
            new_text = self.stream.push(kept)
            if self.finish_reason is not None:  # the end: what the stream held back (a character's first bytes)
                new_text += self.stream.flush()
            if self.params.stop:
                cut = self.cut_at_stop(len(new_text))
                if cut is not None:
                    self.finish_reason = "stop"
                    new_text = new_text[: max(0, len(new_text) - cut)]  # stream up to the stop string
            self.new_text += new_text
        return kept

    def cut_at_stop(self, new_chars: int) -> int | None:
        """Cut the text before the first stop string; returns how many characters were cut, or None.

        Earlier text was checked when it arrived, so a new match must overlap the ``new_chars`` newest.
        """
        text = self.stream.text
        matches = []
        for stop in self.params.stop:
            at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if at >= 0:
                matches.append(at)
        if not matches:
            return None
        self.stream.text = text[: min(matches)]
        return len(text) - min(matches)

    def to_output(self, tokenizer: Tokenizer) -> RequestOutput:
        text = self.stream.text if self.stream is not None else tokenizer.decode(self.output)
        return RequestOutput(self.index, self.prompt, self.output, text, self.finish_reason or "length", self.metrics)

    def take_delta(self, tokenizer: Tokenizer, before: tuple[int, int] | None) -> RequestDelta:
        """What the request produced since the last delta; ``before``: (proposed, accepted) at the step's start."""
        proposed, accepted = before or (self.metrics.proposed, self.metrics.accepted)
        delta = RequestDelta(
            self.index,
            self.new_tokens,
            self.new_text,
            proposed=self.metrics.proposed - proposed,
            accepted=self.metrics.accepted - accepted,
            finish_reason=self.finish_reason,
            output=self.to_output(tokenizer) if self.finish_reason is not None else None,
            logprobs=self.new_logprobs,
        )
        self.new_tokens, self.new_text, self.new_logprobs = [], "", []
        return delta


def check_fits(name: str, prompt: list[int], ctx_len: int, *, new_tokens: int = 128) -> None:
    """Raise unless ``prompt`` has at least one token and fits ``ctx_len`` (the error names both numbers and
    a ``--ctx-len`` with room for ``new_tokens`` more)."""
    if not prompt:
        raise ConfigError(f"{name} is empty; give at least one token")
    if len(prompt) > ctx_len:
        raise PromptTooLongError(
            f"{name} has {len(prompt)} tokens but the package's ctx_len is {ctx_len}; "
            f"shorten the prompt or compile with --ctx-len {len(prompt) + new_tokens} or more"
        )


def check_budget(name: str, prompt: list[int], max_new_tokens: int, ctx_len: int) -> None:
    """Raise unless ``prompt`` plus ``max_new_tokens`` fits ``ctx_len``: the server's rule (vLLM's 400), for
    the command line (the engine itself stops a request at the context's end, finish reason ``length``)."""
    check_fits(name, prompt, ctx_len, new_tokens=max_new_tokens)
    total = len(prompt) + max_new_tokens
    if total > ctx_len:
        raise PromptTooLongError(
            f"{name} ({len(prompt)} tokens) plus --max-new-tokens {max_new_tokens} is {total} tokens, more than "
            f"the package's ctx_len {ctx_len}; lower --max-new-tokens to {ctx_len - len(prompt)} or compile with "
            f"--ctx-len {total} or more"
        )


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids, chat messages) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], (int, np.integer, dict)):
        return [prompts]
    return list(prompts)


def params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One :class:`SamplingParams` per prompt: ``params`` for all (default: greedy, 128 tokens), or one each."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    if len(params) != count:
        raise ConfigError(f"got {len(params)} sampling params for {count} prompts; give one or one per prompt")
    return list(params)
