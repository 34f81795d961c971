"""The store's tables, through SQLAlchemy Core. The Alembic revisions in ``storage/migrations``
create exactly these (``tests/storage/test_schema.py`` checks both against each other).

Layout, chosen for ingest speed and for the dashboard's window queries:

- ``runs`` has one row per (engine_id, run_id) with an integer ``id``; the event tables are keyed
  by (``run_key`` = ``runs.id``, ``seq``), which names (engine_id, run_id, seq) in a few bytes.
- ``steps`` has one row per step event. Its chunk layout is packed into ``chunks`` (13 bytes per
  chunk: request number, start, tokens, flags) and the tokens the step produced into ``tokens``
  (16 bytes per token: request number, k, inter-token latency in ns), both unpacked by
  ``storage.queries`` for the selected window only (``storage.packing``). Token k of a request is
  stamped at ingest with the ``end_ns`` of its step, so ITL is a read, never a replay.
- ``requests`` has one row per request (``req_no`` is its number inside the run, the key the
  packed columns use), updated in place by its request events and by the tokens stamped.
- ``request_events``, ``controls`` and ``gaps`` keep those events as rows.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData()

engines = Table(
    "engines",
    metadata,
    Column("engine_id", Text, primary_key=True),
    Column("host", Text),
    Column("model", Text),
    Column("first_seen", Float, nullable=False),  # wall seconds (collector clock)
    Column("last_seen", Float, nullable=False),
)

runs = Table(
    "runs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("engine_id", Text, nullable=False),
    Column("run_id", Text, nullable=False),
    Column("model", Text),
    Column("host", Text),
    Column("pid", Integer),
    Column("policy", Text),
    Column("token_budget", Integer),
    Column("max_token_budget", Integer),
    Column("kv_blocks_total", Integer),
    Column("block_size", Integer),
    Column("config", Text),  # the hello's "config" as JSON text
    Column("hello", Text),  # the whole first hello (token removed) as JSON text
    Column("clock_wall_ns", BigInteger, nullable=False),
    Column("clock_mono_ns", BigInteger, nullable=False),
    Column("started", Float, nullable=False),  # wall seconds of the first hello
    Column("ended", Float),  # wall seconds of the goodbye
    Column("ended_without_goodbye", Boolean, nullable=False, default=False),
    Column("connected", Boolean, nullable=False, default=False),
    Column("last_seen", Float),
    Column("last_seq", BigInteger, nullable=False, default=0),  # highest durable seq
    Column("last_step", BigInteger),
    Column("last_step_end_ns", BigInteger),
    Column("num_steps", BigInteger, nullable=False, default=0),
    Column("num_events", BigInteger, nullable=False, default=0),
    Column("num_gap_events", Integer, nullable=False, default=0),
    Column("next_req_no", Integer, nullable=False, default=0),
    # SHA-256 (hex) of the run_secret of the run's first hello; NULL: an engine without one.
    Column("secret_sha256", Text),
    UniqueConstraint("engine_id", "run_id", name="uq_runs_engine_run"),
)

steps = Table(
    "steps",
    metadata,
    Column("run_key", Integer, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("start_ns", BigInteger, nullable=False),
    Column("end_ns", BigInteger, nullable=False),
    Column("forward_ns", BigInteger),
    Column("token_budget", Integer),
    Column("policy", Text),
    Column("num_decode_tokens", Integer),
    Column("num_prefill_tokens", Integer),
    Column("num_scheduled_tokens", Integer),
    Column("num_running", Integer),
    Column("num_waiting", Integer),
    Column("kv_blocks_used", Integer),
    Column("kv_blocks_total", Integer),
    Column("num_preemptions", Integer),
    Column("num_chunks", Integer, nullable=False),
    Column("num_tokens_out", Integer, nullable=False),
    Column("chunks", LargeBinary, nullable=False),
    Column("tokens", LargeBinary, nullable=False),
    # revision 0002: the long-prefill cap in force (NULL: stored before the cap existed)
    Column("long_prefill_token_threshold", Integer),
    PrimaryKeyConstraint("run_key", "seq", name="pk_steps"),
    Index("ix_steps_run_step", "run_key", "step"),
    Index("ix_steps_run_start", "run_key", "start_ns"),
)

requests = Table(
    "requests",
    metadata,
    Column("run_key", Integer, nullable=False),
    Column("req_no", Integer, nullable=False),
    Column("request_id", Text, nullable=False),
    Column("traffic_class", Text),
    Column("num_prompt_tokens", Integer, nullable=False, default=0),
    Column("num_image_tokens", Integer, nullable=False, default=0),
    Column("num_cached_tokens", Integer, nullable=False, default=0),
    Column("num_output_tokens", Integer, nullable=False, default=0),
    Column("num_preemptions", Integer, nullable=False, default=0),
    Column("arrival_ns", BigInteger),
    Column("first_scheduled_ns", BigInteger),
    Column("finished_ns", BigInteger),
    Column("finish_reason", Text),
    # stamped from the steps: token k is the end_ns of the k-th step that produced one
    Column("num_tokens", Integer, nullable=False, default=0),
    Column("first_token_ns", BigInteger),
    Column("last_token_ns", BigInteger),
    Column("first_token_step", BigInteger),
    Column("last_token_step", BigInteger),
    Column("max_itl_ns", BigInteger),
    PrimaryKeyConstraint("run_key", "req_no", name="pk_requests"),
    UniqueConstraint("run_key", "request_id", name="uq_requests_run_request"),
    Index("ix_requests_run_arrival", "run_key", "arrival_ns"),
)

request_events = Table(
    "request_events",
    metadata,
    Column("run_key", Integer, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("request_id", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("time_ns", BigInteger),
    Column("step", BigInteger),
    Column("traffic_class", Text),
    Column("num_output_tokens", Integer),
    Column("finish_reason", Text),
    PrimaryKeyConstraint("run_key", "seq", name="pk_request_events"),
    Index("ix_request_events_run_request", "run_key", "request_id"),
)

controls = Table(
    "controls",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("engine_id", Text, nullable=False),
    Column("run_id", Text),  # None for a refusal naming an engine the collector never saw
    Column("seq", BigInteger),  # the engine's seq; None for refusals stored by the collector
    Column("time_ns", BigInteger),  # engine monotonic ns; None for collector refusals
    Column("wall", Float, nullable=False),  # wall seconds (through the run's clock anchor)
    Column("key", Text),
    Column("old_value", Text),  # JSON text
    Column("new_value", Text),  # JSON text
    Column("accepted", Boolean, nullable=False),
    Column("source", Text),
    Column("applied_at_step", BigInteger),
    Column("reason", Text),
    Column("request_id", Text),  # the control message's id when it came through the relay
    UniqueConstraint("engine_id", "run_id", "seq", name="uq_controls_engine_run_seq"),
    Index("ix_controls_engine_wall", "engine_id", "wall"),
)

gaps = Table(
    "gaps",
    metadata,
    Column("run_key", Integer, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("first_seq_lost", BigInteger),
    Column("last_seq_lost", BigInteger),
    Column("num_events_lost", BigInteger),
    Column("reason", Text),
    Column("time_ns", BigInteger),
    Column("wall", Float, nullable=False),
    PrimaryKeyConstraint("run_key", "seq", name="pk_gaps"),
)

# ---- the fleet: several collectors on one PostgreSQL store (storage.fleet) --------------------

fleet_collectors = Table(
    "fleet_collectors",
    metadata,
    Column("collector_id", Text, primary_key=True),
    Column("url", Text, nullable=False),  # ws://host:port, as engines and clients reach it
    Column("host", Text),
    Column("pid", Integer),
    Column("started", Float, nullable=False),  # wall seconds
    Column("heartbeat", Float, nullable=False),
)

# one row per engine id: the collector that holds (or last held) its connection
fleet_engines = Table(
    "fleet_engines",
    metadata,
    Column("engine_id", Text, primary_key=True),
    Column("run_id", Text, nullable=False),
    Column("collector_id", Text, nullable=False),
    Column("connected", Boolean, nullable=False),
    Column("info", Text, nullable=False),  # JSON: the collector's engine row (list_engines)
    Column("metrics_url", Text),  # the engine's Prometheus /metrics, from its hello
    Column("updated", Float, nullable=False),
)

# a control handed to the collector that holds the engine's connection, and its answer
fleet_controls = Table(
    "fleet_controls",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("collector_id", Text, nullable=False),
    Column("engine_id", Text, nullable=False),
    Column("message", Text, nullable=False),  # JSON
    Column("created", Float, nullable=False),
    Column("claimed", Float),
    Column("answer", Text),  # JSON: the control_ack
    Column("answered", Float),
    Index("ix_fleet_controls_collector", "collector_id", "claimed"),
)
