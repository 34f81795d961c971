"""The GPU script's dry run: ``benchmarks/gpu_check.py --device cpu`` runs every part of the script
with tiny stand-in shapes, so the one bounded run on a GPU machine does not fail on a bug a CPU
could have found. No timing is asserted; the step counts and the exactness verdicts are exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "benchmarks.gpu_check"]  # run from the repo root


def _dry_run(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run(
        [sys.executable, *SCRIPT, "--device", "cpu", "--out-dir", str(tmp_path), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    path = tmp_path / "gpu_check_dry_run.json"
    assert path.exists(), proc.stdout + proc.stderr
    return proc.returncode, json.loads(path.read_text()), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str]:
    return _dry_run(tmp_path_factory.mktemp("gpu"), "--backends", "sdpa,flex")


def test_every_part_runs_and_records_provenance(dry_run: tuple[int, dict[str, Any], str]) -> None:
    rc, doc, log = dry_run
    assert rc == 0, log
    assert doc["complete"] is True
    assert doc["provenance"]["script"] == "gpu_check.py"
    assert doc["config"]["device"] == "cpu"
    for backend in ("sdpa", "flex"):
        for part in ("exact", "throughput", "story"):
            key = f"{part}_{backend}"
            assert key in doc and "error" not in doc[key], (key, doc.get(key))
    comparison = doc["comparison"]
    assert set(comparison["per_backend"]) == {"sdpa", "flex"}
    assert comparison["decode_step_over_sdpa"]["sdpa"] == 1.0
    assert comparison["faster_decode"] in ("sdpa", "flex")
    assert doc["roofline"]["bf16_gemm_tflops"] > 0 and doc["roofline"]["copy_bandwidth_gbs"] > 0


def test_exactness_compares_chunked_with_one_shot(dry_run: tuple[int, dict[str, Any], str]) -> None:
    _, doc, _ = dry_run
    shapes = doc["shapes"]
    for backend in ("sdpa", "flex"):
        part = doc[f"exact_{backend}"]
        assert part["one_shot_prefill_steps"] == 1
        assert part["bf16_noise_max_abs"] > 0  # bf16 against fp32 moves the logits
        assert [r["budget"] for r in part["chunked"]] == shapes["exact_budgets"]
        for row in part["chunked"]:
            assert row["prefill_steps"] == -(-shapes["exact_prompt"] // row["budget"])
            assert row["ok"] and row["tokens_equal"], row
        assert part["ok"] is True


def test_throughput_counts_flops_and_bytes(dry_run: tuple[int, dict[str, Any], str]) -> None:
    _, doc, _ = dry_run
    shapes = doc["shapes"]
    part = doc["throughput_sdpa"]
    n = shapes["prefill_tokens"]
    for row, chunk in zip(part["prefill"], shapes["prefill_chunks"], strict=True):
        assert row["chunk"] == chunk and row["steps"] == -(-n // chunk)
        f = row["flops"]
        assert f["total"] == pytest.approx(f["linear"] + f["attention"] + f["lm_head"])
        assert 0 < row["mfu_linear_only"] < row["mfu"]
    dec = part["decode"]
    assert dec["streams"] == shapes["decode_streams"] and dec["steps_measured"] > 0
    assert dec["bytes_per_step"]["kv"] > 0 and dec["fraction_of_copy_bandwidth"] > 0


def test_story_chunks_the_long_prompt(dry_run: tuple[int, dict[str, Any], str]) -> None:
    _, doc, _ = dry_run
    shapes = doc["shapes"]
    story = doc["story_flex"]
    assert story["backend"] == "flex"
    by = {(c["budget"], c["prompt_tokens"]): c for c in story["cases"]}
    big, small = max(shapes["story_budgets"]), min(shapes["story_budgets"])
    one_shot = by[(big, shapes["story_prompt"])]
    chunked = by[(small, shapes["story_prompt"])]
    assert one_shot["prefill_steps"] == 1  # the whole prompt and every decode in one step
    streams = shapes["story_streams"]
    assert chunked["prefill_steps"] >= -(-shapes["story_prompt"] // (small - streams))
    assert (big, shapes["seeds_prompt"]) in by
    for c in story["cases"]:
        assert len(c["step_ms"]) == c["prefill_steps"] and c["spike_ratio"] > 0


def test_a_failing_part_loses_nothing_else(tmp_path: Path) -> None:
    rc, doc, log = _dry_run(tmp_path, "--backends", "sdpa,nope", "--skip", "throughput,story")
    assert rc == 1, log
    assert doc["complete"] is False
    assert "error" in doc["exact_nope"]
    assert doc["exact_sdpa"]["ok"] is True


def test_no_cuda_no_run(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run(
        [sys.executable, *SCRIPT, "--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    assert not list(tmp_path.iterdir())
