"""Fixed DataFrames shaped like ``storage.queries`` results (for chart and window tests)."""

from __future__ import annotations

import pandas as pd

T0 = 1_764_577_800.0  # 2025-12-01 08:30:00 UTC

STEP_COLUMNS = [
    "engine_id", "run_id", "step", "start", "end", "start_ns", "end_ns", "duration_ms",
    "forward_ms", "token_budget", "policy", "num_decode_tokens", "num_prefill_tokens",
    "num_scheduled_tokens", "num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total",
    "num_preemptions", "num_chunks",
]  # fmt: skip
ITL_COLUMNS = ["engine_id", "run_id", "request_id", "traffic_class", "k", "time", "itl_ms", "step"]
CONTROL_COLUMNS = [
    "engine_id", "run_id", "time", "time_ns", "key", "old_value", "new_value", "accepted",
    "source", "applied_at_step", "applied_at", "reason", "request_id",
]  # fmt: skip
SUMMARY_COLUMNS = [
    "traffic_class", "num_requests", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
    "itl_p50_ms", "itl_p99_ms", "itl_p999_ms", "itl_max_ms", "num_gaps", "output_tokens",
    "tokens_per_s",
]  # fmt: skip
CHUNK_COLUMNS = [
    "engine_id", "run_id", "step", "idx", "request_id", "kind", "start", "num_tokens",
    "produced_token", "traffic_class",
]  # fmt: skip


def steps_frame(
    n: int = 10, *, t0: float = T0, prefill_every: int = 5, run: str = "r1"
) -> pd.DataFrame:
    rows = []
    t = t0
    for i in range(n):
        prefill = 1000 if prefill_every and i % prefill_every == 0 else 0
        dur = 0.5 if prefill else 0.01
        rows.append(
            {
                "engine_id": "e1", "run_id": run, "step": i, "start": t, "end": t + dur,
                "start_ns": int(i * 1e9), "end_ns": int(i * 1e9 + dur * 1e9),
                "duration_ms": dur * 1000, "forward_ms": dur * 900, "token_budget": 2048,
                "policy": "chunked", "num_decode_tokens": 4, "num_prefill_tokens": prefill,
                "num_scheduled_tokens": 4 + prefill, "num_running": 5, "num_waiting": i % 3,
                "kv_blocks_used": 10 + i, "kv_blocks_total": 100, "num_preemptions": 0,
                "num_chunks": 5 if prefill else 4,
            }
        )  # fmt: skip
        t += dur
    return pd.DataFrame(rows, columns=STEP_COLUMNS)


def itl_frame(
    values: list[float], *, t0: float = T0, classes: list[str | None] | None = None
) -> pd.DataFrame:
    classes = classes or ["chat"] * len(values)
    rows = [
        {
            "engine_id": "e1",
            "run_id": "r1",
            "request_id": f"req-{i % 3}",
            "traffic_class": classes[i],
            "k": 2 + i,
            "time": t0 + 0.1 * i,
            "itl_ms": v,
            "step": i,
        }  # fmt: skip
        for i, v in enumerate(values)
    ]
    return pd.DataFrame(rows, columns=ITL_COLUMNS)


def controls_frame(t0: float = T0) -> pd.DataFrame:
    rows = [
        {
            "engine_id": "e1", "run_id": "r1", "time": t0 + 1.0, "time_ns": 1,
            "key": "token_budget",
            "old_value": 2048, "new_value": 256, "accepted": True, "source": "collector",
            "applied_at_step": 7, "applied_at": t0 + 1.2, "reason": None, "request_id": "c1",
        },
        {
            "engine_id": "e1", "run_id": "r1", "time": t0 + 2.0, "time_ns": 2,
            "key": "token_budget",
            "old_value": 256, "new_value": 0, "accepted": False, "source": "collector",
            "applied_at_step": None, "applied_at": None,
            "reason": "token_budget must be from 1 to 8192, got 0", "request_id": "c2",
        },
        {
            "engine_id": "e1", "run_id": "r1", "time": t0 + 3.0, "time_ns": 3, "key": "policy",
            "old_value": "chunked", "new_value": "unchunked", "accepted": True, "source": "api",
            "applied_at_step": 9, "applied_at": t0 + 3.1, "reason": None, "request_id": None,
        },
    ]  # fmt: skip
    return pd.DataFrame(rows, columns=CONTROL_COLUMNS)


def summary_frame(scale: float = 1.0) -> pd.DataFrame:
    rows = []
    for cls in ("chat", "rag", "all"):
        rows.append(
            {
                "traffic_class": cls, "num_requests": 10, "ttft_p50_ms": 50 * scale,
                "ttft_p99_ms": 200 * scale, "tpot_p50_ms": 20 * scale, "tpot_p99_ms": 80 * scale,
                "itl_p50_ms": 15 * scale, "itl_p99_ms": 400 * scale, "itl_p999_ms": 900 * scale,
                "itl_max_ms": 1200 * scale, "num_gaps": 0, "output_tokens": 1000,
                "tokens_per_s": 100.0 / scale,
            }
        )  # fmt: skip
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def chunks_frame() -> pd.DataFrame:
    rows = []
    for step in (4, 5, 6):
        idx = 0
        for r in range(3):
            rows.append(
                {
                    "engine_id": "e1", "run_id": "r1", "step": step, "idx": idx,
                    "request_id": f"chat-{r}", "kind": "decode", "start": 100 + step,
                    "num_tokens": 1,
                    "produced_token": True, "traffic_class": "chat",
                }
            )  # fmt: skip
            idx += 1
        rows.append(
            {
                "engine_id": "e1", "run_id": "r1", "step": step, "idx": idx, "request_id": "rag-0",
                "kind": "prefill", "start": (step - 4) * 256, "num_tokens": 256,
                "produced_token": step == 6, "traffic_class": None,
            }
        )  # fmt: skip
    return pd.DataFrame(rows, columns=CHUNK_COLUMNS)
