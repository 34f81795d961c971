"""CLI: usage errors exit 2; a full run against a mock server writes a complete result JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.cli import main

from .conftest import MockServer

SMALL = [
    "--set",
    "chat.system_prompt_tokens=32",
    "--set",
    "chat.input_median=32",
    "--set",
    "chat.input_p90=64",
    "--set",
    "chat.output_median=8",
    "--set",
    "chat.output_p90=16",
    "--set",
    "rag.num_documents=3",
    "--set",
    "rag.doc_median=128",
    "--set",
    "rag.doc_p90=256",
    "--set",
    "rag.doc_min=16",
    "--set",
    "rag.output_median=8",
    "--set",
    "rag.output_p90=16",
    "--set",
    "vlm.resolutions=48x32,32x32",
    "--set",
    "vlm.resolution_weights=1,1",
    "--set",
    "vlm.output_median=8",
    "--set",
    "vlm.output_p90=16",
]


@pytest.mark.parametrize(
    "argv",
    [
        ["--profile", "nope"],
        ["--rate", "-1"],
        ["--rate", "abc"],
        ["--num-requests", "0"],
        ["--arrival", "weibull"],
        ["--burstiness", "0"],
        ["--set", "chat.unknown=3"],
        ["--set", "chat.input_median"],
        ["--set", "vlm.resolutions=12"],
        ["--token-id-range", "100,5"],
        ["--ramp-from", "2"],
        ["--trace", "/nonexistent/trace.csv"],
        ["--url", "localhost:8000"],
        ["--time-scale", "0"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_show_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--show-profiles", "--set", "chat.input_median=500"]) == 0
    prof = json.loads(capsys.readouterr().out)
    assert prof["chat"]["input_median"] == 500 and prof["mixed"]["chat_share"] == 0.6


def test_help_runs_as_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loadgen", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "--profile" in out and "--set CLASS.FIELD=VALUE" in out


def test_mixed_run_writes_result(
    mock_server: MockServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    rc = main(
        [
            "--url",
            mock_server.url,
            "--profile",
            "mixed",
            "--num-requests",
            "20",
            "--rate",
            "50",
            "--seed",
            "4",
            "--slo-ttft-ms",
            "1000",
            "--slo-itl-ms",
            "100",
            "--out",
            str(out),
            "--no-progress",
            *SMALL,
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "overall" in table and "TTFT" in table
    res = json.loads(out.read_text())
    assert res["config"]["profile"] == "mixed" and res["config"]["max_model_len_used"] == 4096
    assert res["config"]["prompt_format_used"] == "ids"
    assert len(res["requests"]) == 20 and res["summary"]["overall"]["ok"] == 20
    classes = {r["traffic_class"] for r in res["requests"]}
    assert classes <= {"chat", "rag", "vlm"} and "chat" in classes
    assert sum(c["requests"] for c in res["summary"]["classes"].values()) == 20
    good = res["summary"]["overall"]["goodput"]
    assert good["requests_meeting_slo"] == 20 and good["fraction_of_requests"] == 1.0
    r0 = res["requests"][0]
    for key in (
        "send_wall",
        "ttft_s",
        "itl_s",
        "chunk_wall",
        "e2e_s",
        "tpot_s",
        "queue_s",
        "prompt_tokens",
        "output_tokens",
        "upload_bytes",
        "server",
        "status",
        "error",
    ):
        assert key in r0
    sent = sorted(s["class"] for s in mock_server.seen if s["class"] != "probe")
    assert sent == sorted(r["traffic_class"] for r in res["requests"])


def test_trace_replay_via_cli(mock_server: MockServer, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 100 * i, "input_length": 40 + i, "output_length": 4, "hash_ids": [1, 2 + i]}
        for i in range(6)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "r.json"
    rc = main(
        [
            "--url",
            mock_server.url,
            "--trace",
            str(trace),
            "--time-scale",
            "0.5",
            "--trace-block-size",
            "16",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["status"] for r in res["requests"]] == ["ok"] * 6
    assert [r["scheduled_s"] for r in res["requests"]] == pytest.approx(
        [0.05 * i for i in range(6)]
    )
    prompts = [s["body"]["prompt"] for s in mock_server.seen if s["class"] == "trace"]
    assert len(prompts) == 6 and all(p[:16] == prompts[0][:16] for p in prompts)
    assert [len(p) for p in prompts] == [40 + i for i in range(6)]


def test_unreachable_server_is_reported_not_raised(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = main(
        [
            "--url",
            "http://127.0.0.1:9",
            "--num-requests",
            "3",
            "--rate",
            "100",
            "--out",
            str(out),
            "--no-progress",
            *SMALL,
        ]
    )
    assert rc == 1
    res = json.loads(out.read_text())
    assert res["summary"]["overall"]["error_kinds"] == {"connect error": 3}
    assert all(r["error"].startswith("connect error") for r in res["requests"])


def test_rag_run_brings_a_chat_background_and_says_so(
    mock_server: MockServer, tmp_path: Path
) -> None:
    out = tmp_path / "r.json"
    argv = ["--url", mock_server.url, "--profile", "rag", "--duration", "2", "--rate", "1"]
    argv += ["--chat-background", "10", "--seed", "3", "--out", str(out), "--no-progress", *SMALL]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["config"]["chat_background_rate"] == 10.0
    assert res["config"]["shapes_used"] == "realistic"  # the mock serves model "mock"
    by_class = {c: n["requests"] for c, n in res["summary"]["classes"].items()}
    assert by_class.get("rag", 0) > 0 and by_class.get("chat", 0) > by_class["rag"]
    assert all(r["meta"].get("background") for r in res["requests"] if r["traffic_class"] == "chat")
    assert res["warnings"] == []


def test_no_background_when_asked_for_none(mock_server: MockServer, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--url", mock_server.url, "--profile", "vlm", "--num-requests", "3", "--rate", "20"]
    argv += ["--chat-background", "0", "--out", str(out), "--no-progress", *SMALL]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["config"]["chat_background_rate"] == 0.0
    assert {r["traffic_class"] for r in res["requests"]} == {"vlm"}


def test_show_profiles_with_demo_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--shapes", "demo", "--show-profiles"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["rag"]["doc_max"] == 4000 and shown["chat"]["background_users"] == 4
    assert shown["mixed"]["vlm_share"] > 0
    # the user's --set goes on top of the shape set
    assert main(["--shapes", "demo", "--set", "rag.doc_max=3000", "--show-profiles"]) == 0
    assert json.loads(capsys.readouterr().out)["rag"]["doc_max"] == 3000
