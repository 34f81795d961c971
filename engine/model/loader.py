"""Build a model: a named synthetic preset, or a local Hugging Face folder (safetensors)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.arch import PRESETS, ModelArch, arch_from_hf_config
from engine.model.llama import LlamaModel
from engine.model.packed_linear import pack_linears
from engine.model.panel_linear import pack_panels
from engine.tokenizer import BYTE_TOKENIZER_MARKER, ByteTokenizer, Tokenizer, make_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    arch: ModelArch
    model: LlamaModel
    tokenizer: Tokenizer


@dataclass(frozen=True)
class ModelSource:
    name: str
    arch: ModelArch
    folder: Path | None  # None for a synthetic preset


def resolve_model(name: str) -> ModelSource:
    """Find a preset or read a local folder's config; raises ValueError if neither."""
    if name in PRESETS:
        return ModelSource(name, PRESETS[name], None)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {str(path)!r} has no config.json")
        from transformers import AutoConfig

        arch = arch_from_hf_config(AutoConfig.from_pretrained(path, local_files_only=True))
        return ModelSource(path.name, arch, path)
    raise ValueError(
        f"unknown model {name!r}: use a preset ({', '.join(PRESETS)}) or a local Hugging Face "
        "model folder (config.json + *.safetensors); nothing is downloaded"
    )


def load_model(
    source: ModelSource,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    seed: int = 0,
) -> LoadedModel:
    model = _build(source.arch, max_positions, device, dtype)
    if source.folder is None:
        model.init_synthetic(seed)
    else:
        load_safetensors(model, source.folder)
    pack_linears(model, dtype, device)  # bf16 on CPU, fp32 on non-Intel AVX-512: packed for oneDNN
    pack_panels(model, dtype, device)  # fp32 on AVX2-class CPUs: 16-output panels, one C kernel
    tokenizer = make_tokenizer(source.folder, source.arch.vocab_size, source.arch.eos_token_id)
    return LoadedModel(source.name, source.arch, model, tokenizer)


def _build(
    arch: ModelArch, max_positions: int, device: torch.device, dtype: torch.dtype
) -> LlamaModel:
    with torch.device(device):
        model = LlamaModel(arch, max_positions)
    model.to(dtype)
    model.rope.to(torch.float32)  # keep the cos/sin tables in fp32, cast per use
    return model.eval()


def _hf_names(arch: ModelArch) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensor names concatenated (along dim 0) into it."""
    names: dict[str, list[str]] = {
        "embed_tokens.weight": ["model.embed_tokens.weight"],
        "norm.weight": ["model.norm.weight"],
    }
    if not arch.tie_word_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    for i in range(arch.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = [f"{hf}self_attn.{p}_proj" for p in "qkv"]
        names[ours + "self_attn.qkv_proj.weight"] = [a + ".weight" for a in attn]
        if arch.attention_bias:
            names[ours + "self_attn.qkv_proj.bias"] = [a + ".bias" for a in attn]
        names[ours + "self_attn.o_proj.weight"] = [hf + "self_attn.o_proj.weight"]
        if arch.attention_bias:
            names[ours + "self_attn.o_proj.bias"] = [hf + "self_attn.o_proj.bias"]
        names[ours + "mlp.gate_up_proj.weight"] = [
            hf + "mlp.gate_proj.weight",
            hf + "mlp.up_proj.weight",
        ]
        names[ours + "mlp.down_proj.weight"] = [hf + "mlp.down_proj.weight"]
        names[ours + "input_layernorm.weight"] = [hf + "input_layernorm.weight"]
        names[ours + "post_attention_layernorm.weight"] = [hf + "post_attention_layernorm.weight"]
    return names


@torch.no_grad()
def load_safetensors(model: LlamaModel, folder: Path) -> None:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(folder)!r} has no *.safetensors weights")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                where[key] = f
    params = dict(model.named_parameters())
    for ours, theirs in _hf_names(model.arch).items():
        missing = [t for t in theirs if t not in where]
        if missing:
            raise ValueError(f"weights for {missing[0]!r} not found in {str(folder)!r}")
        parts = []
        for t in theirs:
            with safe_open(str(where[t]), framework="pt") as sf:
                parts.append(sf.get_tensor(t))
        tensor = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        p = params[ours]
        if tensor.shape != p.shape:
            raise ValueError(f"{theirs} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
        p.copy_(tensor.to(p.dtype))


@torch.no_grad()
def save_hf_folder(model: LlamaModel, folder: str | os.PathLike[str]) -> Path:
    """Write a Hugging Face Llama folder (config.json + model.safetensors) from our model, so
    `transformers` can load the very same weights (the tests' reference)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    arch = model.arch
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.rms_norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings,
        attention_bias=arch.attention_bias,
        bos_token_id=arch.bos_token_id,
        eos_token_id=arch.eos_token_id,
        rope_theta=arch.rope_theta,
        rope_scaling=arch.rope_scaling,
    )
    cfg.save_pretrained(out)
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for ours, theirs in _hf_names(arch).items():
        p = params[ours].detach().to("cpu")
        sizes = [p.shape[0] // len(theirs)] * len(theirs)
        if ours.endswith("qkv_proj.weight") or ours.endswith("qkv_proj.bias"):
            q = arch.num_attention_heads * arch.head_dim
            kv = arch.num_key_value_heads * arch.head_dim
            sizes = [q, kv, kv]
        for name, part in zip(theirs, p.split(sizes, dim=0), strict=True):
            tensors[name] = part.contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if arch.vocab_size >= ByteTokenizer.vocab_size:
        (out / BYTE_TOKENIZER_MARKER).write_text(json.dumps({"type": "byte"}))
    return out
