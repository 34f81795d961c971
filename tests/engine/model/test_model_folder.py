"""Loading a local Hugging Face folder: config, safetensors and the folder's own tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.arch import PRESETS
from engine.model.llama import LlamaModel
from engine.model.loader import BYTE_TOKENIZER_MARKER, save_hf_folder


def _folder_with_hf_tokenizer(tmp_path: Path) -> Path:
    import tokenizers  # comes with transformers, a dependency: never skipped
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    model = LlamaModel(PRESETS["tiny"].with_(bos_token_id=1, eos_token_id=2), max_positions=512)
    model.init_synthetic(3)
    folder = save_hf_folder(model, tmp_path / "folder")
    (folder / BYTE_TOKENIZER_MARKER).unlink()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(folder)
    return folder


def test_folder_with_its_own_tokenizer(tmp_path: Path) -> None:
    folder = _folder_with_hf_tokenizer(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", max_model_len=512))
    assert engine.model_name == "folder"
    assert engine.tokenizer.hf is not None and engine.tokenizer.eos_token_id == 2
    ids = engine.tokenizer.encode("the quick fox", add_bos=True)
    assert ids[0] == 1 and len(ids) >= 2
    out = engine.generate([ids], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 5 and isinstance(out[0].text, str)


def test_folder_errors_are_clear(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        LLMEngine(EngineConfig(model=str(empty)))
    model = LlamaModel(PRESETS["tiny"], max_positions=64)
    folder = save_hf_folder(model, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLMEngine(EngineConfig(model=str(folder), max_model_len=64))
