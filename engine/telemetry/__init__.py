"""Engine-side telemetry: stream engine events to a collector over websockets (docs/telemetry.md).

``Publisher`` (torch-free) assigns each event its ``seq``, keeps it until the collector
acknowledges it (memory, then spill files, then a declared ``gap``), sends batched frames from a
background thread, reconnects with backoff and applies the controls the collector relays.
"""

from __future__ import annotations

from engine.telemetry.buffer import BufferLimits, EventBuffer, encode_event
from engine.telemetry.publisher import (
    Publisher,
    PublisherStats,
    collector_urls,
    new_run_id,
    normalize_collector_url,
)

__all__ = [
    "BufferLimits",
    "EventBuffer",
    "Publisher",
    "PublisherStats",
    "collector_urls",
    "encode_event",
    "new_run_id",
    "normalize_collector_url",
]
