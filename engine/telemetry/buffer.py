"""The publisher's buffer: seq numbers, unacknowledged events in memory, then in spill files.

Events wait here from ``publish`` until the collector acknowledges them as durable. The buffer is
an ordered list of segments covering increasing seqs: memory segments (the events themselves,
encoded lazily when sent) and spill segments (append-only JSON-lines files, one event a line,
already encoded). A new event goes to the last segment while memory has room
(``max_memory_events``), else to a spill file while the spill limit allows, else it is dropped:
its seq is spent and, once there is room again, one ``gap`` event (with a seq of its own)
declares the lost range. Acknowledgements release memory from the head and delete spill files
acknowledged past their end. Each segment's seqs are contiguous: a drop seals the last segment.

Thread-safe: ``publish`` runs on the thread that delivers engine events, ``take`` / ``ack`` on the
publisher's network thread. Spill-file I/O happens only while spilling (the collector is away or
slow), never on the normal path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any

from wire.events import ChunkRecord, ControlEvent, RequestEvent, StepEvent

logger = logging.getLogger(__name__)

_FLAT_EVENTS = (StepEvent, RequestEvent, ControlEvent)
# The direct chunk encoder writes exactly these fields, in this order; a test checks that it is
# the encoder in use (a field added to ChunkRecord must be added to it too).
DIRECT_CHUNK_FIELDS = ("request_id", "kind", "start", "num_tokens", "produced_token", "capped")
DIRECT_STEP_ENCODER = tuple(f.name for f in fields(ChunkRecord)) == DIRECT_CHUNK_FIELDS

DEFAULT_MAX_MEMORY_EVENTS = 20_000
DEFAULT_MAX_SPILL_BYTES = 1 << 30
DEFAULT_SPILL_SEGMENT_BYTES = 4 << 20


def event_dict(event: Any) -> dict[str, Any]:
    """``event.to_dict()`` (a new dict) for an ``wire.events`` event, a copy for a dict.

    The engine's own event types are flat dataclasses (a step's ``chunks`` a list of flat
    dataclasses), so their dicts are built from ``vars()`` directly: the same result as
    ``dataclasses.asdict`` at a fraction of its cost (a 64-chunk step: ~90 us instead of ~380).
    """
    if type(event) in _FLAT_EVENTS:
        d = {k: [dict(vars(c)) for c in v] if k == "chunks" else v for k, v in vars(event).items()}
        d["type"] = event.type
        return d
    return event.to_dict() if hasattr(event, "to_dict") else dict(event)


_SAFE_ID = re.compile(r"[A-Za-z0-9_.:\-]*\Z").match
_DUMPS = json.JSONEncoder(separators=(",", ":"), default=str).encode


def _flat_json(parts: list[str], d: dict[str, Any]) -> None:
    """Append ``"key":value`` for each item of ``d``: ints, None, bools and plain
    id-like strings written directly, anything else through ``json`` (same text as json.dumps
    with compact separators; ``default=str`` as ever)."""
    for k, v in d.items():
        t = type(v)
        if t is int:
            parts.append(f'"{k}":{v}')
        elif v is None:
            parts.append(f'"{k}":null')
        elif t is bool:
            parts.append(f'"{k}":true' if v else f'"{k}":false')
        elif t is str and _SAFE_ID(v):
            parts.append(f'"{k}":"{v}"')
        else:
            parts.append(f'"{k}":{_DUMPS(v)}')


def _encode_flat(seq: int, event: Any) -> str:
    """A request or control event (a flat dataclass) as JSON with its seq, written directly:
    the same object as ``json.dumps`` of ``to_dict()`` + seq (a test checks), ~3x cheaper."""
    parts = [f'{{"type":"{event.type}","seq":{seq}']
    _flat_json(parts, vars(event))
    return ",".join(parts) + "}"


_TF = {True: "true", False: "false"}
_KINDS = frozenset(("prefill", "decode"))
_safe_ids: set[str] = set()  # request ids checked by _SAFE_ID (ids recur in step after step)


def _safe_id(rid: Any) -> bool:
    if type(rid) is not str:
        return False
    if rid in _safe_ids:
        return True
    if not _SAFE_ID(rid):
        return False
    if len(_safe_ids) >= 65536:
        _safe_ids.clear()
    _safe_ids.add(rid)
    return True


# A step's scalar fields: all ints but ``policy`` (a test checks this is the encoder in use).
_STEP_INT_FIELDS = tuple(
    f.name for f in fields(StepEvent) if f.name not in ("policy", "chunks")
)  # fmt: skip
_STEP_HEAD = '{"type":"step","seq":%d,"policy":"%s",' + ",".join(
    f'"{name}":%d' for name in _STEP_INT_FIELDS
)
_NUM_STEP_FIELDS = len(_STEP_INT_FIELDS) + 2
_ONLY_INT = {int}


def _encode_step(seq: int, event: StepEvent) -> str:
    """A step event as JSON with its fields and chunks written out directly (most of the
    telemetry's CPU: a 64-chunk step ~35 us instead of ~140 through dicts and json.dumps);
    the same object as ``json.dumps`` of ``to_dict()`` + seq (a test checks). A field or chunk
    with an unusual value (an id with quotes, a non-int count) goes through json."""
    d = event.__dict__
    ints = tuple([d[k] for k in _STEP_INT_FIELDS])
    policy = d["policy"]
    if (
        len(d) == _NUM_STEP_FIELDS and set(map(type, ints)) == _ONLY_INT
        and type(policy) is str and _SAFE_ID(policy) and type(seq) is int
    ):  # fmt: skip
        head = _STEP_HEAD % (seq, policy, *ints)
    else:
        parts = [f'{{"type":"step","seq":{seq}']
        _flat_json(parts, {k: v for k, v in d.items() if k != "chunks"})
        head = ",".join(parts)
    out: list[str] = []
    add = out.append
    for c in event.chunks:
        d = c.__dict__
        rid, kind, start, n = d["request_id"], d["kind"], d["start"], d["num_tokens"]
        produced, capped = d["produced_token"], d["capped"]
        if (
            _safe_id(rid) and kind in _KINDS and type(start) is int and type(n) is int
            and (produced is True or produced is False) and (capped is True or capped is False)
            and len(d) == 6
        ):  # fmt: skip
            add(
                f'{{"request_id":"{rid}","kind":"{kind}","start":{start},"num_tokens":{n},'
                f'"produced_token":{_TF[produced]},"capped":{_TF[capped]}}}'
            )
        else:
            add(_DUMPS(dict(d)))
    return f'{head},"chunks":[{",".join(out)}]}}'


def encode_or_placeholder(seq: int, event: Any) -> str:
    """``encode_event``; an event that cannot be encoded still takes its seq, as an
    ``unencodable`` event (readers skip unknown types) rather than an undeclared gap."""
    try:
        return encode_event(seq, event)
    except Exception as exc:  # noqa: BLE001 - one bad event must not stop the stream
        logger.error("telemetry: event seq %d cannot be encoded (%s): %r", seq, exc, event)
        return json.dumps({"type": "unencodable", "seq": seq, "reason": str(exc)[:500]})


def encode_event(seq: int, event: Any) -> str:
    """One event as compact JSON text with its ``seq`` (an Event with ``to_dict()`` or a dict)."""
    t = type(event)
    if t is StepEvent and DIRECT_STEP_ENCODER:
        return _encode_step(seq, event)
    if t is RequestEvent or t is ControlEvent:
        return _encode_flat(seq, event)
    d = event_dict(event)
    if "type" not in d:
        raise ValueError(f"an event needs a 'type' field, got keys {sorted(d)}")
    d["seq"] = seq
    return json.dumps(d, separators=(",", ":"), default=str)


@dataclass
class BufferLimits:
    """How much the publisher keeps while the collector has not acknowledged it.

    ``max_memory_events`` events in memory, then up to ``max_spill_bytes`` of spill files in
    ``spill_dir`` (None: a temporary folder made on first use; ``max_spill_bytes=0``: no spill),
    rotated every ``spill_segment_bytes``.
    """

    max_memory_events: int = DEFAULT_MAX_MEMORY_EVENTS
    max_spill_bytes: int = DEFAULT_MAX_SPILL_BYTES
    spill_dir: Path | str | None = None
    spill_segment_bytes: int = DEFAULT_SPILL_SEGMENT_BYTES

    def validate(self) -> BufferLimits:
        for name in ("max_memory_events", "spill_segment_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if (
            isinstance(self.max_spill_bytes, bool)
            or not isinstance(self.max_spill_bytes, int)
            or self.max_spill_bytes < 0
        ):
            raise ValueError(
                f"max_spill_bytes must be an int >= 0 (0: no spill), got {self.max_spill_bytes!r}"
            )
        return self


@dataclass
class _MemSegment:
    first_seq: int
    items: list[Any] = field(default_factory=list)
    head: int = 0  # items[:head] are acknowledged (released)
    sealed: bool = False

    @property
    def end_seq(self) -> int:  # one past the last seq
        return self.first_seq + len(self.items)

    def release_upto(self, seq: int) -> int:
        """Release items with seq <= ``seq``; returns how many were released."""
        upto = min(seq + 1, self.end_seq) - self.first_seq
        released = max(0, upto - self.head)
        if released:
            for i in range(self.head, upto):
                self.items[i] = None
            self.head = upto
            if self.head >= 4096 and self.head * 2 >= len(self.items):
                del self.items[: self.head]
                self.first_seq += self.head
                self.head = 0
        return released


@dataclass
class _DiskSegment:
    path: Path
    first_seq: int
    count: int = 0
    nbytes: int = 0
    sealed: bool = False
    broken: bool = False  # could not be read back; declared lost
    _writer: IO[str] | None = None
    _reader: IO[str] | None = None
    _lines: list[str] = field(default_factory=list)  # read back so far, from first_seq

    @property
    def end_seq(self) -> int:
        return self.first_seq + self.count

    def append(self, line: str) -> None:
        if self._writer is None:
            self._writer = self.path.open("a", encoding="utf-8", buffering=1)  # by line
        self._writer.write(line + "\n")
        self.count += 1
        self.nbytes += len(line) + 1

    def read(self, index: int, n: int) -> list[str]:
        """Lines ``index`` .. ``index + n - 1`` (0 = first_seq), reading the file as needed."""
        want = min(index + n, self.count)
        if len(self._lines) < want:
            if self._writer is not None:
                self._writer.flush()
            if self._reader is None:
                self._reader = self.path.open("r", encoding="utf-8")
            while len(self._lines) < want:
                line = self._reader.readline()
                if not line.endswith("\n"):
                    raise OSError(f"spill file {self.path} ends early at line {len(self._lines)}")
                self._lines.append(line[:-1])
        return self._lines[index:want]

    def drop_cache(self) -> None:
        self._lines = []
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def seal(self) -> None:
        self.sealed = True
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def delete(self) -> None:
        with contextlib.suppress(OSError):  # already gone or unwritable: nothing more to do
            self.seal()
            self.drop_cache()
            self.path.unlink(missing_ok=True)


@dataclass
class BufferStats:
    published: int  # events given to publish (dropped ones included)
    last_seq: int  # highest seq assigned
    acked_seq: int
    queued: int  # events held, not yet acknowledged (memory and spill)
    memory_events: int
    spill_events: int
    spill_bytes: int
    spilled_total: int
    dropped_total: int
    gaps_total: int


class EventBuffer:
    """Seq assignment and the unacknowledged events of one run (see the module docstring)."""

    def __init__(self, run_id: str, limits: BufferLimits | None = None) -> None:
        self.run_id = run_id
        self.limits = (limits or BufferLimits()).validate()
        self._lock = threading.Lock()
        self._segments: list[_MemSegment | _DiskSegment] = []
        self._next_seq = 1
        self._acked = 0
        self._memory_events = 0
        self._spill_events = 0
        self._spill_bytes = 0
        self._spill_run_dir: Path | None = None
        self._made_spill_root: Path | None = None
        self._lost: list[int] | None = None  # [first_seq_lost, last_seq_lost, count]
        self._published = 0
        self._spilled_total = 0
        self._dropped_total = 0
        self._gaps_total = 0
        self._spilling = False
        self._spill_failed = False
        self._closed = False
        self._armed = False
        self.on_data: Callable[[], None] | None = None  # called when ``take`` armed and data came

    # --- producer side ----------------------------------------------------------------------
    def publish(self, event: Any) -> int | None:
        """Assign the next seq and keep ``event``; returns its seq, or None if it was dropped."""
        with self._lock:
            if self._closed:
                return None
            self._published += 1
            if self._lost is not None:
                self._emit_gap_locked()
            seq = self._next_seq
            self._next_seq += 1
            if self._lost is None and self._store_locked(seq, event):
                wake = self._armed
                self._armed = False
            else:
                self._drop_locked(seq)
                return None
        if wake and self.on_data is not None:
            self.on_data()
        return seq

    def _store_locked(self, seq: int, event: Any) -> bool:
        limits = self.limits
        tail = self._segments[-1] if self._segments else None
        if self._memory_events < limits.max_memory_events:
            if not isinstance(tail, _MemSegment) or tail.sealed:
                if tail is not None:
                    self._seal(tail)
                tail = _MemSegment(first_seq=seq)
                self._segments.append(tail)
            tail.items.append(event)
            self._memory_events += 1
            if self._spilling and self._spill_events == 0:
                self._spilling = False
            return True
        if limits.max_spill_bytes == 0:
            return False
        line = encode_or_placeholder(seq, event)
        if self._spill_bytes + len(line) + 1 > limits.max_spill_bytes:
            return False
        try:
            if (
                not isinstance(tail, _DiskSegment)
                or tail.sealed
                or tail.nbytes >= limits.spill_segment_bytes
            ):
                if tail is not None:
                    self._seal(tail)
                path = self._spill_dir() / f"seg-{seq:012d}.jsonl"
                tail = _DiskSegment(path=path, first_seq=seq)
                self._segments.append(tail)
            tail.append(line)
        except OSError as exc:  # a full or unwritable disk: no room, as when the limit is hit
            if isinstance(tail, _DiskSegment):
                with contextlib.suppress(OSError):
                    tail.seal()  # a partly written line must not be followed by more
                if tail.count == 0 and self._segments and self._segments[-1] is tail:
                    self._segments.pop()
            if not self._spill_failed:
                self._spill_failed = True
                logger.error("telemetry: cannot write spill files: %s", exc)
            return False
        self._spill_failed = False
        self._spill_events += 1
        self._spill_bytes += len(line) + 1
        self._spilled_total += 1
        if not self._spilling:
            self._spilling = True
            logger.warning(
                "telemetry: %d events in memory are not yet acknowledged by the collector; "
                "spilling new ones to %s (up to %d bytes)",
                self._memory_events,
                tail.path.parent,
                limits.max_spill_bytes,
            )
        return True

    @staticmethod
    def _seal(segment: _MemSegment | _DiskSegment) -> None:
        if isinstance(segment, _DiskSegment):
            segment.seal()
        else:
            segment.sealed = True

    def _spill_dir(self) -> Path:
        if self._spill_run_dir is None:
            root = self.limits.spill_dir
            if root is None:
                root = Path(tempfile.mkdtemp(prefix="chunkscope-spill-"))
                self._made_spill_root = root
            run_dir = Path(root) / self.run_id
            run_dir.mkdir(parents=True, exist_ok=True)
            self._spill_run_dir = run_dir
        return self._spill_run_dir

    def _drop_locked(self, seq: int) -> None:
        self._dropped_total += 1
        if self._lost is None:
            self._lost = [seq, seq, 1]
            if self._segments:
                self._seal(self._segments[-1])
            logger.warning(
                "telemetry: buffer full (%d events in memory, %d spill bytes, limits %d events "
                "and %d bytes); dropping new events from seq %d until the collector catches up",
                self._memory_events,
                self._spill_bytes,
                self.limits.max_memory_events,
                self.limits.max_spill_bytes,
                seq,
            )
        else:
            self._lost[1] = seq
            self._lost[2] += 1

    def _emit_gap_locked(self) -> None:
        """If events were lost and there is room now, store the gap event that declares them."""
        assert self._lost is not None
        first, last, count = self._lost
        gap = {
            "type": "gap",
            "first_seq_lost": first,
            "last_seq_lost": last,
            "num_events_lost": count,
            "reason": (
                "telemetry buffer full: memory limit "
                f"{self.limits.max_memory_events} events and spill limit "
                f"{self.limits.max_spill_bytes} bytes reached before the collector acknowledged"
            ),
            "time_ns": time.monotonic_ns(),
        }
        seq = self._next_seq
        if self._store_locked(seq, gap):
            self._next_seq += 1
            self._lost = None
            self._gaps_total += 1
            logger.warning(
                "telemetry: lost %d events (seq %d to %d); declared them in gap event seq %d",
                count,
                first,
                last,
                seq,
            )

    # --- consumer side (the publisher's network thread) ---------------------------------------
    def take(self, after_seq: int, max_events: int, *, arm: bool = False) -> list[tuple[int, Any]]:
        """Up to ``max_events`` held events with seq > ``after_seq``, in seq order, as
        ``(seq, event)`` (memory) or ``(seq, json_text)`` (spill). With ``arm``, an empty answer
        arranges for ``on_data`` to be called at the next publish."""
        out: list[tuple[int, Any]] = []
        with self._lock:
            for segment in self._segments:
                if len(out) >= max_events:
                    break
                start = max(after_seq + 1, segment.first_seq)
                if out:
                    start = max(start, out[-1][0] + 1)
                if start >= segment.end_seq:
                    continue
                n = min(max_events - len(out), segment.end_seq - start)
                index = start - segment.first_seq
                if isinstance(segment, _MemSegment):
                    items = segment.items[index : index + n]
                    if segment.head > index:  # already released: nothing before the head is held
                        skip = segment.head - index
                        items, start = items[skip:], start + skip
                    out.extend(zip(range(start, start + len(items)), items, strict=True))
                else:
                    try:
                        lines = segment.read(index, n)
                    except OSError as exc:  # the file is gone or damaged: declare its events
                        out.append(self._lost_segment_locked(segment, start, exc))
                        break
                    out.extend(zip(range(start, start + len(lines)), lines, strict=True))
            if not out and arm:
                self._armed = True
        return out

    def _lost_segment_locked(
        self, segment: _DiskSegment, start: int, exc: OSError
    ) -> tuple[int, str]:
        """A spill segment that cannot be read back: a ``gap`` event at its last seq declares
        ``start`` .. that seq lost (the collector accepts a gap that covers the seqs up to its
        own), so the stream goes on after it."""
        last = segment.end_seq - 1
        if not segment.broken:
            segment.broken = True
            self._dropped_total += segment.count
            self._gaps_total += 1
            logger.error(
                "telemetry: spill file %s cannot be read back (%s); declaring seq %d to %d lost",
                segment.path,
                exc,
                start,
                last,
            )
        gap = {
            "type": "gap",
            "seq": last,
            "first_seq_lost": start,
            "last_seq_lost": last,
            "num_events_lost": last - start + 1,
            "reason": f"spill file {segment.path.name} could not be read back: {exc}",
            "time_ns": time.monotonic_ns(),
        }
        return last, json.dumps(gap, separators=(",", ":"))

    def ack(self, seq: int) -> None:
        """The collector holds every seq up to ``seq``: release them."""
        with self._lock:
            seq = min(seq, self._next_seq - 1)
            if seq <= self._acked:
                return
            keep: list[_MemSegment | _DiskSegment] = []
            for i, segment in enumerate(self._segments):
                if segment.first_seq > seq:
                    keep.extend(self._segments[i:])
                    break
                if isinstance(segment, _MemSegment):
                    self._memory_events -= segment.release_upto(seq)
                    if segment.end_seq - 1 > seq or segment is self._segments[-1]:
                        keep.extend(self._segments[i:])
                        break
                elif segment.end_seq - 1 <= seq:
                    self._spill_events -= segment.count
                    self._spill_bytes -= segment.nbytes
                    segment.delete()
                else:
                    keep.extend(self._segments[i:])
                    break
            self._segments = keep
            # published last: ``acked_seq`` is read without the lock (``Publisher.wait_acked``),
            # so a reader that sees ``seq`` acknowledged finds its segments already released
            self._acked = seq
            if self._spill_events == 0:
                self._spilling = False
            wake = False
            if self._lost is not None:
                self._emit_gap_locked()
                wake = self._lost is None and self._armed
                if wake:
                    self._armed = False
        if wake and self.on_data is not None:
            self.on_data()

    # --- state ----------------------------------------------------------------------------------
    @property
    def acked_seq(self) -> int:
        return self._acked

    @property
    def last_seq(self) -> int:
        """The highest seq assigned so far (0: none)."""
        return self._next_seq - 1

    @property
    def first_held_seq(self) -> int | None:
        """The lowest seq still held (None: nothing held)."""
        with self._lock:
            for segment in self._segments:
                first = segment.first_seq + (
                    segment.head if isinstance(segment, _MemSegment) else 0
                )
                if first < segment.end_seq:
                    return max(first, self._acked + 1)
        return None

    def stats(self) -> BufferStats:
        with self._lock:
            return BufferStats(
                published=self._published,
                last_seq=self._next_seq - 1,
                acked_seq=self._acked,
                queued=self._memory_events + self._spill_events,
                memory_events=self._memory_events,
                spill_events=self._spill_events,
                spill_bytes=self._spill_bytes,
                spilled_total=self._spilled_total,
                dropped_total=self._dropped_total,
                gaps_total=self._gaps_total,
            )

    def close(self) -> None:
        """Stop accepting events and delete the spill files (they belong to this run only)."""
        with self._lock:
            self._closed = True
            for segment in self._segments:
                if isinstance(segment, _DiskSegment):
                    segment.delete()
            self._segments = []
            self._memory_events = self._spill_events = self._spill_bytes = 0
            if self._spill_run_dir is not None:
                shutil.rmtree(self._spill_run_dir, ignore_errors=True)
            if self._made_spill_root is not None:
                shutil.rmtree(self._made_spill_root, ignore_errors=True)
