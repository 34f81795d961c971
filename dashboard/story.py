"""Before and after a budget change, told plainly: which windows judge it, and what they say.

The windows either side of a change reach back (and forward) to the neighbouring change or
``MAX_WINDOW_S``, whichever is nearer, so each holds every long prompt that stalled a stream in
that time; the verdict leads with the stalls (``storage.stalls``) and says what the cut cost.
Pure functions: no Streamlit, no store.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

from storage.stalls import StallWindow, ratio

logger = logging.getLogger(__name__)

MAX_WINDOW_S = 120.0  # each side of a change, at most
MIN_WINDOW_S = 1.0


@dataclass(frozen=True)
class ChangeWindows:
    """The two sides of the change at ``t`` (wall seconds)."""

    t: float
    before: tuple[float, float]
    after: tuple[float, float] | None  # None: nothing after the change yet


def change_windows(
    t: float,
    others: list[float],
    *,
    first: float | None,
    latest: float | None,
    max_s: float = MAX_WINDOW_S,
) -> ChangeWindows:
    """The windows either side of the change at ``t``: back to the previous change in
    ``others`` (or the run's ``first`` data) and forward to the next one (or the ``latest``
    data), each at most ``max_s`` long."""
    if not max_s > 0:
        raise ValueError(f"window must be > 0 s, got {max_s}")
    prev = max((o for o in others if o < t), default=None)
    nxt = min((o for o in others if o > t), default=None)
    lo = t - max_s
    for edge in (prev, first):
        if edge is not None:
            lo = max(lo, edge)
    hi = t + max_s
    for edge in (nxt, latest):
        if edge is not None:
            hi = min(hi, edge)
    after = (t, hi) if hi - t >= MIN_WINDOW_S else None
    return ChangeWindows(t, (min(lo, t), t), after)


def _fmt_ms(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v / 1000:.2f} s" if v >= 10_000 else f"{v:,.0f} ms"


def times(before: float | None, after: float | None) -> str:
    """'7.2x shorter', '1.3x longer', 'the same' (within 5 %), '' when not comparable."""
    r = ratio(before, after)
    if r is None:
        return ""
    if abs(r - 1.0) < 0.05:
        return "the same"
    return f"{r:.1f}x shorter" if r > 1 else f"{1 / r:.1f}x longer"


def waiting_line(before: StallWindow, after: StallWindow | None, what: str) -> str | None:
    """What the page is waiting for, when a side holds no stall to judge the change by."""
    if not before.met:
        return (
            f"The {before.hi - before.lo:.0f} s before the change held no long prompt or image "
            f"that stalled a {what} stream, so there is no stall to compare with. Run traffic "
            "with long prompts among chat users (sidebar: `rag`, `vlm` or `mixed`) before "
            "changing the budget."
        )
    if after is None or not after.met:
        return (
            f"No long prompt or image has met a {what} stream since the change yet: wait for "
            "the next one (under `rag`, one every ~8 s; `vlm`, an image every ~7 s). This page "
            "updates as it lands."
        )
    return None


def headline(before: StallWindow, after: StallWindow, what: str) -> str:
    """The verdict in one sentence: how the worst stall changed."""
    word = times(before.stall_max_ms, after.stall_max_ms)
    lead = {"": "Stalls", "the same": "Stalls the same"}.get(word, f"Stalls {word}")
    return (
        f"**{lead}**: the worst {what} gap across a long prefill went from "
        f"{_fmt_ms(before.stall_max_ms)} to {_fmt_ms(after.stall_max_ms)} "
        f"(p99.9 {_fmt_ms(before.stall_p999_ms)} → {_fmt_ms(after.stall_p999_ms)})."
    )


def detail_lines(
    before: StallWindow,
    after: StallWindow,
    what: str,
    ttft_p99_ms: tuple[float | None, float | None],
) -> list[str]:
    """How much each side held, then what the change cost (TTFT), in plain sentences."""
    lines = [
        f"Before ({before.hi - before.lo:.0f} s): {before.long_met} long prompt(s) or image(s) "
        f"stalled {what} streams, {before.stalls} gap(s) in all. After "
        f"({after.hi - after.lo:.0f} s): {after.long_met}, {after.stalls} gap(s) "
        "(smaller chunks stall more often, each for less).",
    ]
    cost = []
    lt = (before.long_ttft_p50_ms, after.long_ttft_p50_ms)
    if lt[0] is not None and lt[1] is not None:
        cost.append(
            f"long prompts wait longer for their first token: TTFT p50 {_fmt_ms(lt[0])} → "
            f"{_fmt_ms(lt[1])}"
            if lt[1] > lt[0] * 1.05
            else f"long prompts' TTFT p50 {_fmt_ms(lt[0])} → {_fmt_ms(lt[1])}"
        )
    a, b = ttft_p99_ms
    if a is not None and b is not None:
        cost.append(f"{what} TTFT p99 {_fmt_ms(a)} → {_fmt_ms(b)} ({times(a, b) or 'n/a'})")
    if cost:
        lines.append("What it cost: " + "; ".join(cost) + ".")
    return lines


def ms_value(v: float | None) -> str:
    """A metric's value: whole milliseconds, '—' when missing."""
    return "—" if v is None else f"{v:,.0f}"


def delta_color(before: float | None, after: float | None) -> Literal["normal", "inverse", "off"]:
    """Streamlit's delta colour for a lower-is-better figure: green when it got shorter."""
    r = ratio(before, after)
    if r is None or abs(r - 1.0) < 0.05:
        return "off"
    return "normal" if r > 1 else "inverse"


def delta_arrow(before: float | None, after: float | None) -> Literal["up", "down", "off"]:
    """Down when the figure got shorter, up when longer, off otherwise."""
    r = ratio(before, after)
    if r is None or abs(r - 1.0) < 0.05:
        return "off"
    return "down" if r > 1 else "up"


def change_line(label: str, t: float, before: StallWindow, after: StallWindow) -> str:
    """One line for the Live page: the change, and the stalls (chat gaps across a long
    prefill) in the windows either side: how many and how tall the worst."""

    def side(w: StallWindow) -> str:
        span = f"{w.hi - w.lo:.0f} s"
        if not w.met:
            return f"none in {span}"
        return f"{w.stalls} in {span}, the worst {_fmt_ms(w.stall_max_ms)}"

    word = times(before.stall_max_ms, after.stall_max_ms) if before.met and after.met else ""
    when = time.strftime("%H:%M:%S", time.gmtime(t))
    return (
        f"**{label}** at {when} UTC · chat gaps across a long prefill, before: {side(before)}"
        f" · after: {side(after)}" + (f" · **the worst {word}**" if word else "")
    )
