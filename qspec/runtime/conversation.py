"""A chat's history for ``qspec chat``: the messages so far, rendered through the chat template, the oldest
turns dropped when the next answer would not fit the package's context.

>>> chat = Conversation(system="Be brief.")
>>> chat.add("user", "hi"); chat.add("assistant", "hello")
>>> [m["role"] for m in chat.messages]
['system', 'user', 'assistant']
>>> chat.reset(); [m["role"] for m in chat.messages]
['system']
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qspec.errors import ConfigError
from qspec.runtime.tokenizer import Tokenizer


@dataclass
class Conversation:
    """The messages of one conversation (an optional system message first, then user and assistant turns)."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    @property
    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def add(self, role: str, content: str) -> None:
        self.turns.append({"role": role, "content": content})

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self.turns.clear()

    def prompt_ids(self, tokenizer: Tokenizer, *, ctx_len: int, max_new_tokens: int) -> tuple[list[int], int]:
        """``(ids, dropped)``: the conversation through the chat template, ready for the assistant's answer,
        after dropping the oldest turns (``dropped`` of them) until it and ``max_new_tokens`` fit ``ctx_len``.

        The last user message alone too long is a ConfigError (the conversation keeps its other turns).
        """
        if not tokenizer.chat_template:
            raise ConfigError("this package's tokenizer has no chat template; use `qspec generate` for raw prompts")
        dropped = 0
        while True:
            ids = tokenizer.encode_chat(self.messages)
            if len(ids) + max_new_tokens <= ctx_len:
                return ids, dropped
            if len(self.turns) <= 1:
                if self.turns:
                    self.turns.pop()
                raise ConfigError(
                    f"this message is {len(ids)} tokens with the template; with --max-new-tokens {max_new_tokens} "
                    f"it does not fit the package's ctx_len {ctx_len}: send a shorter one"
                )
            del self.turns[0]  # the oldest user message, then the answer to it: a conversation starts with a user
            while self.turns and self.turns[0]["role"] != "user":
                del self.turns[0]
            dropped += 1
