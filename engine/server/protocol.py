"""OpenAI-compatible request models, their validation, and OpenAI-style error JSON. No torch.

Request bodies are parsed strictly (a string where a number belongs is an error, not coerced),
unknown fields are ignored the way the OpenAI API ignores them, and every failure becomes an
:class:`APIError` whose message names the offending field and says what would be accepted.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.core.sampling_params import (
    MAX_SEED,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MAX_TOP_K,
    MIN_SEED,
    MIN_TEMPERATURE,
)
from engine.process.errors import APIError
from wire import strict_json

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256
TRAFFIC_CLASS_MAX_LEN = 32


# --- request models -------------------------------------------------------------------------

_STRICT = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions.

    The sampling bounds are those of ``engine.core.sampling_params.SamplingParams`` (within
    the OpenAI ranges): whatever passes here samples without error.
    """

    model_config = _STRICT

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS
    )
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    user: str | None = None

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}; a smaller one "
                "overflows the logits"
            )
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        for s in stops:
            if not s:
                raise ValueError("stop sequences must be non-empty strings")
            if len(s) > MAX_STOP_LENGTH:
                raise ValueError(f"stop sequences must be at most {MAX_STOP_LENGTH} characters")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_kwargs(self, max_tokens: int) -> dict[str, Any]:
        """Keyword arguments for ``engine.core.sampling_params.SamplingParams``."""
        return {
            "max_tokens": max_tokens,
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
        }


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is text or a list of token ids."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            if isinstance(value[0], str):
                if len(value) != 1:
                    raise ValueError(
                        "batched prompts are not supported: send one prompt per request"
                    )
            elif any(t < 0 for t in value):  # type: ignore[operator]
                raise ValueError("token ids in prompt must be non-negative")
        elif value == "":
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported; leave it false")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("logprobs are not supported; leave the field out")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported; leave the field out")
        return value

    @property
    def prompt_text_or_ids(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return self.prompt  # type: ignore[return-value]


class ImageURL(BaseModel):
    model_config = _STRICT
    url: str
    detail: str | None = None


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    model_config = _STRICT
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def parts(self) -> list[TextPart | ImagePart]:
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        return list(self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool) -> bool:
        if value:
            raise ValueError("logprobs are not supported; leave it false")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens

    @property
    def num_images(self) -> int:
        return sum(isinstance(p, ImagePart) for m in self.messages for p in m.parts())


class SchedulerUpdate(BaseModel):
    """``PUT /v1/scheduler``: a new token budget, policy and/or long-prefill cap. Unknown keys
    are an error."""

    model_config = ConfigDict(strict=True, extra="forbid")
    token_budget: int | None = None
    policy: str | None = None
    long_prefill_token_threshold: int | None = None


# --- parsing --------------------------------------------------------------------------------


def parse_json_body(body: bytes) -> Any:
    """Decode a JSON body, or raise a 400 that says where the JSON broke."""
    if not body:
        raise APIError(400, "request body is empty; send a JSON object", code="invalid_json")
    try:
        return strict_json.loads(body)
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not UTF-8: {exc}", code="invalid_json") from exc
    except ValueError as exc:
        raise APIError(400, f"request body refused: {exc}", code="invalid_json") from exc


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    previous: Any = None
    for item in loc:
        if item == previous and isinstance(item, str):
            continue  # a discriminated union repeats its tag: ("image_url", "image_url", "url")
        previous = item
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in ("str", "int", "list[int]", "list[str]", "list[...]", "function-after"):
            continue  # union-branch tags pydantic adds; not part of the field path
        elif isinstance(item, str) and ("[" in item or item.startswith("function-")):
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def validation_error_to_api_error(exc: ValidationError) -> APIError:
    """Turn pydantic's errors into one 400 naming the first bad field."""
    errors = exc.errors(include_url=False)
    # A union reports one error per branch; prefer a value error (our own message), else the
    # most specific (deepest) location.
    chosen = next((e for e in errors if e["type"] == "value_error"), None)
    if chosen is None:
        chosen = max(errors, key=lambda e: len(_loc_to_param(tuple(e["loc"]))))
    param = _loc_to_param(tuple(chosen["loc"]))
    hint = next((h for key, h in _UNION_HINTS.items() if param.endswith(key)), None)
    if chosen["type"] == "missing":
        message = f"missing required field '{param}'"
    elif chosen["type"] == "extra_forbidden":
        message = f"unknown field '{param}'"
    else:
        msg = str(chosen["msg"]).removeprefix("Value error, ")
        got = chosen.get("input")
        shown = json.dumps(got)[:80] if _jsonable(got) else type(got).__name__
        message = f"invalid value for '{param}': {msg} (got {shown})" if param else msg
        if hint and chosen["type"] != "value_error":
            message += f"; {hint}"
    return APIError(400, message, param=param or None, code="invalid_value")


_UNION_HINTS = {
    "prompt": "prompt must be a string or a list of token ids (ints)",
    "prompt[0]": "prompt must be a string or a list of token ids (ints)",
    "content": "content must be a string or a list of parts like "
    '{"type": "text", "text": ...} or {"type": "image_url", "image_url": {"url": ...}}',
    "stop": "stop must be a string or a list of up to 4 strings",
}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def parse_request(model: type[M], body: bytes) -> M:
    """Parse and validate ``body`` as ``model``; raise :class:`APIError` (400) on any problem."""
    data = parse_json_body(body)
    if not isinstance(data, dict):
        raise APIError(
            400,
            f"request body must be a JSON object, got {type(data).__name__}",
            code="invalid_json",
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc) from exc


def check_traffic_class(value: str | None) -> str | None:
    """Validate an ``X-Traffic-Class`` header: a short label of letters, digits, ``-_.:``."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if len(value) > TRAFFIC_CLASS_MAX_LEN or not all(c.isalnum() or c in "-_.:" for c in value):
        raise APIError(
            400,
            f"X-Traffic-Class must be a short label (at most {TRAFFIC_CLASS_MAX_LEN} letters, "
            f"digits or '-_.:'), e.g. chat, rag, vlm; got {value[:40]!r}",
            param="X-Traffic-Class",
            code="invalid_value",
        )
    return value.lower()
