"""The client's delivery, measured from a loadgen result and added to predicted figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from advisor.client import ClientDelay, ClientDraw, client_delay, load_client_delay
from advisor.simulate import SimOutcome, SimResult, figures


def record(arrival: float, tokens: list[float], send: float, chunks: list[float]) -> dict:
    return {
        "ttft_s": chunks[0] - send,
        "itl_s": [b - a for a, b in zip(chunks, chunks[1:], strict=False)],
        "chunk_wall": chunks,
        "server": {"arrival_time": arrival, "token_times": tokens},
    }


DOC = {
    "requests": [
        # engine TTFT 50 ms, client 57 ms; gaps: engine 10, 10 -> client 12, 9
        record(100.0, [100.050, 100.060, 100.070], 99.999, [100.056, 100.068, 100.077]),
        # engine TTFT 20 ms, client 23 ms; one token
        record(200.0, [200.020], 199.999, [200.022]),
        {"ttft_s": None, "server": None},  # a failed request
        {"ttft_s": 0.1, "itl_s": [], "chunk_wall": [1.0]},  # not chunkscope: no server block
    ]
}


def test_client_delay_from_a_loadgen_result(tmp_path: Path) -> None:
    d = client_delay(DOC)
    assert (d.num_requests, d.num_gaps) == (2, 2)
    assert sorted({round(v, 6) for v in d.ttft_offsets_s}) == [0.003, 0.007]
    assert sorted({round(v, 6) for v in d.itl_deltas_s}) == [-0.001, 0.002]
    s = d.summary()
    assert 3.0 - 1e-6 <= s["ttft_offset_p50_ms"] <= 7.0 + 1e-6
    path = tmp_path / "run.json"
    path.write_text(json.dumps(DOC))
    assert load_client_delay(path) == d
    assert ClientDelay.from_dict(d.to_dict()) == d
    with pytest.raises(ValueError, match="chunkscope"):
        client_delay({"requests": [DOC["requests"][3]]})


def test_draws_add_the_delivery_to_engine_figures() -> None:
    delay = ClientDelay([0.005], [0.002, -0.050], 1, 2)
    draw = ClientDraw(delay, seed=0, gaps=True)
    assert draw.ttft(0.040) == pytest.approx(0.045)
    gaps = {round(draw.gap(0.010), 6) for _ in range(50)}
    assert gaps == {0.012, 0.0}  # never below zero
    assert ClientDraw(delay).gap(0.010) == 0.010  # gap deltas only on request
    ms = 1_000_000
    res = SimResult(64, [SimOutcome("a", "chat", 0, 8, 0, [40 * ms, 50 * ms, 60 * ms])], [], 3, 0,
                    60 * ms, 0)  # fmt: skip
    engine = figures(res, since_ns=0, until_ns=100 * ms)
    client = figures(
        res,
        since_ns=0,
        until_ns=100 * ms,
        client=ClientDraw(ClientDelay([0.005], [0.002], 1, 1), gaps=True),
    )
    assert engine["ttft_p50_ms"] == pytest.approx(40.0) and client["ttft_p50_ms"] == pytest.approx(
        45.0
    )
    assert client["itl_max_ms"] == pytest.approx(12.0) and engine["itl_max_ms"] == pytest.approx(
        10.0
    )
    assert client["output_tokens"] == engine["output_tokens"] == 3
