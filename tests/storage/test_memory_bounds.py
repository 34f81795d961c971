"""The collector's memory is bounded in bytes: what waits for the writer never passes
``max_pending_bytes``; a frame past it is refused (close 1013, not acknowledged) and its engine
resends it later, so every seq is still stored exactly once."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from engine.telemetry import Publisher
from storage import queries
from storage.collector import CollectorConfig
from storage.db import connect
from storage.store import Events, Store
from testkit.collector import collector_in_thread
from testkit.engines import SyntheticEngine
from tests.storage.helpers import stored_seqs, wait_until

FRAME = 64 * 1024
BOUND = 4 * FRAME


def _refusals(collector: Any, reason: str) -> float:
    value = collector.metrics.registry.get_sample_value(
        "collector_refusals_total", {"reason": reason}
    )
    return value or 0.0


def test_frames_past_the_byte_bound_wait_in_the_engine_and_are_stored_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer is held (a store that has stopped answering) while an engine sends frames of
    large events: what waits for it stays under the bound, the frames past it are refused
    without an ack, and once the writer goes on the engine resends them: every seq stored once,
    no gap."""
    gate = threading.Event()
    gate.set()
    apply = Store.apply

    def held(self: Store, ops: list[Any]) -> list[Any]:
        if any(isinstance(op, Events) for op in ops):
            gate.wait(60)
        return apply(self, ops)

    monkeypatch.setattr(Store, "apply", held)
    caplog.set_level(logging.WARNING, logger="engine.telemetry.publisher")
    db_url = f"sqlite:///{tmp_path / 'bound.db'}"
    syn = SyntheticEngine(engine_id="eng-bytes", run_id="run-bytes-1", seed=21)
    fields = {k: v for k, v in syn.hello().items() if k not in ("engine_id", "run_id")}
    with collector_in_thread(db_url, max_frame_bytes=FRAME, max_pending_bytes=BOUND) as collector:
        pub = Publisher(
            collector.url, engine_id=syn.engine_id, run_id=syn.run_id, hello=lambda: fields,
            linger_s=0.01, backoff_initial_s=0.05, backoff_max_s=0.3, max_frame_bytes=FRAME,
        ).start()  # fmt: skip
        try:
            for ev in syn.steps(3):
                pub.publish({k: v for k, v in ev.items() if k != "seq"})
            assert pub.wait_acked(timeout=10)
            gate.clear()  # the writer stops at its next batch of events
            pad = "p" * 2000  # an unknown field: counted in the frame, ignored by the store
            for ev in syn.steps(60):
                pub.publish({**{k: v for k, v in ev.items() if k != "seq"}, "pad": pad})
            wait_until(lambda: _refusals(collector, "busy") >= 1, 20, "a refused frame")
            waiting = collector.metrics.registry.get_sample_value("collector_pending_bytes")
            assert 0 < waiting <= BOUND and collector._pending_bytes == waiting
            assert pub.stats().acked_seq < syn.seq  # the refused frames are not acknowledged
            wait_until(lambda: "collector is busy (close 1013" in caplog.text, 10, "the reason")
            gate.set()  # the store answers again
            assert pub.wait_acked(timeout=30), pub.stats()
            assert pub.stats().acked_seq == syn.seq
            pub.close(timeout=10)
        finally:
            gate.set()
            pub.close(timeout=1)
        assert collector._pending_bytes == 0 and not collector._op_bytes
    assert stored_seqs(db_url, "eng-bytes", "run-bytes-1") == list(range(1, syn.seq + 1))
    db = connect(db_url, readonly=True)
    assert queries.gaps(db, engine_id="eng-bytes").empty
    db.dispose()


def test_the_byte_bound_holds_a_whole_frame() -> None:
    with pytest.raises(ValueError, match="max_pending_bytes"):
        CollectorConfig(db_url="sqlite://", max_frame_bytes=FRAME, max_pending_bytes=FRAME - 1)
