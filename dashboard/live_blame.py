"""Who caused the Live page's stalls: the blame ledger of the gaps before the ringed tokens,
computed a few at a time and kept, so a redraw reads the store only for stalls it has not
blamed yet. No ``st.`` inside (the page holds one ``StallBlame`` in its session)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

# per redraw, at most this many new stalls are blamed, the newest first, in one read of the
# store spanning at most HULL_S seconds (a page opened on a minute of stalls catches up over a
# few redraws)
MAX_NEW = 40
HULL_S = 10.0

# a culprit is named in a stall's hover when it took at least this share of the excess
NOTE_SHARE = 0.05

Key = tuple[str, str, str, int]  # engine, run, request, step of the stalled token


@dataclass
class StallBlame:
    """Blamed stalls by (engine, run, request, step): the ``blame_tokens`` row, or None where
    the ledger had no figure for it (the fit failed, or the gap was not in the read)."""

    held: dict[Key, dict[str, Any] | None] = field(default_factory=dict)
    reads: int = 0  # how many times the store was read (a redraw with nothing new reads nothing)
    error: str | None = None  # why the last read gave no ledger

    @staticmethod
    def key(row: Any) -> Key:
        return (str(row.engine_id), str(row.run_id), str(row.request_id), int(row.step))

    def update(
        self, stalls: pd.DataFrame, compute: Callable[[str, str, pd.DataFrame], pd.DataFrame]
    ) -> None:
        """Blame the newest stalls not held yet (``compute(engine, run, tokens)`` is
        ``advisor.blame_store.blame_tokens`` with its store and model) and forget the ones no
        longer in ``stalls``. A ``compute`` that raises leaves them to the next redraw (and
        says why in ``error``)."""
        keys = [self.key(r) for r in stalls.itertuples()]
        live = set(keys)
        self.held = {k: v for k, v in self.held.items() if k in live}
        todo = stalls[[k not in self.held for k in keys]]
        if todo.empty:
            return
        todo = todo.sort_values("time", ascending=False).head(MAX_NEW)
        newest = float(todo["time"].iloc[0])
        todo = todo[todo["time"] >= newest - HULL_S]
        first = todo.iloc[0]
        todo = todo[(todo["engine_id"] == first["engine_id"]) & (todo["run_id"] == first["run_id"])]
        self.reads += 1
        try:
            out = compute(str(first["engine_id"]), str(first["run_id"]), todo)
        except Exception as exc:  # noqa: BLE001 - no ledger yet (too few steps to fit, the
            # store unreadable): these stalls wait for the next redraw
            self.error = str(exc)
            return
        self.error = None
        found = {
            (str(first["engine_id"]), str(first["run_id"]), str(r["request_id"]), int(r["step"])): r
            for r in out.to_dict("records")
        }  # fmt: skip
        for k in (self.key(r) for r in todo.itertuples()):
            self.held[k] = found.get(k)

    def get(self, row: Any) -> dict[str, Any] | None:
        return self.held.get(self.key(row))

    def note(self, row: Any) -> str:
        """The hover text of one stall: its request and gap, and who caused it."""
        head = f"{row.request_id} token {int(row.k)}: {float(row.itl_ms):,.0f} ms"
        if self.key(row) not in self.held:
            return f"{head}<br>who caused it: being worked out"
        b = self.held[self.key(row)]
        if b is None:
            return f"{head}<br>who caused it: no ledger for this gap"
        if not b["culprits"]:
            return f"{head}<br>no other request in its steps: its own work and the engine's"
        lines = [f"{head}, {b['excess_ms']:,.0f} ms of it others"]
        for rid, ms in b["culprits"]:
            if ms >= max(1.0, NOTE_SHARE * b["excess_ms"]):
                lines.append(f"{describe(rid, b)}: {ms:,.0f} ms")
        return "<br>".join(lines)


def describe(rid: str, b: dict[str, Any]) -> str:
    """``cmpl-x (rag, 2,310 tokens)``: a culprit with its class and prompt length."""
    cls = b["classes"].get(rid)
    prompt = b["prompts"].get(rid)
    parts = [p for p in (cls, None if prompt is None else f"{int(prompt):,} tokens") if p]
    return f"{rid} ({', '.join(parts)})" if parts else rid


def stall_choices(
    stalls: pd.DataFrame, blame: StallBlame, limit: int = 50
) -> dict[str, tuple[str, str]]:
    """The ``limit`` newest blamed stalls with a culprit, for the page's picker: label -> (the
    victim's request id, its top culprit's)."""
    out: dict[str, tuple[str, str]] = {}
    for row in stalls.sort_values("time", ascending=False).itertuples():
        if len(out) >= limit:
            break
        b = blame.get(row)
        if b is None or not b["culprits"]:
            continue
        top, ms = b["culprits"][0]
        when = pd.to_datetime(float(row.time), unit="s").strftime("%H:%M:%S")
        label = (f"{when} · {row.request_id} token {int(row.k)} · {ms:,.0f} ms by "
                 f"{describe(top, b)}")  # fmt: skip
        out[label] = (str(row.request_id), str(top))
    return out
