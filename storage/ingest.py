"""The collector's ingest rules, without I/O: what to do with a hello and with each frame.

The socket layer (``storage/collector_ingest.py``) feeds parsed frames in and carries the
verdict out (store the accepted events, send an error, close with a code); the rules here read
no socket, no store and no clock, so they are unit-tested without a server
(``tests/storage/test_ingest.py``).
Rules (docs/telemetry.md): the first frame is a hello of this schema; after it, ``events`` frames
whose seqs increase; a seq below the expected one is a duplicate (dropped, counted); a seq above
it is a gap, unless a ``gap`` event declares the seqs lost; ``control_ack`` frames answer relayed
controls.

Trust rules (docs/telemetry.md, "Identity and bounds"): a run is bound to the ``run_secret`` its
first hello presented (:func:`claim`); a hello that cannot prove a live run never replaces it
(:func:`may_take_over`); a seq may jump only through a ``gap`` that declares a bounded, contiguous
range (:func:`declares`); frames, hellos, ids and control messages are bounded in size and a
refused control stores one row at most (:func:`control_refusal_row`); every text field that is
stored is free of control characters and bounded in length (:func:`clean_text`).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import BigInteger, Integer, SmallInteger, Table

from storage import schema
from wire import strict_json
from wire.control import CAP_KEY, CONTROL_KEYS
from wire.events import SCHEMA_VERSION

CLOSE_BAD_INPUT = 4400

# Bounds (the publisher sends at most 512 events and 1 MiB per frame; its hello is a few KiB).
MAX_ID_CHARS = 128  # engine_id, run_id, a control's id
MAX_HELLO_BYTES = 64 * 1024
MAX_EVENTS_PER_FRAME = 4096
MAX_CONTROL_BYTES = 16 * 1024  # one message on /control
# Text fields (request ids, classes, reasons, the hello's model and host): longer ones are cut
# (see clean_text); every text field of a stored event fits, whatever the backend.
MAX_TEXT_CHARS = 512
# Seqs stay exact in every reader (JavaScript's safe integers, float64) and far from int64's end.
MAX_SEQ = 2**53
# The most seqs one ``gap`` event may declare lost (about 50 days of drops at 1,000 events/s).
MAX_GAP_EVENTS = 2**32


_CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f]")
_SURROGATES = re.compile("[\ud800-\udfff]")


def clean_text(value: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``value`` as the store keeps it: control characters (C0, DEL, C1) removed, lone
    surrogates (which UTF-8 cannot encode) as U+FFFD, and at most ``limit`` characters. A
    longer value keeps its start and ends in ``~`` and 16 hex digits of its SHA-256, so two
    distinct long ids stay distinct and the same id is always cut the same way. PostgreSQL
    refuses a NUL in text, so one would otherwise fail its batch on every resend."""
    if len(value) <= limit and value.isprintable():
        return value  # the common case, at C speed (isprintable is False for all of the above)
    value = _SURROGATES.sub("\ufffd", _CONTROL_CHARS.sub("", value))
    if len(value) > limit:
        digest = hashlib.sha256(value.encode()).hexdigest()[:16]
        value = f"{value[: limit - 17]}~{digest}"
    return value


def _clean_fields(d: dict[str, Any]) -> None:
    """Every top-level string value of ``d`` through :func:`clean_text`, in place."""
    for key, value in d.items():
        if type(value) is str and (len(value) > MAX_TEXT_CHARS or not value.isprintable()):
            d[key] = clean_text(value)


def clean_events(events: list[dict[str, Any]]) -> None:
    """The text of accepted events as the store keeps it (:func:`clean_text`), in place: each
    event's string fields and its chunks' (a step's request ids)."""
    limit = MAX_TEXT_CHARS
    for ev in events:  # inline, no call per event or chunk: this runs on every frame
        if type(ev) is not dict:
            continue  # a storage.frames.CheckedEvent: clean as decoded
        dirty = [
            k for k, v in ev.items() if type(v) is str and (len(v) > limit or not v.isprintable())
        ]
        for k in dirty:
            ev[k] = clean_text(ev[k])
        chunks = ev.get("chunks")
        if type(chunks) is not list:
            continue
        for c in chunks:
            if type(c) is not dict:
                continue
            rid = c.get("request_id")
            if type(rid) is str and (len(rid) > limit or not rid.isprintable()):
                c["request_id"] = clean_text(rid)
            kind = c.get("kind")
            if type(kind) is str and not kind.isprintable():
                c["kind"] = clean_text(kind)


def secret_hash(secret: str) -> str:
    """What the store keeps of a run secret (SHA-256, hex): enough to check it, useless to
    present."""
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Claim:
    """The verdict on a hello's claim to a run: ``refused`` (why, or "") ; ``proven`` when it
    presented the run's secret; ``register``: the hash to store for a new run (None: none)."""

    refused: str = ""
    proven: bool = False
    register: str | None = None


def claim(*, registered: bool, stored_hash: str | None, secret: object) -> Claim:
    """May a hello presenting ``secret`` speak for a run? ``registered``: the run exists in the
    store, with ``stored_hash`` (None: registered by an engine that sends no secret).

    The first hello of a run registers its secret; every later hello must present the same one.
    A run registered without a secret stays unproven for good (nobody can claim it later)."""
    if secret is not None and (not isinstance(secret, str) or not 16 <= len(secret) <= 256):
        return Claim(refused="run_secret must be a string of 16 to 256 characters")
    if not registered:
        if secret is None:
            return Claim()
        return Claim(proven=True, register=secret_hash(secret))
    if stored_hash is None:
        return Claim()
    if secret is not None and hmac.compare_digest(secret_hash(secret), stored_hash):
        return Claim(proven=True)
    return Claim(refused="this run is bound to another run_secret: missing or wrong run_secret")


def may_take_over(*, proven: bool, live: bool) -> bool:
    """A hello replaces a live connection of its run only when it proved the run's secret; an
    unproven one waits until the live connection is gone."""
    return proven or not live


def parse(raw: str | bytes) -> tuple[dict[str, Any] | None, str]:
    """A frame as a JSON object, or None and why not (``wire.strict_json``: no NaN or
    Infinity, nesting bounded)."""
    if isinstance(raw, bytes):
        return None, "binary frame: frames are JSON text"
    try:
        msg = strict_json.loads(raw)
    except ValueError as exc:
        return None, str(exc)
    if not isinstance(msg, dict):
        return None, f"a frame must be a JSON object, got {type(msg).__name__}"
    return msg, ""


# ---- integers the store can hold -----------------------------------------------------------------
# Derived from the SQLAlchemy column types in storage/schema.py, narrowest backend first:
# PostgreSQL's Integer is 32-bit, BigInteger 64-bit (SQLite holds 64 bits in either). An event
# whose field would land in a column that cannot hold it is refused (a bad event: its seq counts
# as received, nothing of it is stored) instead of failing a whole batch on PostgreSQL.


def _bits(column_type: Any) -> int | None:
    if isinstance(column_type, BigInteger):
        return 64
    if isinstance(column_type, SmallInteger):
        return 16
    if isinstance(column_type, Integer):
        return 32
    return None


def _int_ranges(*tables: Table) -> dict[str, tuple[int, int]]:
    """Column name -> (least, greatest) integer it holds, over ``tables`` (narrowest wins)."""
    out: dict[str, tuple[int, int]] = {}
    for table in tables:
        for column in table.columns:
            bits = _bits(column.type)
            if bits is None:
                continue
            lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
            old = out.get(column.name, (lo, hi))
            out[column.name] = (max(lo, old[0]), min(hi, old[1]))
    return out


INT_RANGES: dict[str, dict[str, tuple[int, int]]] = {
    "step": _int_ranges(schema.steps),
    "request": _int_ranges(schema.request_events, schema.requests),
    "control": _int_ranges(schema.controls),
    "gap": _int_ranges(schema.gaps),
    "hello": _int_ranges(schema.runs),
}


def _out_of_range(name: str, value: Any, ranges: dict[str, tuple[int, int]]) -> str:
    bounds = ranges.get(name)
    if bounds is None or not _int(value) or bounds[0] <= value <= bounds[1]:
        return ""
    return f"{name} {value} is outside what the store holds ({bounds[0]} to {bounds[1]})"


def integer_refusal(ev: dict[str, Any], kind: str | None = None) -> str:
    """Why an event (or a hello, ``kind="hello"``) carries an integer its column cannot hold on
    every backend ("" when none does).

    Runs on every stored event, so the loop is inline: events are parsed JSON, whose integers
    are exactly ``int`` (``type() is int`` also leaves out ``bool``); only those are looked up."""
    kind = kind or ev.get("type")
    ranges = INT_RANGES.get(kind) if isinstance(kind, str) else None
    if ranges is None:
        return ""
    for name, value in ev.items():
        if type(value) is int:
            bounds = ranges.get(name)
            if bounds is not None and not bounds[0] <= value <= bounds[1]:
                return _out_of_range(name, value, ranges)
    runs = INT_RANGES["hello"]
    if kind == "hello" and isinstance(ev.get("clock"), dict):
        for name, value in ev["clock"].items():
            why = _out_of_range(f"clock_{name}", value, runs)
            if why:
                return why
    if kind == "control" and ev.get("accepted") and isinstance(ev.get("key"), str):
        # an accepted change lands in the run's row too (runs.token_budget, ...)
        why = _out_of_range(ev["key"], ev.get("new_value"), runs)
        if why:
            return why
    return ""


def check_hello(h: dict[str, Any]) -> str:
    """Why ``h`` is not an acceptable hello ("" when it is)."""
    if h.get("type") != "hello":
        return "the first frame must be a hello"
    if h.get("schema") != SCHEMA_VERSION:
        return f"schema {h.get('schema')!r} not supported (this collector speaks {SCHEMA_VERSION})"
    for key in ("engine_id", "run_id"):
        if not isinstance(h.get(key), str) or not h[key]:
            return f"hello needs a non-empty string {key}"
        if len(h[key]) > MAX_ID_CHARS or not h[key].isprintable():
            return f"hello {key} must be printable and at most {MAX_ID_CHARS} characters"
    clock = h.get("clock")
    if not isinstance(clock, dict) or not all(
        isinstance(clock.get(k), int) and not isinstance(clock.get(k), bool)
        for k in ("wall_ns", "mono_ns")
    ):
        return "hello needs clock {wall_ns, mono_ns} as integers"
    for key in (
        "token_budget",
        "max_token_budget",
        CAP_KEY,
        "pid",
        "kv_blocks_total",
        "block_size",
    ):
        value = h.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"hello {key} must be an integer, got {value!r}"
    why = integer_refusal(h, "hello")
    return f"hello {why}" if why else ""


def check_hello_frame(raw: str | bytes) -> tuple[dict[str, Any] | None, str]:
    """The first frame of a connection as a hello, or None and why not (size first: a hello is
    a few KiB, and what the store keeps of it is bounded by this)."""
    if len(raw) > MAX_HELLO_BYTES:
        return None, f"hello over {MAX_HELLO_BYTES} bytes"
    hello, why = parse(raw)
    if hello is None:
        return None, why
    why = check_hello(hello)
    if why:
        return None, why
    credentials: dict[str, Any] = {k: hello.pop(k) for k in ("token", "run_secret") if k in hello}
    _clean_fields(hello)  # engine_id and run_id are printable and short already
    hello.update(credentials)  # compared as presented, never stored
    policies = hello.get("policies")
    if isinstance(policies, list):
        hello["policies"] = [clean_text(p) if isinstance(p, str) else p for p in policies]
    return hello, ""


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def declares(ev: dict[str, Any], expected: int) -> bool:
    """A gap event may jump over the seqs it declares lost: a range that starts at or before the
    next expected seq, reaches the gap's own seq - 1 (or the seq itself, see docs), and jumps
    at most ``MAX_GAP_EVENTS``."""
    if ev.get("type") != "gap":
        return False
    first, last = ev.get("first_seq_lost"), ev.get("last_seq_lost")
    seq = ev["seq"]
    return (
        _int(first)
        and _int(last)
        and 1 <= first <= expected
        and seq - 1 <= last <= MAX_SEQ
        and seq - expected <= MAX_GAP_EVENTS
    )


@dataclass
class Verdict:
    """What the socket layer does with one frame after the hello."""

    close: str | None = None  # close with CLOSE_BAD_INPUT and this reason
    control_ack: dict[str, Any] | None = None  # an answer to a relayed control
    error: dict[str, Any] | None = None  # an error reply to send; the connection stays
    accepted: list[dict[str, Any]] = field(default_factory=list)  # events to store, seq order
    expected: int = 1  # the next expected seq once ``accepted`` is stored
    duplicates: int = 0


def error(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message, **extra}


def frame(msg: dict[str, Any], *, engine_id: str, run_id: str, expected: int) -> Verdict:
    """The verdict on one parsed frame of the connection of ``engine_id`` / ``run_id`` whose
    next expected seq is ``expected``."""
    kind = msg.get("type")
    if kind == "control_ack":
        return Verdict(control_ack=msg, expected=expected)
    if msg.get("schema") != SCHEMA_VERSION:
        return Verdict(close=f"schema {msg.get('schema')!r} not supported", expected=expected)
    if kind != "events":
        return Verdict(
            error=error(
                "unknown_message",
                f"unknown message type {kind!r} on /ingest (after the hello: "
                "events or control_ack)",
            ),
            expected=expected,
        )
    for key, value in (("engine_id", engine_id), ("run_id", run_id)):
        if key in msg and msg[key] != value:
            return Verdict(close=f"{key} differs from the hello's", expected=expected)
    events = msg.get("events")
    if not isinstance(events, list) or not all(
        isinstance(e, dict) and _int(e.get("seq")) and 1 <= e["seq"] <= MAX_SEQ for e in events
    ):
        return Verdict(
            close=f"events must be a list of objects with an integer seq from 1 to {MAX_SEQ}",
            expected=expected,
        )
    if len(events) > MAX_EVENTS_PER_FRAME:
        return Verdict(
            close=f"{len(events)} events in one frame (at most {MAX_EVENTS_PER_FRAME})",
            expected=expected,
        )
    seqs = [e["seq"] for e in events]
    if any(b <= a for a, b in itertools.pairwise(seqs)):
        return Verdict(
            error=error(
                "seq_order",
                "the seqs in a frame must increase; frame refused",
                expected=expected,
            ),
            expected=expected,
        )
    verdict = Verdict(expected=expected)
    for ev in events:
        seq = ev["seq"]
        if seq < verdict.expected:
            verdict.duplicates += 1
            continue
        if seq > verdict.expected and not declares(ev, verdict.expected):
            gap_at = verdict.expected
            verdict.error = error(
                "seq_gap", f"seq {gap_at} is missing; resend from it", expected=gap_at
            )
            break
        verdict.accepted.append(ev)
        verdict.expected = seq + 1
    clean_events(verdict.accepted)
    return verdict


def control_refusal_row(
    msg: dict[str, Any], param: str | None, *, known_engine: bool
) -> tuple[str | None, Any] | None:
    """What the collector stores of a control it refused: None (nothing: the engine is not one it
    has seen, so a client cannot make rows for engines that do not exist), else one row's
    ``(key, new_value)``: the key at fault when it is a control key, otherwise no key and no
    value. Never one row per key of ``set``: a message of a million keys is one row."""
    if not known_engine:
        return None
    new = msg.get("set")
    if param in CONTROL_KEYS and isinstance(new, dict):
        value = new.get(param)
        if isinstance(value, str) and len(value) > MAX_ID_CHARS:
            value = value[:MAX_ID_CHARS]
        if isinstance(value, (dict, list, float)):
            value = None
        return param, value
    return None, None


def check_control_message(raw: str | bytes) -> tuple[dict[str, Any] | None, str]:
    """A /control message, bounded before it is parsed: None and why when it is too big, not a
    JSON object, or its id is not a short string."""
    if len(raw) > MAX_CONTROL_BYTES:
        return None, f"message over {MAX_CONTROL_BYTES} bytes"
    msg, why = parse(raw)
    if msg is None:
        return None, why
    cid = msg.get("id")
    if cid is not None and (
        not isinstance(cid, (str, int)) or isinstance(cid, bool) or len(str(cid)) > MAX_ID_CHARS
    ):
        return None, f"id must be a string of at most {MAX_ID_CHARS} characters"
    return msg, ""


def bad_events_reply(bad: list[tuple[int, str]]) -> dict[str, Any]:
    """One ``bad_event`` error for every event of a batch that could not be read: the first
    one's seq and reason, and how many."""
    seq, why = bad[0]
    more = f" (and {len(bad) - 1} more in this batch)" if len(bad) > 1 else ""
    return error(
        "bad_event",
        f"event {seq} could not be read and was skipped: {why[:200]}{more}",
        seq=seq,
        count=len(bad),
    )


MAX_ENGINES_LISTED = 200  # one list_engines reply (a few hundred bytes each: well under 1 MiB)


def engines_page(rows: list[dict[str, Any]], offset: object = None) -> dict[str, Any]:
    """One ``engines`` reply: connected engines first, then the others as first seen, at most
    ``MAX_ENGINES_LISTED`` from ``offset``; ``next_offset`` when more follow (older clients
    read the first page, which holds the connected engines)."""
    start = offset if isinstance(offset, int) and not isinstance(offset, bool) else 0
    start = max(0, start)
    ordered = sorted(rows, key=lambda r: not r.get("connected"))  # stable: first seen first
    page = ordered[start : start + MAX_ENGINES_LISTED]
    reply: dict[str, Any] = {"type": "engines", "engines": page, "total": len(ordered)}
    if start + MAX_ENGINES_LISTED < len(ordered):
        reply["next_offset"] = start + MAX_ENGINES_LISTED
    return reply


MAX_ENGINES_REMEMBERED = 10_000  # engine ids the collector lists (a row each in memory)


def seen_to_forget(
    rows: dict[str, dict[str, Any]], limit: int = MAX_ENGINES_REMEMBERED
) -> list[str]:
    """The engine ids to forget so that at most ``limit`` remain: disconnected ones, first seen
    first; a connected engine is never forgotten (their number is bounded by the connection
    cap)."""
    excess = len(rows) - limit
    if excess <= 0:
        return []
    return [k for k, r in rows.items() if not r.get("connected")][:excess]
