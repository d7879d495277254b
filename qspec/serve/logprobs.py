"""The engine's :class:`~qspec.runtime.logprobs.TokenLogprob` entries in OpenAI's two wire shapes.

A token's text is its own decoding; ``bytes`` are that text's UTF-8 bytes (a token holding part of a
character decodes to U+FFFD, as a tokenizer's ``decode`` of it alone does).
"""

from __future__ import annotations

from qspec.runtime.logprobs import TokenLogprob
from qspec.runtime.tokenizer import Tokenizer
from qspec.serve.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def token_text(tokenizer: Tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def _top(tokenizer: Tokenizer, token: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> ChatLogprobs:
    """``choices[i].logprobs`` of a chat completion (or of one streamed chunk)."""
    content = []
    for entry in entries:
        top = [_top(tokenizer, t, lp) for t, lp in entry.top]
        content.append(ChatTokenLogprob(**_top(tokenizer, entry.token, entry.logprob).model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob], *, offset: int = 0) -> CompletionLogprobs:
    """``choices[i].logprobs`` of a completion: tokens, their log-probabilities, the alternatives, and each
    token's character offset in the choice's text (from ``offset``, the text before these tokens)."""
    out = CompletionLogprobs()
    for entry in entries:
        text = token_text(tokenizer, entry.token)
        out.tokens.append(text)
        out.token_logprobs.append(entry.logprob)
        top: dict[str, float] = {}
        for t, lp in entry.top:  # two tokens may read the same (a part of a character): the likelier is kept
            top.setdefault(token_text(tokenizer, t), lp)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out
