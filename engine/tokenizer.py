"""Tokenizers: a byte-level one for the synthetic presets, and a wrapper for a model folder's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

BYTE_TOKENIZER_MARKER = "chunkscope_tokenizer.json"  # in a model folder: use the byte tokenizer


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    image_token_id: int | None
    hf: Any

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Token ids 0..255 are UTF-8 bytes; 256 BOS, 257 EOS, 258 image placeholder, 259 pad."""

    vocab_size = 260
    bos_token_id: int | None = 256
    eos_token_id: int | None = 257
    image_token_id: int | None = 258
    pad_token_id = 259
    hf: Any = None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [256, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(i for i in ids if 0 <= i < 256)


class HFTokenizer:
    """A model folder's own tokenizer (loaded with `transformers`, no downloads)."""

    image_token_id: int | None = None

    def __init__(self, folder: str, vocab_size: int, eos_token_id: int | None) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.vocab_size = vocab_size
        self.bos_token_id = self.hf.bos_token_id
        self.eos_token_id = (
            self.hf.eos_token_id if self.hf.eos_token_id is not None else eos_token_id
        )

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids: list[int] = self.hf.encode(text, add_special_tokens=False)
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=True))


def make_tokenizer(
    folder: str | Path | None, vocab_size: int, eos_token_id: int | None
) -> Tokenizer:
    """The tokenizer of a synthetic preset (``folder`` None) or of a model folder; loads no
    weights, so the HTTP server process builds its own copy of the engine's tokenizer."""
    if folder is None or (Path(folder) / BYTE_TOKENIZER_MARKER).exists():
        return ByteTokenizer()
    return HFTokenizer(str(folder), vocab_size, eos_token_id)
