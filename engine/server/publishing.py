"""Wiring a publisher into the engine server: hello fields, listener, metrics, control relay.

The server calls :func:`start_server_publisher` once its engine client is up and
``Publisher.close`` at shutdown; everything else about telemetry stays in this package.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from engine.process.interface import ServedEngine
from engine.telemetry.buffer import BufferLimits
from engine.telemetry.publisher import ApplyControl, Publisher
from wire.control import ControlRefused, check_changes
from wire.events import ClockAnchor


def engine_hello(
    client: ServedEngine, model_name: str, anchor: ClockAnchor, metrics_url: str | None = None
) -> dict[str, Any]:
    """The engine's fields of the ``hello``, read afresh at each connect (budget, policy);
    ``metrics_url``: the server's Prometheus ``/metrics``, when it serves one."""
    stats = client.stats()
    config = client.config
    extra = {"metrics_url": metrics_url} if metrics_url else {}
    return {
        **extra,
        "model": model_name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "core_pid": client.pid,
        "engine_mode": client.mode,
        "policy": client.policy,
        "token_budget": client.token_budget,
        "long_prefill_token_threshold": getattr(client, "long_prefill_token_threshold", 0),
        "max_token_budget": client.max_token_budget,
        "kv_blocks_total": stats.kv_blocks_total,
        "block_size": config.block_size,
        # with the max_model_len in force (the config's None means the model's own, up to 32k)
        "config": {**config.to_dict(), "max_model_len": int(client.max_model_len)},
        "clock": anchor.to_dict(),
    }


def control_applier(client: ServedEngine) -> ApplyControl:
    """Relayed controls go through the one implementation ``PUT /v1/scheduler`` uses."""

    async def apply(changes: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        from engine.server.control import apply_scheduler_update

        # refused here: no engine event, the publisher records it
        check_changes(changes, int(client.max_token_budget))
        try:
            change = await apply_scheduler_update(
                client, changes, source="collector", request_id=request_id
            )
        except ControlRefused as exc:  # refused by the engine, which emitted its control events
            raise ControlRefused(str(exc), exc.param, recorded=True) from exc
        return {"applied_at_step": change.applied_at_step, "old": change.old, "new": change.new}

    return apply


def start_server_publisher(
    client: ServedEngine,
    url: str,
    *,
    engine_id: str,
    model_name: str,
    token: str | None = None,
    control_token: str | None = None,
    spill_dir: str | Path | None = None,
    registry: Any = None,
    metrics_url: str | None = None,
    **publisher_kw: Any,
) -> Publisher:
    """Start publishing ``client``'s events to the collector at ``url`` (``ws://host:port``,
    ``/ingest`` appended when there is no path): listener, ``/metrics`` counters (when
    ``registry`` is given) and the control relay. Raises ValueError for a bad URL."""
    anchor = client.clock_anchor  # the core's, as its token times use
    if anchor is None:
        # Same host, same CLOCK_MONOTONIC (Linux): an anchor read here maps the core's times.
        anchor = ClockAnchor.now()
    publisher_kw.setdefault("limits", BufferLimits(spill_dir=spill_dir))
    publisher = Publisher(
        url,
        engine_id=engine_id,
        hello=lambda: engine_hello(client, model_name, anchor, metrics_url),
        token=token,
        apply_control=control_applier(client),
        control_token=control_token,
        **publisher_kw,
    )
    if registry is not None:
        from engine.telemetry.metrics import register_metrics

        register_metrics(publisher, registry, model_name=model_name, engine_id=engine_id)
    client.add_listener(publisher.publish)
    return publisher.start()


def start_for_state(
    state: Any, *, token: str | None = None, spill_dir: str | Path | None = None
) -> Publisher | None:
    """The server's publisher (None without a collector URL): the app's lifespan starts it
    once the engine is up and closes it after the engine core stopped."""
    if not state.collector_url:
        return None
    return start_server_publisher(
        state.client,
        state.collector_url,
        engine_id=state.engine_id,
        model_name=state.model_name,
        token=token,
        control_token=state.control_token,
        spill_dir=spill_dir,
        registry=state.metrics.registry,
        metrics_url=state.metrics_url,
    )
