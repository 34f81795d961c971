"""The publisher's buffer on its own: seqs, memory then spill files, acks, declared gaps."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from engine.telemetry.buffer import BufferLimits, EventBuffer, encode_event, event_dict
from wire.events import ChunkRecord, ControlEvent, RequestEvent, StepEvent


def _ev(i: int) -> dict[str, object]:
    return {"type": "request", "kind": "arrived", "request_id": f"r{i}", "time_ns": i}


def _drain(buf: EventBuffer, after: int = 0, n: int = 10_000) -> list[tuple[int, dict]]:
    out = []
    for seq, item in buf.take(after, n):
        d = json.loads(item) if isinstance(item, str) else json.loads(encode_event(seq, item))
        assert d["seq"] == seq
        out.append((seq, d))
    return out


def test_seqs_start_at_one_and_take_returns_them_in_order() -> None:
    buf = EventBuffer("run-a")
    assert [buf.publish(_ev(i)) for i in range(5)] == [1, 2, 3, 4, 5]
    got = _drain(buf)
    assert [s for s, _ in got] == [1, 2, 3, 4, 5]
    assert [d["request_id"] for _, d in got] == ["r0", "r1", "r2", "r3", "r4"]
    assert [s for s, _ in buf.take(3, 10)] == [4, 5]
    assert [s for s, _ in buf.take(0, 2)] == [1, 2]


def test_ack_releases_and_take_never_returns_acked_memory() -> None:
    buf = EventBuffer("run-a")
    for i in range(10):
        buf.publish(_ev(i))
    buf.ack(4)
    stats = buf.stats()
    assert (stats.acked_seq, stats.queued, stats.memory_events) == (4, 6, 6)
    assert [s for s, _ in buf.take(0, 100)] == [5, 6, 7, 8, 9, 10]
    buf.ack(100)  # beyond the last seq: clamped
    assert buf.acked_seq == 10 and buf.stats().queued == 0
    assert buf.publish(_ev(11)) == 11 and [s for s, _ in buf.take(10, 5)] == [11]


def test_encode_event_of_a_dataclass_event_carries_type_and_seq() -> None:
    ev = StepEvent(
        step=3, start_ns=10, end_ns=20, token_budget=8, policy="chunked",
        num_decode_tokens=1, num_prefill_tokens=4, num_scheduled_tokens=5, num_running=2,
        num_waiting=0, kv_blocks_used=3, kv_blocks_total=64, num_preemptions=0,
        chunks=[ChunkRecord("a", "prefill", 0, 4, False), ChunkRecord("b", "decode", 9, 1, True)],
    )  # fmt: skip
    d = json.loads(encode_event(7, ev))
    assert d["type"] == "step" and d["seq"] == 7 and d["chunks"][1]["produced_token"] is True
    with pytest.raises(ValueError, match="type"):
        encode_event(1, {"seq": 1})


def test_fast_event_dicts_equal_to_dict() -> None:
    step = StepEvent(
        step=1, start_ns=1, end_ns=2, token_budget=8, policy="unchunked", num_decode_tokens=0,
        num_prefill_tokens=8, num_scheduled_tokens=8, num_running=1, num_waiting=3,
        kv_blocks_used=1, kv_blocks_total=8, num_preemptions=1, forward_ns=1,
        chunks=[ChunkRecord("a", "prefill", 0, 8, True)],
    )  # fmt: skip
    events = [
        step,
        RequestEvent(kind="finished", request_id="a", time_ns=3, traffic_class="rag",
                     num_output_tokens=2, finish_reason="length", step=1),
        ControlEvent(key="policy", old_value="chunked", new_value="unchunked", accepted=True,
                     time_ns=0, applied_at_step=1, request_id="c1"),
    ]  # fmt: skip
    for ev in events:
        d = event_dict(ev)
        assert d == ev.to_dict() and d is not event_dict(ev)
        assert json.loads(json.dumps(d)) == json.loads(json.dumps(ev.to_dict()))
    assert event_dict(step)["chunks"][0] is not event_dict(step)["chunks"][0]
    odd_chunks = [ChunkRecord('q"uo\\te/ü', "prefill", 0, 3, False),
                  ChunkRecord("ok-1", "decode", 5, 1, True)]  # fmt: skip
    odd = StepEvent(**{**vars(step), "chunks": odd_chunks})
    for seq, ev in enumerate([*events, odd], start=1):  # the direct step encoder included
        assert json.loads(encode_event(seq, ev)) == {**ev.to_dict(), "seq": seq}
    raw = {"type": "gap", "x": 1}
    assert event_dict(raw) == raw and event_dict(raw) is not raw


def test_the_direct_encoders_are_in_use_and_equal_json_dumps(monkeypatch: Any) -> None:
    """Steps, request and control events are written without dicts; the text parses to exactly
    ``to_dict()`` + seq, chunks' ``capped`` included, and odd values take the json path."""
    from engine.telemetry import buffer

    assert buffer.DIRECT_STEP_ENCODER  # a field added to ChunkRecord must reach the encoder
    assert tuple(f.name for f in fields(ChunkRecord)) == buffer.DIRECT_CHUNK_FIELDS
    chunks = [ChunkRecord(f"cmpl-{i:04x}", "decode", 90 + i, 1, i % 2 == 0, i % 3 == 0)
              for i in range(12)]  # fmt: skip
    chunks.append(ChunkRecord("p-1", "prefill", 0, 48, False, True))
    step = StepEvent(
        step=9, start_ns=10**15, end_ns=10**15 + 7, token_budget=64, policy="chunked",
        num_decode_tokens=12, num_prefill_tokens=48, num_scheduled_tokens=60, num_running=13,
        num_waiting=2, kv_blocks_used=30, kv_blocks_total=99, num_preemptions=1, forward_ns=5,
        long_prefill_token_threshold=48, chunks=chunks,
    )  # fmt: skip
    odd_step = StepEvent(**{**vars(step), "policy": 'a "b" ü', "num_waiting": None,
                            "chunks": [ChunkRecord('q"\\', "decode", 1, 1, True, False),
                                       ChunkRecord("x", "weird", 1.5, 1, 1, False)]})  # fmt: skip
    events: list[Any] = [
        step,
        odd_step,
        RequestEvent(kind="finished", request_id="cmpl-1", time_ns=3, traffic_class="rag",
                     num_output_tokens=2, finish_reason="length", step=1),
        RequestEvent(kind="arrived", request_id="id with space\n\u00e9", time_ns=-1),
        ControlEvent(key="token_budget", old_value=512, new_value=256, accepted=True,
                     time_ns=0, applied_at_step=4, request_id="c1"),
        ControlEvent(key="policy", old_value={"a": [1, 2.5]}, new_value=True, accepted=False,
                     time_ns=0, reason='bad "value"', source="collector"),
    ]  # fmt: skip
    for seq, ev in enumerate(events, start=1):
        text = encode_event(seq, ev)
        assert json.loads(text) == {**ev.to_dict(), "seq": seq}, text
    # a plain step's head does not go through the generic field writer
    monkeypatch.setattr(buffer, "_flat_json", lambda *a: (_ for _ in ()).throw(AssertionError))
    assert json.loads(encode_event(1, step)) == {**step.to_dict(), "seq": 1}


def test_spill_files_hold_the_tail_and_are_deleted_once_acked(tmp_path: Path) -> None:
    limits = BufferLimits(max_memory_events=3, spill_dir=tmp_path, spill_segment_bytes=200)
    buf = EventBuffer("run-s", limits)
    for i in range(20):
        assert buf.publish(_ev(i)) == i + 1
    stats = buf.stats()
    assert (stats.memory_events, stats.spill_events, stats.spilled_total) == (3, 17, 17)
    files = sorted((tmp_path / "run-s").glob("*.jsonl"))
    assert len(files) > 1  # rotated segments
    lines = [json.loads(x) for f in files for x in f.read_text().splitlines()]
    assert [d["seq"] for d in lines] == list(range(4, 21))
    assert [s for s, _ in _drain(buf)] == list(range(1, 21))
    assert [s for s, _ in _drain(buf, after=9, n=4)] == [10, 11, 12, 13]
    buf.ack(12)
    left = sorted((tmp_path / "run-s").glob("*.jsonl"))
    assert len(left) < len(files)  # segments acknowledged past their end are gone
    assert [s for s, _ in _drain(buf, after=12)] == list(range(13, 21))
    # memory has room again: new events go to memory, after the spilled ones
    assert buf.publish(_ev(20)) == 21
    assert buf.stats().memory_events == 1
    assert [s for s, _ in _drain(buf, after=12)] == list(range(13, 22))
    buf.ack(21)
    assert list((tmp_path / "run-s").glob("*.jsonl")) == []
    assert buf.stats().queued == 0 and buf.stats().spill_bytes == 0


def test_an_ack_is_visible_only_once_its_spill_files_are_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``acked_seq`` is read without the buffer's lock (``Publisher.wait_acked``): a reader that
    sees a seq acknowledged must find its spill files deleted (CI once saw them still there)."""
    from engine.telemetry import buffer as buffer_mod

    limits = BufferLimits(max_memory_events=2, spill_dir=tmp_path, spill_segment_bytes=200)
    buf = EventBuffer("run-v", limits)
    for i in range(12):
        buf.publish(_ev(i))
    seen_during_delete: list[int] = []
    delete = buffer_mod._DiskSegment.delete

    def spy(segment: Any) -> None:
        seen_during_delete.append(buf.acked_seq)
        delete(segment)

    monkeypatch.setattr(buffer_mod._DiskSegment, "delete", spy)
    buf.ack(12)
    assert seen_during_delete and max(seen_during_delete) == 0
    assert buf.acked_seq == 12
    assert list((tmp_path / "run-v").glob("*.jsonl")) == []


def test_full_buffer_drops_new_events_then_declares_them_in_one_gap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    limits = BufferLimits(max_memory_events=4, max_spill_bytes=300, spill_dir=tmp_path)
    buf = EventBuffer("run-g", limits)
    with caplog.at_level(logging.WARNING, logger="engine.telemetry.buffer"):
        seqs = [buf.publish(_ev(i)) for i in range(30)]
    kept = [s for s in seqs if s is not None]
    assert kept == list(range(1, len(kept) + 1)) and 4 < len(kept) < 30
    stats = buf.stats()
    assert stats.dropped_total == 30 - len(kept) and stats.last_seq == 30
    assert "dropping new events" in caplog.text
    # room again after an ack: the gap event comes first, with the next seq of its own
    woke: list[int] = []
    buf.on_data = lambda: woke.append(1)
    assert buf.take(30, 10, arm=True) == []
    buf.ack(len(kept))
    assert woke == [1]
    assert buf.publish(_ev(99)) == 32
    got = _drain(buf, after=len(kept))
    assert [s for s, _ in got] == [31, 32]
    gap = got[0][1]
    assert gap["type"] == "gap"
    assert (gap["first_seq_lost"], gap["last_seq_lost"]) == (len(kept) + 1, 30)
    assert gap["num_events_lost"] == 30 - len(kept) and "limit" in gap["reason"]
    assert buf.stats().gaps_total == 1


def test_memory_only_buffer_drops_without_spilling() -> None:
    buf = EventBuffer("run-m", BufferLimits(max_memory_events=2, max_spill_bytes=0))
    assert [buf.publish(_ev(i)) for i in range(4)] == [1, 2, None, None]
    buf.ack(2)
    assert buf.publish(_ev(5)) == 6  # the gap took 5
    assert [d["type"] for _, d in _drain(buf, after=2)] == ["gap", "request"]


def test_publish_from_many_threads_gives_each_seq_once() -> None:
    buf = EventBuffer("run-t", BufferLimits(max_memory_events=100_000))
    results: list[list[int | None]] = [[] for _ in range(4)]

    def work(k: int) -> None:
        results[k].extend(buf.publish(_ev(i)) for i in range(2000))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    seqs = sorted(s for r in results for s in r if s is not None)
    assert seqs == list(range(1, 8001))
    assert [s for s, _ in buf.take(0, 10_000)] == list(range(1, 8001))


def test_close_deletes_spill_files(tmp_path: Path) -> None:
    buf = EventBuffer("run-c", BufferLimits(max_memory_events=1, spill_dir=tmp_path))
    for i in range(5):
        buf.publish(_ev(i))
    assert list((tmp_path / "run-c").glob("*.jsonl"))
    buf.close()
    assert not (tmp_path / "run-c").exists()
    assert buf.publish(_ev(9)) is None


@pytest.mark.parametrize(
    "kw", [{"max_memory_events": 0}, {"max_spill_bytes": -1}, {"spill_segment_bytes": "x"}]
)
def test_bad_limits_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        BufferLimits(**kw).validate()  # type: ignore[arg-type]


def test_the_telemetry_package_never_imports_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, engine.telemetry, engine.server.publishing, engine.telemetry.metrics; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_an_unwritable_spill_dir_drops_and_declares_instead_of_a_hole(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    buf = EventBuffer("run-w", BufferLimits(max_memory_events=2, spill_dir=not_a_dir))
    assert [buf.publish(_ev(i)) for i in range(4)] == [1, 2, None, None]
    assert buf.stats().dropped_total == 2 and buf.stats().spill_events == 0
    buf.ack(2)
    assert buf.publish(_ev(5)) == 6
    gap = _drain(buf, after=2)[0][1]
    assert (gap["type"], gap["first_seq_lost"], gap["last_seq_lost"]) == ("gap", 3, 4)


class _Broken:
    def to_dict(self) -> dict[str, object]:
        raise RuntimeError("broken")


def test_a_spilled_event_that_cannot_be_encoded_keeps_its_seq(tmp_path: Path) -> None:
    buf = EventBuffer("run-b", BufferLimits(max_memory_events=1, spill_dir=tmp_path))
    assert [buf.publish(_ev(0)), buf.publish(_Broken()), buf.publish(_ev(2))] == [1, 2, 3]
    got = _drain(buf)
    assert [d["type"] for _, d in got] == ["request", "unencodable", "request"]


def test_a_spill_file_that_vanished_is_declared_lost_and_the_stream_goes_on(
    tmp_path: Path,
) -> None:
    buf = EventBuffer("run-v", BufferLimits(max_memory_events=2, spill_dir=tmp_path))
    for i in range(6):
        buf.publish(_ev(i))  # 1-2 in memory, 3-6 in a spill file
    for f in (tmp_path / "run-v").glob("*.jsonl"):
        f.unlink()
    got = _drain(buf)
    assert [s for s, _ in got] == [1, 2, 6]
    gap = got[2][1]
    assert gap["type"] == "gap" and (gap["first_seq_lost"], gap["last_seq_lost"]) == (3, 6)
    assert buf.stats().dropped_total == 4 and buf.stats().gaps_total == 1
    buf.ack(6)
    assert buf.publish(_ev(7)) == 7 and [s for s, _ in _drain(buf, after=6)] == [7]
    assert buf.stats().spill_events == 0
