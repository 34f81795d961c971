"""Helpers for the vLLM bridge tests: a tiny local Llama folder vLLM can load, the vLLM venv,
and a vLLM server started with the bridge (``python -m vllm.entrypoints.openai.api_server``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
VENV_ENV = "CHUNKSCOPE_VLLM_VENV"
SCHEDULER_CLS = "chunkscope.integrations.vllm.ChunkscopeScheduler"
WORDS = "the quick brown fox jumps over the lazy dog while a small cat sleeps on a warm mat"


def vllm_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or Path.home() / ".cache/chunkscope/vllm-venv")


def vllm_python() -> Path | None:
    """The vLLM venv's python when ``scripts/setup_vllm.sh`` completed there, else None."""
    venv = vllm_venv()
    py = venv / "bin" / "python"
    if py.exists() and (venv / "chunkscope-vllm.stamp").exists():
        return py
    return None


def build_llama_folder(
    folder: Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    max_positions: int = 2048,
    intermediate_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> Path:
    """A 2-layer Llama (head_dim 64: vLLM's CPU attention needs one of its sizes) with seeded
    random weights, saved as config.json + model.safetensors, and a word-level BPE
    ``tokenizer.json`` (with its tokenizer_config.json) that vLLM's tokenizer loader reads.
    By default the MLP is twice the hidden size, with one query head per 64 and one KV head
    per 128 of it."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    from engine.model.arch import PRESETS
    from engine.model.llama import LlamaModel
    from engine.model.loader import BYTE_TOKENIZER_MARKER, save_hf_folder

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<unk>", "<s>", "</s>"]
    )
    tok.train_from_iterator([WORDS] * 20, trainer)
    arch = PRESETS["tiny"].with_(
        vocab_size=256,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads or hidden_size // 64,
        num_key_value_heads=num_kv_heads or max(1, hidden_size // 128),
        head_dim=64,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaModel(arch, max_positions=max_positions)
    model.init_synthetic(7)
    out = save_hf_folder(model, folder)
    (out / BYTE_TOKENIZER_MARKER).unlink(missing_ok=True)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out)
    return out


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on a free port, with the bridge class;
    ``env`` adds to the environment (the collector URL, fault file...); ``bridge=False`` runs
    vLLM's own scheduler (the overhead benchmark's other arm)."""

    def __init__(
        self, python: Path, model: Path, *args: str, env: dict[str, str] | None = None,
        log: Path | None = None, timeout: float = 400.0, bridge: bool = True,
        max_model_len: int = 1024,
    ) -> None:  # fmt: skip
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        full_env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", **(env or {})}
        full_env["PYTHONPATH"] = str(ROOT)  # this checkout, whichever one the venv has
        self.log_path = log
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--served-model-name", "tiny-llama", "--host", "127.0.0.1",
             "--port", str(self.port), "--dtype", "float32",
             "--max-model-len", str(max_model_len), "--enforce-eager",
             *(["--scheduler-cls", SCHEDULER_CLS] if bridge else []), *args],
            cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("vLLM exited at start:\n" + "".join(self.lines[-40:]))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError("vLLM did not become healthy:\n" + "".join(self.lines[-40:]))

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.log_path is not None:
                with self.log_path.open("a") as f:
                    f.write(line)

    def log_text(self) -> str:
        return "".join(self.lines)

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.log_text()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def python_path_note() -> str:
    return sys.executable
