"""The package's tokenizer without transformers: ``tokenizers`` for the vocabulary, jinja2 for chat.

Encoding matches ``transformers``' fast tokenizer: raw prompts get the tokenizer's own special
tokens (its post-processor), chat prompts are the rendered template encoded without adding any.
"""

from __future__ import annotations

import json
from pathlib import Path

from qspec.errors import PackageError

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode, decode and render chat prompts from a saved Hugging Face tokenizer folder."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer as _Tokenizer

        folder = Path(folder)
        try:
            self._tok = _Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:
            raise PackageError(f"cannot read {folder / 'tokenizer.json'}: {exc}") from None
        config_path = folder / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = folder / CHAT_TEMPLATE_FILE
        self.chat_template = template_path.read_text() if template_path.is_file() else self.config.get("chat_template")
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self._template = None

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    def stop_ids(self, eos_token_ids) -> frozenset[int]:
        """``eos_token_ids`` (the package's) and this tokenizer's own EOS: every token that ends a sequence."""
        own = self.eos_token_id
        return frozenset(eos_token_ids) | ({own} if own is not None else frozenset())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (as ``apply_chat_template(tokenize=False)``)."""
        if not self.chat_template:
            raise PackageError("this model's tokenizer has no chat template; drop --chat and give a raw prompt")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise PackageError(f"chat template: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, str]] | str) -> list[int]:
        """Token ids of a chat prompt; a string is one user message."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def encode_prompt(self, prompt, *, chat: bool = False) -> list[int]:
        """Token ids of a prompt: text (raw or, with ``chat``, through the chat template), ids, or chat messages."""
        if isinstance(prompt, str):
            return self.encode_chat(prompt) if chat else self.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.encode_chat(list(prompt))
        return [int(t) for t in prompt]


class TextStream:
    """Incremental detokenization: feed token ids, get the new text (held back mid-character).

    Each push decodes only the tokens since the last text it returned, with the tokens of the text
    before that as context (as vLLM does): ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``.
    Decoding everything at every step would cost more with every token of the output. Text that ends in
    U+FFFD is held back (the next token may complete the character); :meth:`flush` at the end gives what
    is held, so the whole text is ``decode(ids)`` however the ids were split into pushes (a speculative
    step pushes one to K + 1 of them).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read]: the context, already in text
        self._read = 0  # ids[_read:]: not yet in text

    def push(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        text = self.tokenizer.decode(self.ids[self._prefix :])
        if text.endswith("\ufffd") or len(text) <= len(before):  # an incomplete UTF-8 sequence, or nothing yet
            return ""
        return self._take(text, before)

    def flush(self) -> str:
        """The text held back, bytes that make no character included (as U+FFFD): the stream's end."""
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        text = self.tokenizer.decode(self.ids[self._prefix :])
        return self._take(text, before) if len(text) > len(before) else ""

    def _take(self, text: str, before: str) -> str:
        new = text[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new
