"""Request preparation: body size limit, model check, max_tokens, sampling params, images."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from engine.process.errors import APIError
from engine.server.chat import ChatInputError, turns_from_messages
from engine.server.multimodal import ImageError, load_image_input
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.server.state import ServerState


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413,
        f"request body is {size} bytes, over the {limit} byte limit; send smaller images or "
        "a shorter prompt (the limit is the server's --max-body-bytes)",
        code="request_too_large",
    )


def check_model(state: ServerState, model: str | None) -> None:
    if model is None or model in (state.model_name, state.client.config.model):
        return
    raise APIError(
        400,
        f"model {model!r} is not served here; this server serves {state.model_name!r} "
        "(see GET /v1/models)",
        param="model",
        code="model_not_found",
    )


def resolve_max_tokens(
    state: ServerState, requested: int | None, prompt_len: int, prompt_param: str
) -> int:
    max_len = int(state.client.max_model_len)
    if prompt_len >= max_len:
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens, but this model's context is {max_len} tokens "
            "(prompt plus output); shorten the prompt",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return max_len - prompt_len
    if prompt_len + requested > max_len:
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens and max_tokens is {requested}, together more "
            f"than this model's context of {max_len} tokens; lower max_tokens to at most "
            f"{max_len - prompt_len} or shorten the prompt",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def sampling_params(
    state: ServerState, req: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> Any:
    """The request's ``SamplingParams``; its stop token ids must lie in the vocabulary."""
    from engine.core.sampling_params import SamplingParams

    vocab = int(state.client.tokenizer.vocab_size)
    bad = next((t for t in req.stop_token_ids or () if t >= vocab), None)
    if bad is not None:
        raise APIError(
            400,
            f"stop token id {bad} is outside the vocabulary (0..{vocab - 1})",
            param="stop_token_ids",
            code="invalid_value",
        )
    try:
        return SamplingParams(**req.sampling_kwargs(max_tokens))
    except (TypeError, ValueError) as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


def check_images(state: ServerState, req: ChatCompletionRequest) -> None:
    """The cheap checks on a request's images, before any is decoded: the model takes images,
    and no more than ``--limit-mm-per-prompt`` of them."""
    n = req.num_images
    if not n:
        return
    limits = getattr(state.client, "limits", None)
    if limits is not None and not limits.accepts_images:
        raise APIError(
            400,
            f"model {state.model_name!r} does not accept images",
            param="messages",
            code="invalid_image",
        )
    if n > state.limit_images_per_prompt:
        raise APIError(
            400,
            f"{n} images in one request; this server takes at most "
            f"{state.limit_images_per_prompt} (--limit-mm-per-prompt)",
            param="messages",
            code="invalid_image",
        )


def load_chat_images(state: ServerState, req: ChatCompletionRequest) -> tuple[list, list]:
    check_images(state, req)
    cap = int(state.client.config.image_token_cap)

    def load(url: str) -> Any:
        return load_image_input(
            url,
            token_cap=cap,
            max_bytes=state.max_image_bytes,
            max_pixels=state.max_image_pixels,
        )

    try:
        return turns_from_messages(req.messages, load)
    except ChatInputError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_image") from exc
    except ImageError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_image") from exc
