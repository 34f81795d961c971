"""Trace parsing: Azure CSV and Mooncake JSONL, time scale, clipping, shared hash blocks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from loadgen.tokens import TokenSource
from loadgen.traces import detect_format, load_trace, trace_specs

# A verbatim excerpt carried with the tests (licence note in data/README.md), so the real-trace
# tests run from any clone; with CHUNKSCOPE_AZURE_TRACE naming the full trace, one more test checks
# that the excerpt is its head.
AZURE_EXCERPT = Path(__file__).resolve().parent / "data" / "AzureLLMInferenceTrace_conv_head300.csv"
AZURE_FULL = Path(os.environ.get("CHUNKSCOPE_AZURE_TRACE", "/nonexistent/azure.csv"))


def _azure(tmp_path: Path) -> Path:
    p = tmp_path / "azure.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "garbage,row\n"
        "2023-11-16 18:15:47.1805900,9000,0\n"
        "2023-11-16 18:15:48.6805900,20000,500\n"
    )
    return p


def test_azure_csv(tmp_path: Path) -> None:
    p = _azure(tmp_path)
    assert detect_format(p) == "azure"
    tr = load_trace(p, time_scale=0.5)
    assert tr.fmt == "azure" and tr.skipped == 2 and len(tr.rows) == 3
    assert [r.offset_s for r in tr.rows] == pytest.approx([0.0, 1.0, 2.1572895], abs=1e-5)
    specs = trace_specs(tr, ctx=8192)
    assert [s.max_tokens for s in specs] == [44, 500, 109]
    assert specs[1].prompt_len == 8192 - 500  # clipped to the context
    assert all(s.traffic_class == "trace" for s in specs)
    assert len(trace_specs(tr, ctx=8192, duration=1.5)) == 2
    assert len(trace_specs(tr, ctx=8192, num_requests=1)) == 1


def test_mooncake_jsonl_shared_prefixes(tmp_path: Path) -> None:
    p = tmp_path / "mc.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 700, "output_length": 5, "hash_ids": [1, 4]},
        {"timestamp": 250, "input_length": 0, "output_length": 5, "hash_ids": []},
        {"timestamp": 1000, "input_length": 600, "output_length": 7},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n\n")
    assert detect_format(p) == "mooncake"
    tr = load_trace(p, time_scale=2.0)
    assert tr.skipped == 2 and len(tr.rows) == 3
    assert [r.offset_s for r in tr.rows] == pytest.approx([0.0, 1.0, 2.0])
    specs = trace_specs(tr, ctx=4096, block_size=512)
    assert [s.prompt_len for s in specs] == [1100, 700, 600]
    src = TokenSource(seed=5)
    a, b, c = (src.tokens(s.segments) for s in specs)
    assert a[:512] == b[:512]  # hash id 1 shared
    assert a[512:700] != b[512:700]  # hash 2 vs hash 4
    assert len(a) == 1100 and a[1024:] == src.sequence("mc/3", 76).tolist()
    assert c[:512] != a[:512]


def test_unknown_format(tmp_path: Path) -> None:
    p = tmp_path / "x.txt"
    p.write_text("hello\n")
    with pytest.raises(ValueError):
        load_trace(p)


def test_real_azure_trace_head() -> None:
    tr = load_trace(AZURE_EXCERPT)
    assert tr.fmt == "azure" and len(tr.rows) == 300 and tr.skipped == 0
    assert tr.rows[0].input_len == 374 and tr.rows[0].output_len == 44
    assert tr.rows[-1].input_len == 212 and tr.rows[-1].output_len == 183
    assert tr.rows[0].offset_s == 0.0
    assert tr.rows[-1].offset_s == pytest.approx(84.029102, abs=1e-5)  # 18:15:46.68 -> 18:17:10.71
    gaps = [b.offset_s - a.offset_s for a, b in zip(tr.rows, tr.rows[1:], strict=False)]
    assert min(gaps) >= 0
    assert len(load_trace(AZURE_EXCERPT, limit=40).rows) == 40
    specs = trace_specs(tr, ctx=4096)
    assert len(specs) == 300 and all(s.prompt_len + s.max_tokens <= 4096 for s in specs)


def test_excerpt_is_the_head_of_the_shared_trace() -> None:
    """Provenance of the excerpt, checked where the full copy lies beside the checkout."""
    if not AZURE_FULL.exists():
        pytest.skip("CHUNKSCOPE_AZURE_TRACE names no file: the excerpt tests ran")
    excerpt = AZURE_EXCERPT.read_text().splitlines()
    with AZURE_FULL.open() as f:
        head = [next(f).rstrip("\n") for _ in range(len(excerpt))]
    assert head == excerpt
