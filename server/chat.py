"""Chat-formatted job records: ``{"messages": [{"role": ..., "content": ...}, ...]}``.

A chat record is rendered to text with the teacher tokenizer's chat template
(``tokenizer.apply_chat_template(messages, tokenize=False)``, no generation prompt), or with the
job's own ``chat_template`` (a Jinja string, same variables) when given; the text is then
tokenised **without** adding special tokens again (the template writes BOS and the like itself),
so the cached ids are exactly the rendered conversation's. A teacher tokenizer without a chat
template and no ``chat_template`` in the job is an error naming the record: nothing is guessed.

The scored sequence is the whole conversation. A per-row loss mask (prompt vs response rows)
is not stored: the cache format has no field for it yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import InvalidInputError

#: Roles a message may have.
ROLES = frozenset({"system", "user", "assistant", "tool"})


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts (InvalidInputError otherwise)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError(f"{where}: messages must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if hasattr(m, "model_dump"):
            m = m.model_dump()
        if not isinstance(m, dict):
            raise InvalidInputError(f"{where}: messages[{i}] must be an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise InvalidInputError(
                f"{where}: messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}"
            )
        if not isinstance(content, str):
            raise InvalidInputError(f"{where}: messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


class ChatTokenize:
    """The teacher's ``tokenize`` (a callable on text) plus :meth:`chat` for chat records."""

    def __init__(
        self,
        tokenize: Callable[[str], list[int]],
        tokenizer: Any | None,
        chat_template: str | None = None,
    ):
        self._tokenize = tokenize
        self._tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def of(cls, engine: Any, chat_template: str | None = None) -> ChatTokenize:
        return cls(engine.tokenize, getattr(engine, "tokenizer", None), chat_template)

    def __call__(self, text: str) -> list[int]:
        return self._tokenize(text)

    def render(self, messages: Any, where: str) -> str:
        """The conversation as text (see the module docstring)."""
        msgs = check_messages(messages, where)
        tok = self._tokenizer
        if tok is None:
            raise InvalidInputError(f"{where}: this engine cannot render chat records")
        template = self.chat_template or getattr(tok, "chat_template", None)
        if not template:
            raise InvalidInputError(
                f"{where}: a chat record (messages) needs a chat template, and the teacher's "
                "tokenizer has none: give the job a chat_template, or send text"
            )
        try:
            text = tok.apply_chat_template(
                msgs, chat_template=template, tokenize=False, add_generation_prompt=False
            )
        except Exception as e:  # a Jinja error in a user-given template
            raise InvalidInputError(f"{where}: the chat template failed: {e}") from None
        if not isinstance(text, str):
            raise InvalidInputError(f"{where}: the chat template did not render text")
        return text

    def chat(self, messages: Any, where: str) -> list[int]:
        """Token ids of the rendered conversation (no special tokens added on top)."""
        text = self.render(messages, where)
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_ids(tokenize: Any, messages: Any, where: str) -> list[int]:
    """Ids of a chat record with ``tokenize`` (a :class:`ChatTokenize`; else a clear error)."""
    chat = getattr(tokenize, "chat", None)
    if chat is None:
        raise InvalidInputError(f"{where}: chat records (messages) are accepted by jobs only")
    return chat(messages, where)
