"""End to end against our engine (tiny preset): every profile runs, counts add up, and the client's
chunk times are consistent with the engine's own per-token times: in order, one chunk per token
or fewer, and no chunk before its token. How closely they agree is logged, not asserted (on the
2-core CI box the mean |client chunk time - engine token time| was ~1-3 ms, the max tens of ms
when the engine, its HTTP loop and the client share the cores); timing belongs in benchmarks."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from loadgen.cli import main

logger = logging.getLogger(__name__)

READY = re.compile(r"chunkscope engine listening on (http://127\.0\.0\.1:\d+)")
SMALL = [
    "--set",
    "chat.system_prompt_tokens=64",
    "--set",
    "chat.input_median=48",
    "--set",
    "chat.input_p90=128",
    "--set",
    "chat.input_max=256",
    "--set",
    "chat.output_median=12",
    "--set",
    "chat.output_p90=24",
    "--set",
    "chat.output_max=32",
    "--set",
    "rag.num_documents=3",
    "--set",
    "rag.doc_median=256",
    "--set",
    "rag.doc_p90=512",
    "--set",
    "rag.doc_min=64",
    "--set",
    "rag.doc_max=1024",
    "--set",
    "rag.output_median=12",
    "--set",
    "rag.output_p90=24",
    "--set",
    "rag.output_max=32",
    "--set",
    "vlm.resolutions=64x48,96x64",
    "--set",
    "vlm.resolution_weights=1,1",
    "--set",
    "vlm.output_median=12",
    "--set",
    "vlm.output_p90=24",
    "--set",
    "vlm.output_max=32",
]


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "--model",
            "tiny",
            "--port",
            "0",
            "--max-model-len",
            "32768",
        ],
        cwd=root,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    found: list[str] = []
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:  # keep draining stderr so the engine never blocks on a full pipe
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if not found and (m := READY.search(line)):
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(180) or not found:
            pytest.fail("engine did not start:\n" + "".join(lines[-30:]))
        yield found[0]
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _run(url: str, tmp_path: Path, profile: str, n: int, *extra: str) -> dict:
    out = tmp_path / f"{profile}.json"
    rc = main(
        [
            "--url",
            url,
            "--profile",
            profile,
            "--num-requests",
            str(n),
            "--rate",
            "6",
            "--seed",
            "5",
            "--out",
            str(out),
            "--no-progress",
            "--request-timeout",
            "60",
            "--drain-timeout",
            "60",
            *SMALL,
            *extra,
        ]
    )
    res = json.loads(out.read_text())
    assert rc == 0, res["summary"]["overall"]["error_kinds"]
    return res


def _agreement(res: dict) -> dict[str, float]:
    """Client chunk wall times vs the engine's token times (ms): TTFT, every chunk, every ITL."""
    ttft, chunk, itl, one_to_one = [], [], [], 0
    for r in res["requests"]:
        srv = r["server"]
        assert srv is not None, "engine did not return its chunkscope block"
        tt, cw = srv["token_times"], r["chunk_wall"]
        assert tt and cw and len(cw) <= len(tt) == r["output_tokens"]
        assert tt == sorted(tt) and cw == sorted(cw)
        ttft.append(cw[0] - tt[0])
        if len(tt) == len(cw):
            one_to_one += 1
            chunk += [a - b for a, b in zip(cw, tt, strict=True)]
            itl += [c - e for c, e in zip(r["itl_s"], np.diff(tt), strict=True)]
        else:  # several tokens in one chunk: the chunk arrives after its last token
            chunk.append(cw[-1] - tt[-1])
    ms = [np.abs(np.asarray(v or [0.0])) * 1000 for v in (ttft, chunk, itl)]
    return {
        "ttft_mean_ms": float(ms[0].mean()),
        "mean_ms": float(ms[1].mean()),
        "p50_ms": float(np.median(ms[1])),
        "max_ms": float(ms[1].max()),
        "itl_mean_ms": float(ms[2].mean()),
        "min_signed_ms": float(np.min(chunk) * 1000),
        "one_to_one": one_to_one / len(res["requests"]),
    }


@pytest.mark.parametrize(("profile", "n"), [("chat", 16), ("rag", 12), ("vlm", 10), ("mixed", 20)])
def test_profiles_against_engine(engine_url: str, tmp_path: Path, profile: str, n: int) -> None:
    t = time.perf_counter()
    res = _run(engine_url, tmp_path, profile, n, "--set", "vlm.max_images=1")
    summary = res["summary"]
    own = [r for r in res["requests"] if "user" not in r["meta"]]
    assert len(own) == n  # the chat users run beside the profile's own requests
    assert summary["overall"]["ok"] == summary["overall"]["requests"] == len(res["requests"])
    assert res["config"]["prompt_format_used"] == "ids"
    assert res["server"]["max_model_len"] == 32768
    for r in res["requests"]:
        assert r["output_tokens"] == r["max_tokens"]  # ignore_eos: the profile's lengths
        if r["endpoint"] == "/v1/completions":
            assert r["prompt_tokens"] == r["planned_prompt_tokens"]
    ag = _agreement(res)
    logger.info(
        "%s: client vs engine token times: %s (%.1f s)", profile, ag, time.perf_counter() - t
    )
    # causal: a chunk cannot arrive before its token exists (5 ms: the two processes map their
    # monotonic clocks onto the wall clock independently)
    assert ag["min_signed_ms"] > -5.0, ag
    if profile == "mixed":
        assert set(summary["classes"]) == {"chat", "rag", "vlm"}


def test_multi_image_requests(engine_url: str, tmp_path: Path) -> None:
    res = _run(
        engine_url,
        tmp_path,
        "vlm",
        4,
        "--set",
        "vlm.single_image_fraction=0",
        "--set",
        "vlm.max_images=3",
        "--chat-users",
        "0",
    )
    assert res["summary"]["overall"]["ok"] == res["summary"]["overall"]["requests"] == 4


# verbatim excerpt of the Azure conversation trace (licence note in data/README.md)
AZURE = Path(__file__).resolve().parent / "data" / "AzureLLMInferenceTrace_conv_head300.csv"


def test_azure_trace_replay_against_engine(engine_url: str, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    rc = main(
        [
            "--url",
            engine_url,
            "--trace",
            str(AZURE),
            "--num-requests",
            "8",
            "--time-scale",
            "0.05",
            "--out",
            str(out),
            "--no-progress",
            "--request-timeout",
            "60",
            "--drain-timeout",
            "60",
        ]
    )
    res = json.loads(out.read_text())
    assert rc == 0 and res["summary"]["overall"]["ok"] == 8
    assert res["trace"]["format"] == "azure"
    for r in res["requests"]:
        assert r["traffic_class"] == "trace"
        assert r["prompt_tokens"] == r["meta"]["trace_input"]
        assert r["output_tokens"] == r["meta"]["trace_output"]
