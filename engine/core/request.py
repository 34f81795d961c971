"""A request's state as the scheduler sees it: counts plus a block table. No torch."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import Any

from engine.core.sampling_params import SamplingParams

IMAGE_PATCH_PIXELS = 28  # Qwen2-VL: one image token per 28x28 pixels after resizing


@dataclass(frozen=True)
class ImageInput:
    """One image, already resized so that height and width are multiples of 28.

    ``pixels`` is a uint8 array ``[H, W, 3]``; ``content_hash`` identifies the pixels (it keys the
    prefix cache, so two requests with the same image share cached KV blocks).
    """

    pixels: Any
    content_hash: str

    @property
    def num_tokens(self) -> int:
        h, w = self.pixels.shape[0], self.pixels.shape[1]
        return (h // IMAGE_PATCH_PIXELS) * (w // IMAGE_PATCH_PIXELS)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


_arrival_counter = itertools.count()


class Request:
    """One generation request.

    Token layout (positions are indices into ``token_ids`` = prompt + output so far)::

        | computed (KV in cache)        | still to compute      |
        0 ............ num_computed_tokens ............ num_tokens
                                                   ^ the last known token: computing it
                                                     yields the logits of the next token

    A step schedules ``num_tokens - num_computed_tokens`` tokens at most; a running decode has
    exactly one left. After a preemption ``num_computed_tokens`` falls back to 0 and the prompt
    and the outputs so far are recomputed as one prefill.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_ns: int,
        traffic_class: str | None = None,
        images: list[ImageInput] | None = None,
        image_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.params = params
        self.arrival_ns = arrival_ns  # monotonic nanoseconds, like every engine time
        self.arrival_index = next(_arrival_counter)
        self.traffic_class = traffic_class
        self.images: list[ImageInput] = list(images or [])
        self.eos_token_id = eos_token_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.status = RequestStatus.WAITING
        self.first_scheduled_ns: int | None = None
        self.first_token_ns: int | None = None
        self.token_times_ns: list[int] = []
        self.abort_reason: str | None = None  # finish reason of an abort ("abort" if None)
        self.num_preemptions = 0
        self.image_spans: list[tuple[int, int]] = []
        # (image index, band) -> embeddings, filled by the runner as chunks reach them
        self.image_embeds: Any = None
        if self.images:
            self.image_spans = _image_spans(prompt_token_ids, self.images, image_token_id)

    # --- counts -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_image_tokens(self) -> int:
        return sum(n for _, n in self.image_spans)

    @property
    def num_remaining(self) -> int:
        """Tokens known but not yet computed."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_output_tokens == 0 or self.num_remaining > 1

    @property
    def finish_reason(self) -> str | None:
        if self.status == RequestStatus.FINISHED_ABORTED and self.abort_reason is not None:
            return self.abort_reason
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int, now_ns: int) -> None:
        self.token_ids.append(token_id)
        self.token_times_ns.append(now_ns)
        if self.first_token_ns is None:
            self.first_token_ns = now_ns

    def check_stop(self) -> RequestStatus | None:
        """Stop condition after a new token: stop token, EOS, or max_tokens."""
        last = self.token_ids[-1]
        if (
            not self.params.ignore_eos
            and self.eos_token_id is not None
            and last == self.eos_token_id
        ):
            return RequestStatus.FINISHED_STOPPED
        if last in self.params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )


def _image_spans(
    prompt: list[int], images: list[ImageInput], image_token_id: int | None
) -> list[tuple[int, int]]:
    """Place each image on the next ``num_tokens`` placeholder positions, in order.

    Images may sit back to back (one long run of placeholders holds several images); every
    placeholder must belong to exactly one image.
    """
    if image_token_id is None:
        raise ValueError("this model has no image token, so it cannot take images")
    positions = [i for i, t in enumerate(prompt) if t == image_token_id]
    expected = [img.num_tokens for img in images]
    if len(positions) != sum(expected):
        raise ValueError(
            f"prompt has {len(positions)} image placeholder tokens, but the images need "
            f"{expected} tokens each ({sum(expected)} in all)"
        )
    spans: list[tuple[int, int]] = []
    k = 0
    for n in expected:
        start = positions[k]
        if positions[k + n - 1] != start + n - 1:
            raise ValueError(
                f"the {n} placeholder tokens of image {len(spans) + 1} must be consecutive"
            )
        spans.append((start, n))
        k += n
    return spans
