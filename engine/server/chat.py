"""Chat prompts: OpenAI messages → prompt token ids, with image placeholder runs.

The byte-level presets use a simple template::

    <BOS> "<|system|>\\n" content "\\n" "<|user|>\\n" content "\\n" ... "<|assistant|>\\n"

where a text part is ``tokenizer.encode(text)`` and an image part is ``num_tokens`` copies of
``tokenizer.image_token_id``. A real model folder whose tokenizer exposes a Hugging Face chat
template (``tokenizer.hf.chat_template``) uses that template for text-only conversations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class ChatInputError(ValueError):
    """A message part the engine cannot take; ``param`` points at it."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class ChatTokenizer(Protocol):
    bos_token_id: int | None
    image_token_id: int | None

    def encode(self, text: str) -> list[int]: ...


class HasNumTokens(Protocol):
    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class ChatTurn:
    """One message: ``role`` and its parts, each text or an image (anything with num_tokens)."""

    role: str
    parts: Sequence[str | HasNumTokens]


def role_header(role: str) -> str:
    return f"<|{role}|>\n"


ASSISTANT_HEADER = role_header("assistant")


def _encode_text(tokenizer: ChatTokenizer, text: str) -> list[int]:
    """Encode without special tokens: the template adds BOS once."""
    ids = list(tokenizer.encode(text))
    bos = getattr(tokenizer, "bos_token_id", None)
    if ids and bos is not None and ids[0] == bos:
        ids = ids[1:]
    return ids


def build_chat_prompt(turns: Sequence[ChatTurn], tokenizer: ChatTokenizer) -> list[int]:
    """Token ids for ``turns`` followed by the assistant header (simple template)."""
    if not turns:
        raise ValueError("messages must contain at least one message")
    ids: list[int] = []
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        ids.append(bos)
    for turn in turns:
        ids += _encode_text(tokenizer, role_header(turn.role))
        for part in turn.parts:
            if isinstance(part, str):
                ids += _encode_text(tokenizer, part)
            else:
                image_token = getattr(tokenizer, "image_token_id", None)
                if image_token is None:
                    raise ValueError("this model does not take images; send text only")
                ids += [image_token] * part.num_tokens
        ids += _encode_text(tokenizer, "\n")
    ids += _encode_text(tokenizer, ASSISTANT_HEADER)
    return ids


def hf_chat_template(tokenizer: Any) -> Any | None:
    """The Hugging Face tokenizer behind ``tokenizer`` if it has a chat template, else None."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not getattr(hf, "chat_template", None):
        return None
    return hf


def render_chat(
    turns: Sequence[ChatTurn],
    tokenizer: ChatTokenizer,
    *,
    use_hf_template: bool = True,
) -> list[int]:
    """Prompt ids: the model's own chat template for text-only chats when it has one."""
    has_images = any(not isinstance(p, str) for t in turns for p in t.parts)
    hf = hf_chat_template(tokenizer) if use_hf_template and not has_images else None
    if hf is not None:
        messages = [{"role": t.role, "content": "".join(map(str, t.parts))} for t in turns]
        try:
            out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        except Exception as exc:  # a template that rejects a role order, etc.
            raise ValueError(f"the model's chat template rejected the messages: {exc}") from exc
        if isinstance(out, dict):  # newer transformers return a BatchEncoding
            out = out["input_ids"]
        return [int(t) for t in out]
    return build_chat_prompt(turns, tokenizer)


def turns_from_messages(
    messages: Sequence[Any], load_image: Callable[[str], HasNumTokens]
) -> tuple[list[ChatTurn], list[Any]]:
    """Protocol messages → (turns, images in order); ``load_image(url)`` decodes one image.

    ``messages`` are :class:`engine.server.protocol.ChatMessage` objects (anything with ``role`` and
    ``parts()`` returning text parts with ``.text`` and image parts with ``.image_url.url``).
    """
    turns: list[ChatTurn] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        parts: list[str | HasNumTokens] = []
        for j, part in enumerate(message.parts()):
            if part.type == "text":
                parts.append(part.text)
            else:
                try:
                    image = load_image(part.image_url.url)
                except ValueError as exc:
                    raise ChatInputError(str(exc), param=f"messages[{i}].content[{j}]") from exc
                images.append(image)
                parts.append(image)
        turns.append(ChatTurn(role=message.role, parts=parts))
    return turns, images
