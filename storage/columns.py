"""The columns of every frame ``storage.queries`` returns and ``chunkscope export`` writes: one
list per read, so the reads, the export and their tests name them once. No torch."""

from __future__ import annotations

import pandas as pd

ENGINES_COLUMNS = [
    "engine_id",
    "run_id",
    "model",
    "host",
    "pid",
    "started",
    "ended",
    "ended_without_goodbye",
    "connected",
    "last_step",
    "last_time",
    "token_budget",
    "max_token_budget",
    "policy",
    "num_steps",
    "num_gap_events",
    "config",
    "engine_kind",  # the hello's engine_kind ("vllm" for the bridge), None for chunkscope's own
]
STEPS_COLUMNS = [
    "engine_id",
    "run_id",
    "step",
    "start",
    "end",
    "start_ns",
    "end_ns",
    "duration_ms",
    "forward_ms",
    "token_budget",
    "policy",
    "num_decode_tokens",
    "num_prefill_tokens",
    "num_scheduled_tokens",
    "num_running",
    "num_waiting",
    "kv_blocks_used",
    "kv_blocks_total",
    "num_preemptions",
    "num_chunks",
    "long_prefill_token_threshold",
]
STEP_CHUNKS_COLUMNS = [
    "engine_id",
    "run_id",
    "step",
    "idx",
    "request_id",
    "kind",
    "start",
    "num_tokens",
    "produced_token",
    "traffic_class",
    "capped",
]
REQUESTS_COLUMNS = [
    "engine_id",
    "run_id",
    "request_id",
    "traffic_class",
    "num_prompt_tokens",
    "num_image_tokens",
    "num_cached_tokens",
    "num_output_tokens",
    "arrival",
    "first_scheduled",
    "first_token",
    "finished",
    "finish_reason",
    "ttft_ms",
    "tpot_ms",
    "max_itl_ms",
    "e2e_ms",
]
TOKEN_ITL_COLUMNS = [
    "engine_id",
    "run_id",
    "request_id",
    "traffic_class",
    "k",
    "time",
    "itl_ms",
    "step",
]
TOKEN_TIMES_COLUMNS = ["k", "time", "step", "time_ns"]
LATENCY_SUMMARY_COLUMNS = [
    "traffic_class",
    "num_requests",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_p999_ms",
    "itl_max_ms",
    "num_gaps",
    "output_tokens",
    "tokens_per_s",
]
CONTROLS_COLUMNS = [
    "engine_id",
    "run_id",
    "time",
    "time_ns",
    "key",
    "old_value",
    "new_value",
    "accepted",
    "source",
    "applied_at_step",
    "applied_at",
    "reason",
    "request_id",
]
GAPS_COLUMNS = [
    "engine_id",
    "run_id",
    "seq",
    "first_seq_lost",
    "last_seq_lost",
    "num_events_lost",
    "reason",
    "time",
]
# ``chunkscope export``'s tokens table: ``token_itl``'s columns with the gap last (its
# first tokens have none)
TOKENS_COLUMNS = [c for c in TOKEN_ITL_COLUMNS if c != "itl_ms"] + ["itl_ms"]


def empty(columns: list[str]) -> pd.DataFrame:
    """A frame with no rows that still has its columns."""
    return pd.DataFrame({c: pd.Series(dtype=object) for c in columns})
