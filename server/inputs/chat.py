"""Chat-formatted job records: ``{"messages": [{"role": ..., "content": ...}, ...]}``.

A record is rendered with the teacher tokenizer's chat template (or the job's ``chat_template``;
no generation prompt) and tokenised without adding special tokens again; a tokenizer without a
template and no ``chat_template`` is an error naming the record.

With ``loss_mask`` each record also gets a per-row loss mask (FORMAT.md 4.6): assistant message
``i`` spans the characters ``[len(P_i), len(F_i))``, ``P_i`` rendering ``messages[:i]`` with the
generation prompt and ``F_i`` rendering ``messages[:i + 1]`` (a template that rewrites earlier
turns is refused); a token is a response token iff its first character lies in a span, and
``loss_mask[j] = 1`` iff token ``j + 1`` is one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidInputError

if TYPE_CHECKING:
    from ..engine import TeacherEngine

#: Roles a message may have.
ROLES = frozenset({"system", "user", "assistant", "tool"})


def check_messages(messages: object, where: str) -> list[dict[str, str]]:
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
        loss_mask: bool = False,
    ):
        self._tokenize = tokenize
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.loss_mask = loss_mask
        """Whether chat records also get a loss mask (:meth:`chat_with_mask`)."""

    @classmethod
    def of(
        cls, engine: TeacherEngine, chat_template: str | None = None, loss_mask: bool = False
    ) -> ChatTokenize:
        return cls(engine.tokenize, getattr(engine, "tokenizer", None), chat_template, loss_mask)

    def __call__(self, text: str) -> list[int]:
        return self._tokenize(text)

    def render(self, messages: object, where: str, *, generation_prompt: bool = False) -> str:
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
                msgs,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as e:  # a Jinja error in a user-given template
            raise InvalidInputError(f"{where}: the chat template failed: {e}") from None
        if not isinstance(text, str):
            raise InvalidInputError(f"{where}: the chat template did not render text")
        return text

    def chat(self, messages: object, where: str) -> list[int]:
        """Token ids of the rendered conversation (no special tokens added on top)."""
        text = self.render(messages, where)
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def assistant_spans(self, messages: object, where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its assistant turns (module docstring)."""
        msgs = check_messages(messages, where)
        text = self.render(msgs, where)
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            head = self.render(msgs[:i], where, generation_prompt=True) if i else ""
            full = self.render(msgs[: i + 1], where)
            if not (full.startswith(head) and text.startswith(full)):
                raise InvalidInputError(
                    f"{where}: cannot mark the assistant turns for the loss mask: the chat "
                    f"template does not render messages[:{i + 1}] as a prefix of the conversation"
                )
            if len(full) > len(head):
                spans.append((len(head), len(full)))
        return text, spans

    def chat_with_mask(self, messages: object, where: str) -> tuple[list[int], np.ndarray]:
        """Token ids of the rendered conversation and its row loss mask (uint8 ``[L-1]``:
        ``1`` where row ``j`` predicts a token of an assistant turn; module docstring)."""
        text, spans = self.assistant_spans(messages, where)
        enc = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        starts = np.asarray([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
        response = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            response |= (starts >= a) & (starts < b)
        return ids, response[1:].astype(np.uint8)


def chat_ids(tokenize: Callable[[str], list[int]], messages: object, where: str) -> list[int]:
    """Ids of a chat record with ``tokenize`` (a :class:`ChatTokenize`; else a clear error)."""
    chat = getattr(tokenize, "chat", None)
    if chat is None:
        raise InvalidInputError(f"{where}: chat records (messages) are accepted by jobs only")
    return chat(messages, where)


def chat_ids_and_mask(
    tokenize: Callable[[str], list[int]], messages: object, where: str
) -> tuple[list[int], np.ndarray | None]:
    """Ids of a chat record and, when ``tokenize.loss_mask`` is set, its row loss mask."""
    if getattr(tokenize, "loss_mask", False):
        return tokenize.chat_with_mask(messages, where)
    return chat_ids(tokenize, messages, where), None
