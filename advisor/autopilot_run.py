"""``chunkscope autopilot``: steer one engine's token budget and long-prefill cap to the SLOs,
live, through the collector's relay.

Every ``--interval`` seconds it reads the store as the dashboard does (``storage.queries``): the
requests that arrived in the last ``--lookback`` seconds (queued ones included), the steps of the
last ``--fit-window`` seconds (to refit the step-cost model, at most every ``--refit-every``
seconds) and of the last ``--noise-window`` seconds (the scatter and pauses its predictions
draw, ``advisor.fit.recent_noise``), what was observed; it asks
``advisor.autopilot.Autopilot`` for a decision and, on a change, sends one control through
``storage.control`` (the one control client) with ``source: "autopilot"`` and the decision's
reason, which the collector stores on the engine's control events. The next tick waits longer
when this one took more than ``--max-cpu-share`` of a core: on a small machine the autopilot's
CPU is the engine's, and a burst's queue is the costliest to simulate just when the engine is
shortest of it.

What it stores besides changes: a *status* (a control that sets the budget it already has: a
control event with no change, source ``autopilot``, its reason saying why it holds, refuses or
fell back, with the predictions it holds on) when the kind of decision changes, and at most every
``--status-every`` seconds otherwise; ``autopilot on`` at the start and ``autopilot off: engine
left at ...`` when it is switched off (SIGTERM/SIGINT). Killed outright, it leaves the engine
at its last setting, which is the last control event stored.

The operator wins: an accepted control from anyone else (``source`` not ``autopilot``) after it
started pauses it: it stores ``autopilot paused`` and exits (exit status 3); starting it again
re-enables it, from the engine's setting then.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from advisor.autopilot import (
    Autopilot,
    AutopilotConfig,
    AutopilotSlo,
    Decision,
    Observed,
    Setting,
    candidates,
)
from advisor.fit import FitError, FitReport, fit_from_store, load_steps, with_recent_noise
from advisor.simulate import ITL_CLASS
from advisor.traffic import ObservedRequest, Traffic, engine_shape, observed_load
from storage import queries
from storage.control import CollectorUnavailable, list_engines, send_control
from wire import credentials
from wire.control import CAP_KEY, MAX_REASON_CHARS

logger = logging.getLogger("chunkscope.autopilot")

SOURCE = "autopilot"
EXIT_PAUSED = 3
DEFAULT_BUDGETS = (256, 512, 1024, 2048, 4096, 16384)
DEFAULT_CAPS = (0, 128, 512)
NOISE_REFRESH_S = 5.0  # the recent scatter is redrawn at most this often (for the same fit)
DEFAULT_OUTPUT_TOKENS = 64  # assumed output of a queued request when no finished one says more


def lookback_start(db: Engine, *, engine_id: str, run_id: str | None, since: float) -> float:
    """``since`` moved back to the start of the step the engine was running at ``since`` (itself
    when none was). A replay starts from an idle engine, so its window must start where the
    engine was between steps: started mid-step, the replay would redo that whole step from the
    window's start while the engine finished it sooner (a tick on the demo engine at budget
    4096 began 2.1 s into a 3.5 s step)."""
    st = queries.steps(db, engine_id=engine_id, run_id=run_id, until=since, limit=1)
    if st.empty:
        return since
    last = st.loc[st["start"].idxmax()]
    return float(last["start"]) if float(last["end"]) > since else since


PROGRESS_STEPS = 256  # the steps read back for the backlog's prefill progress


def prefill_progress(
    db: Engine, *, engine_id: str, run_id: str | None, request_ids: set[str], until: float
) -> dict[str, int]:
    """How far each of ``request_ids`` had been prefilled by ``until`` (its cached tokens
    included): the end of its furthest prefill chunk among the last ``PROGRESS_STEPS`` steps
    that ended by then. A request being prefilled gets a chunk most steps (running requests
    come first), so its last chunk is among them; one left out that long counts as not
    started."""
    if not request_ids:
        return {}
    st = queries.steps(db, engine_id=engine_id, run_id=run_id, until=until, limit=PROGRESS_STEPS)
    st = st[st["end"] <= until]
    out: dict[str, int] = {}
    for (eid, rid), g in st.groupby(["engine_id", "run_id"], sort=False):
        ch = queries.step_chunks(
            db, engine_id=eid, run_id=rid, step_from=int(g["step"].min()),
            step_to=int(g["step"].max()),
        )  # fmt: skip
        ch = ch[ch["step"].isin(g["step"]) & (ch["kind"] == "prefill")]
        ch = ch[ch["request_id"].isin(request_ids)]
        for req, end in (ch["start"] + ch["num_tokens"]).groupby(ch["request_id"]).max().items():
            out[str(req)] = max(out.get(str(req), 0), int(end))
    return out


def recent_traffic(
    db: Engine, *, engine_id: str, run_id: str | None, since: float, until: float
) -> Traffic:
    """Requests that arrived in [since, until], the queued and running ones included, and the
    backlog: requests that arrived earlier and still had no first token at ``since`` (a burst
    the engine is still working through), replayed as arriving at ``since`` with the prompt
    tokens the engine had prefilled by then (:func:`prefill_progress`) already computed. A
    queued request's output length is the median of the finished ones of its class (a running
    one's at least that), since the store cannot know it yet. ``since`` should be a step
    boundary (:func:`lookback_start`)."""
    df = queries.requests(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
    df = _window_requests(df, since, until)
    if df.empty:
        return Traffic([], since, until)
    backlog = df["arrival"] < since
    progress = prefill_progress(
        db,
        engine_id=engine_id,
        run_id=run_id,
        request_ids=set(df.loc[backlog, "request_id"].astype(str)),
        until=since,
    )
    df.loc[backlog, "arrival"] = since
    done = df[df["finished"].notna()]
    medians = done.groupby(done["traffic_class"].fillna(""))["num_output_tokens"].median()
    overall = float(done["num_output_tokens"].median()) if not done.empty else math.nan
    fallback = DEFAULT_OUTPUT_TOKENS if math.isnan(overall) else int(overall)
    reqs = []
    for r in df.sort_values("arrival", kind="stable").itertuples(index=False):
        cls = None if pd.isna(r.traffic_class) else str(r.traffic_class)
        out = int(r.num_output_tokens or 0)
        if pd.isna(r.finished):
            med = medians.get(cls or "")
            out = max(out, fallback if med is None or pd.isna(med) else int(med))
        reqs.append(
            ObservedRequest(
                request_id=str(r.request_id),
                traffic_class=cls,
                arrival=float(r.arrival),
                num_prompt_tokens=int(r.num_prompt_tokens),
                num_image_tokens=int(r.num_image_tokens or 0),
                num_cached_tokens=int(r.num_cached_tokens or 0),
                num_output_tokens=max(1, out),
                num_computed_tokens=progress.get(str(r.request_id), 0),
            )
        )
    return Traffic(reqs, since, until)


def _window_requests(df: pd.DataFrame, since: float, until: float) -> pd.DataFrame:
    """The requests a tick replays: arrived in [since, until], and the backlog (arrived earlier,
    no first token at ``since``), still at its own arrival (before ``since``)."""
    if df.empty:
        return df
    df = df[df["arrival"].notna() & (df["arrival"] <= until)]
    backlog = (df["arrival"] < since) & (df["first_token"].isna() | (df["first_token"] > since))
    return df[backlog | (df["arrival"] >= since)].copy()


def observed(
    db: Engine, *, engine_id: str, run_id: str | None, since: float, until: float, steady: bool
) -> Observed:
    """Chat ITL p99 and TTFT p99 of the requests a tick replays (``recent_traffic``), as far as
    they went by ``until``: the gaps of their tokens so far, and TTFT cut at ``until`` for the
    ones still waiting (the prediction's ``*_seen`` figures count the same way)."""
    req = queries.requests(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
    req = _window_requests(req, since, until)
    if req.empty:
        ttft = np.empty(0)
    else:
        first = req["first_token"].where(req["first_token"] <= until, until).fillna(until)
        # the backlog's TTFT counts from the window's start, as the replay has it arrive
        ttft = ((first - req["arrival"].clip(lower=since)) * 1e3).to_numpy(dtype=float)
    itl = queries.token_itl(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
    ids = set(req["request_id"]) if not req.empty else set()
    itl = itl[itl["request_id"].isin(ids)] if not itl.empty else itl
    chat = itl[itl["traffic_class"] == ITL_CLASS] if not itl.empty else itl
    gaps = (chat if not chat.empty else itl)["itl_ms"].to_numpy(dtype=float)
    return Observed(
        itl_p99_ms=float(np.percentile(gaps, 99)) if gaps.size else None,
        ttft_p99_ms=float(np.percentile(ttft, 99)) if ttft.size else None,
        num_requests=len(req),
        steady=steady,
    )


def foreign_control(
    db: Engine, *, engine_id: str, run_id: str | None, since: float
) -> dict[str, Any] | None:
    """The first accepted control since ``since`` that the autopilot did not send."""
    c = queries.controls(db, engine_id=engine_id, run_id=run_id, since=since)
    if c.empty:
        return None
    c = c[c["accepted"].astype(bool) & (c["source"] != SOURCE) & (c["time"] >= since)]
    return None if c.empty else dict(c.iloc[0])


def changed_since(db: Engine, *, engine_id: str, run_id: str | None, since: float) -> bool:
    """Whether the budget or cap changed in [since, now] (by anyone)."""
    c = queries.controls(db, engine_id=engine_id, run_id=run_id, since=since)
    if c.empty:
        return False
    c = c[c["accepted"].astype(bool) & c["key"].isin(["token_budget", CAP_KEY])]
    return bool((c["old_value"].astype(str) != c["new_value"].astype(str)).any())


@dataclass
class Options:
    collector: str
    engine_id: str
    db_url: str
    slo: AutopilotSlo
    interval_s: float = 2.0
    lookback_s: float = 20.0
    fit_window_s: float = 120.0
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    caps: tuple[int, ...] = DEFAULT_CAPS
    status_every_s: float = 10.0
    token: str | None = None
    auth_token: str | None = None
    log_path: str | None = None
    max_ticks: int | None = None
    min_dwell_s: float = 4.0
    max_fit_err: float = 0.6
    min_fit_r2: float = 0.5
    min_requests: int = 5
    probe_tokens: int | None = None  # None: the engine's max_model_len
    fallback_hold_s: float | None = None  # None: three look-backs
    refit_every_s: float = 10.0
    # the step times' scatter and pauses are drawn from the steps of this many seconds before
    # each tick (the fit window's beyond them, or when too few: ``advisor.fit.recent_noise``);
    # 0: the fit window's throughout
    noise_window_s: float = 30.0
    # the share of one core its ticks may take: after a tick of c CPU seconds the next starts
    # no sooner than c / max_cpu_share seconds after it began (and never sooner than interval_s)
    max_cpu_share: float = 0.2


def tick_wait_s(interval_s: float, cpu_s: float, max_cpu_share: float) -> float:
    """Seconds from a tick's start to the next: ``interval_s``, or longer where the tick took
    more than ``max_cpu_share`` of a core over that (a tick in a burst replays a long queue at
    every setting, on the CPU the engine is short of)."""
    return max(interval_s, cpu_s / max_cpu_share)


class Runner:
    """One autopilot attached to one engine through one collector."""

    def __init__(self, opts: Options) -> None:
        from storage import db as dbm

        self.opts = opts
        self.db = dbm.connect(opts.db_url, readonly=True)
        self.stopping = False
        self.paused_by: dict[str, Any] | None = None
        self._ids = 0
        self._last_status: tuple[str, float] | None = None
        self._log = Path(opts.log_path).open("a") if opts.log_path else None
        row = self._engine_row()
        self.run_id = str(row.get("run_id")) if row.get("run_id") else None
        self.cap_supported = row.get(CAP_KEY) is not None
        start = Setting(int(row["token_budget"]), int(row.get(CAP_KEY) or 0))
        grid = candidates(
            opts.budgets,
            opts.caps,
            max_token_budget=row.get("max_token_budget"),
            cap_supported=self.cap_supported,
        )
        config = AutopilotConfig(
            candidates=tuple(grid),
            start=start,
            min_dwell_s=opts.min_dwell_s,
            max_fit_err=opts.max_fit_err,
            min_fit_r2=opts.min_fit_r2,
            min_requests=opts.min_requests,
            probe_tokens=opts.probe_tokens,
            # after a fallback, hold until the look-back has seen the operator's setting alone
            # (and then some): a fixed minute outlasts a burst, and the bursts are what it steers
            fallback_hold_s=(
                opts.fallback_hold_s if opts.fallback_hold_s is not None else 3 * opts.lookback_s
            ),
            # parted for a whole look-back: ticks an interval apart replay nearly one window,
            # and one window's p99 of a few requests is one noisy number
            part_span_s=opts.lookback_s,
        )
        self.pilot = Autopilot(config, opts.slo)
        self.started = time.time()
        self._fit_at: tuple[float, FitReport] | None = None
        # (when, the fit it was drawn for, that fit with the recent scatter, steps drawn from)
        self._noise_at: tuple[float, FitReport, FitReport, int] | None = None
        self.last_tick_cpu_s = 0.0

    def _engine_row(self) -> dict[str, Any]:
        for e in list_engines(self.opts.collector, auth_token=self.opts.auth_token):
            if e.get("engine_id") == self.opts.engine_id:
                if not e.get("connected"):
                    raise RuntimeError(f"engine {self.opts.engine_id!r} is not connected")
                if not isinstance(e.get("token_budget"), int):
                    raise RuntimeError(f"engine {self.opts.engine_id!r} reports no token budget")
                return e
        raise RuntimeError(
            f"the collector at {self.opts.collector} has not seen engine {self.opts.engine_id!r}"
        )

    # -- steering ---------------------------------------------------------------------------

    def _send(self, changes: dict[str, Any], reason: str) -> dict[str, Any]:
        self._ids += 1
        ack = send_control(
            self.opts.collector,
            self.opts.engine_id,
            changes,
            token=self.opts.token,
            auth_token=self.opts.auth_token,
            control_id=f"autopilot-{self.started:.0f}-{self._ids}",
            source=SOURCE,
            reason=reason[:MAX_REASON_CHARS],
        )
        if not ack.get("ok"):
            logger.warning("control %s refused: %s", changes, ack.get("error"))
        return ack

    def status(self, kind: str, reason: str, *, force: bool = False) -> None:
        """Store a status (a control event with no change), bounded in rate."""
        now = time.time()
        last = self._last_status
        if not force and last is not None:
            if last[0] == kind and now - last[1] < self.opts.status_every_s:
                return
        if self._operator_won():
            return
        self._last_status = (kind, now)
        self._send({"token_budget": self.pilot.current.budget}, reason)

    def apply(self, d: Decision) -> bool:
        changes: dict[str, Any] = {}
        if d.setting.budget != d.previous.budget:
            changes["token_budget"] = d.setting.budget
        if self.cap_supported and d.setting.cap != d.previous.cap:
            changes[CAP_KEY] = d.setting.cap
        if self._operator_won():
            return False
        ack = self._send(changes, d.reason)
        if ack.get("ok"):
            self.pilot.moved(d.setting, time.time())
            self._last_status = (d.kind, time.time())
            return True
        return False

    # -- one tick ---------------------------------------------------------------------------

    def moved_by_someone(self) -> dict[str, Any] | None:
        """The engine's setting as the collector knows it (updated on every accepted control's
        answer, before the store has the event), when it is not the one the autopilot left it
        at: someone else moved it."""
        row = self._engine_row()
        cur = self.pilot.current
        budget, cap = row.get("token_budget"), row.get(CAP_KEY)
        if budget != cur.budget:
            return {"key": "token_budget", "old_value": cur.budget, "new_value": budget,
                    "source": "another client"}  # fmt: skip
        if self.cap_supported and cap is not None and cap != cur.cap:
            return {"key": CAP_KEY, "old_value": cur.cap, "new_value": cap,
                    "source": "another client"}  # fmt: skip
        return None

    def _operator_won(self) -> bool:
        """Checked right before anything is sent: a manual change made while the autopilot was
        deciding must not be overwritten."""
        foreign = self.moved_by_someone()
        if foreign is not None:
            self.paused(foreign)
        return foreign is not None

    def tick(self) -> Decision | None:
        o, now = self.opts, time.time()
        cpu0 = time.process_time()
        foreign = (
            foreign_control(self.db, engine_id=o.engine_id, run_id=self.run_id, since=self.started)
            or self.moved_by_someone()
        )
        if foreign is not None:
            self.paused(foreign)
            return None
        since = lookback_start(
            self.db, engine_id=o.engine_id, run_id=self.run_id, since=now - o.lookback_s
        )
        fit = self._fit(now)
        fit, noise_steps = self._recent_noise(fit, now)
        traffic = recent_traffic(
            self.db, engine_id=o.engine_id, run_id=self.run_id, since=since, until=now
        )
        shape = engine_shape(self.db, engine_id=o.engine_id, run_id=self.run_id)
        steady = not changed_since(self.db, engine_id=o.engine_id, run_id=self.run_id, since=since)
        obs = observed(
            self.db, engine_id=o.engine_id, run_id=self.run_id, since=since, until=now,
            steady=steady,
        )  # fmt: skip
        load = observed_load(
            self.db, engine_id=o.engine_id, run_id=self.run_id, since=since, until=now
        )
        d = self.pilot.decide(now, fit, traffic, shape, obs, load)
        decided_s = time.time() - now
        self.last_tick_cpu_s = time.process_time() - cpu0
        logger.info("%s", d.reason)
        if d.changes:
            self.apply(d)
        else:
            self.status(d.kind, d.reason)
        if self._log is not None:
            entry = {
                "time": now,
                **d.to_dict(),
                "observed": obs.__dict__,
                "fit_error": fit if isinstance(fit, str) else None,
                # the steps the scatter was drawn from (0: the fit window's, too few recent)
                "noise_steps": noise_steps,
                # the tick's own time, reads and fit included: what a decision lags the store
                "tick_s": decided_s,
                # its CPU: what it took from the engine, on a machine they share
                "tick_cpu_s": self.last_tick_cpu_s,
                "next_tick_in_s": self.next_tick_in(),
                "num_arrivals": len(traffic.requests),
            }
            self._log.write(json.dumps(entry) + "\n")
            self._log.flush()
        return d

    def next_tick_in(self) -> float:
        """Seconds from this tick's start to the next (:func:`tick_wait_s`)."""
        return tick_wait_s(self.opts.interval_s, self.last_tick_cpu_s, self.opts.max_cpu_share)

    def _recent_noise(self, fit: FitReport | str, now: float) -> tuple[FitReport | str, int]:
        """``fit`` drawing the scatter of the last ``noise_window_s`` seconds of steps
        (``advisor.fit.with_recent_noise``) and how many steps that was; redrawn at most every
        ``NOISE_REFRESH_S`` seconds for the same fit (reading seconds of steps costs a tick a
        third of its simulations on the demo engine's 2.5 ms steps)."""
        o = self.opts
        if not isinstance(fit, FitReport) or o.noise_window_s <= 0:
            return fit, 0
        held = self._noise_at
        if held is not None and held[1] is fit and now - held[0] < NOISE_REFRESH_S:
            return held[2], held[3]
        recent = load_steps(
            self.db, engine_id=o.engine_id, run_id=self.run_id,
            since=now - o.noise_window_s, until=now,
        )  # fmt: skip
        drawn, n = with_recent_noise(fit, recent)
        self._noise_at = (now, fit, drawn, n)
        return drawn, n

    def _fit(self, now: float) -> FitReport | str:
        """The step-cost fit on the last ``fit_window_s`` of steps, refitted at most every
        ``refit_every_s`` (a fit over minutes of steps moves little in seconds, and on a small
        machine the autopilot's CPU is taken from the engine it steers); the reason instead
        when none can be fitted (retried next tick)."""
        o = self.opts
        if self._fit_at is not None and now - self._fit_at[0] < o.refit_every_s:
            return self._fit_at[1]
        try:
            # no resampled refits (FitReport.boot): the decision has its own gate on the fit
            fit = fit_from_store(
                self.db,
                engine_id=o.engine_id,
                run_id=self.run_id,
                since=now - o.fit_window_s,
                resamples=0,
            )
        except FitError as exc:
            self._fit_at = None
            return str(exc)
        self._fit_at = (now, fit)
        return fit

    def paused(self, foreign: dict[str, Any]) -> None:
        who = foreign.get("source")
        what = f"{foreign.get('key')} {foreign.get('old_value')} -> {foreign.get('new_value')}"
        reason = (
            f"autopilot paused: a manual control ({what}, source {who}) wins; the engine stays "
            "where the operator put it until the autopilot is switched on again"
        )
        logger.warning("%s", reason)
        self.stopping = True
        self.paused_by = foreign
        try:  # the status must not undo the operator's change: it sets what is in force now
            row = self._engine_row()
            self._send({"token_budget": int(row["token_budget"])}, reason)
        except (CollectorUnavailable, RuntimeError) as exc:
            logger.warning("could not store the pause: %s", exc)

    def run(self) -> int:
        o = self.opts
        self.status(
            "on",
            f"autopilot on: {len(self.pilot.config.candidates)} candidate settings, SLOs "
            f"{o.slo.text()}, starting from the operator's {self.pilot.current.label()}",
            force=True,
        )
        ticks = 0
        while not self.stopping:
            t0 = time.monotonic()
            self.last_tick_cpu_s = 0.0
            try:
                self.tick()
            except CollectorUnavailable as exc:
                logger.warning("collector unavailable: %s (the engine keeps its setting)", exc)
            ticks += 1
            if o.max_ticks is not None and ticks >= o.max_ticks:
                break
            wait = self.next_tick_in()
            while not self.stopping and time.monotonic() - t0 < wait:
                time.sleep(min(0.2, wait))
        if self.paused_by is not None:
            return EXIT_PAUSED
        self.off()
        return 0

    def off(self) -> None:
        reason = f"autopilot off: engine left at {self.pilot.current.label()}"
        logger.info("%s", reason)
        try:
            self._send({"token_budget": self.pilot.current.budget}, reason)
        except (CollectorUnavailable, RuntimeError) as exc:
            logger.warning("could not store the switch-off: %s", exc)
        self.db.dispose()


# ---- command line -----------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected integers like 256,1024, got {text!r}") from exc
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return vals


def _class_slo(text: str) -> tuple[str, float]:
    name, sep, ms = text.partition("=")
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if not sep or not name or value <= 0:
        raise argparse.ArgumentTypeError(f"expected CLASS=MS such as rag=8000, got {text!r}")
    return name, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chunkscope autopilot",
        description="Set the SLOs; the autopilot sets the engine's token budget and long-prefill "
        "cap live through the collector, and stores why.",
    )
    p.add_argument("--collector", required=True, help="collector URL, ws://HOST:PORT")
    p.add_argument("--engine", required=True, help="engine id to steer")
    p.add_argument(
        "--db",
        default=credentials.from_env(credentials.DB_URL_ENV) or "sqlite:///data/chunkscope.db",
        help="the collector's store, read as the dashboard reads it (default "
        f"${credentials.DB_URL_ENV}, else sqlite:///data/chunkscope.db, the collector's default)",
    )
    p.add_argument("--slo-itl-ms", type=float, required=True, help="chat ITL p99 SLO (ms)")
    p.add_argument("--slo-ttft-ms", type=float, required=True, help="TTFT p99 SLO (ms)")
    p.add_argument(
        "--slo-itl-max-ms", type=float, default=None, help="SLO on each request's longest gap"
    )
    p.add_argument(
        "--slo-ttft-class",
        type=_class_slo,
        action="append",
        default=[],
        metavar="CLASS=MS",
        help="TTFT SLO of one traffic class (repeatable), e.g. rag=8000",
    )
    p.add_argument("--interval", type=float, default=2.0, help="seconds between decisions")
    p.add_argument("--lookback", type=float, default=20.0, help="seconds of traffic replayed")
    p.add_argument("--fit-window", type=float, default=120.0, help="seconds of steps fitted")
    p.add_argument("--min-dwell", type=float, default=4.0, help="seconds between changes")
    p.add_argument(
        "--refit-every", type=float, default=10.0, help="seconds between refits of the step cost"
    )
    p.add_argument(
        "--noise-window",
        type=float,
        default=30.0,
        help="seconds of steps before each decision whose scatter and pauses the predictions "
        "draw (30; the fit window's for longer steps than theirs, or when fewer than 50; "
        "0: the fit window's always; redrawn at most every 5 s): the machine's speed moves "
        "faster than a fit can follow",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=10,
        help="lower the autopilot's CPU priority by this much (0: not): on a small machine its "
        "simulations compete with the engine it steers",
    )
    p.add_argument(
        "--max-cpu-share",
        type=float,
        default=0.2,
        help="the share of one core its decisions may take (0.2): after a tick of c CPU "
        "seconds the next waits at least c / share seconds, so a burst's long queue, costly "
        "to simulate, does not slow the engine it steers",
    )
    p.add_argument(
        "--max-fit-err",
        type=float,
        default=0.6,
        help="no decision while the step-cost fit's relative error p50 is above this (0.6)",
    )
    p.add_argument(
        "--min-fit-r2", type=float, default=0.5, help="no decision while the fit's R^2 is below"
    )
    p.add_argument(
        "--min-requests", type=int, default=5, help="no decision on fewer arrivals in the look-back"
    )
    p.add_argument(
        "--probe-tokens",
        type=int,
        default=None,
        help="among settings the traffic does not tell apart, prefer those where a prompt this "
        "long arriving now would stall chat streams least: within the ITL SLO, else within the "
        "fewest doublings of it (default: the engine's max_model_len; 0: no such preference)",
    )
    p.add_argument(
        "--fallback-hold",
        type=float,
        default=None,
        help="seconds it holds the operator's setting after a fallback (default 3 look-backs)",
    )
    p.add_argument("--budgets", type=_ints, default=DEFAULT_BUDGETS, help="candidate budgets")
    p.add_argument("--caps", type=_ints, default=DEFAULT_CAPS, help="candidate caps (0 = off)")
    p.add_argument("--status-every", type=float, default=10.0, help="seconds between statuses")
    p.add_argument(
        "--token",
        default=credentials.from_env(credentials.CONTROL_ENV),
        help=f"the collector's control token (default: ${credentials.CONTROL_ENV})",
    )
    p.add_argument(
        "--auth-token",
        default=credentials.from_env(credentials.LEGACY_ENV),
        help=f"the collector's --auth-token (default: ${credentials.LEGACY_ENV})",
    )
    p.add_argument("--log", default=None, help="append every decision as JSON lines here")
    p.add_argument("--max-ticks", type=int, default=None, help="stop after N decisions")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s")
    try:
        slo = AutopilotSlo(
            args.slo_itl_ms, args.slo_ttft_ms, args.slo_itl_max_ms, dict(args.slo_ttft_class)
        )
        for name, v in (("--interval", args.interval), ("--lookback", args.lookback)):
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if args.noise_window < 0:
            raise ValueError(f"--noise-window must be >= 0, got {args.noise_window}")
        if not 0 < args.max_cpu_share <= 1:
            raise ValueError(f"--max-cpu-share must be in (0, 1], got {args.max_cpu_share}")
        if args.probe_tokens is not None and args.probe_tokens < 0:
            raise ValueError(f"--probe-tokens must be >= 0, got {args.probe_tokens}")
        opts = Options(
            collector=args.collector,
            engine_id=args.engine,
            db_url=args.db,
            slo=slo,
            interval_s=args.interval,
            lookback_s=args.lookback,
            fit_window_s=args.fit_window,
            budgets=args.budgets,
            caps=args.caps,
            status_every_s=args.status_every,
            token=args.token,
            auth_token=args.auth_token,
            log_path=args.log,
            max_ticks=args.max_ticks,
            min_dwell_s=args.min_dwell,
            max_fit_err=args.max_fit_err,
            min_fit_r2=args.min_fit_r2,
            min_requests=args.min_requests,
            probe_tokens=args.probe_tokens,
            fallback_hold_s=args.fallback_hold,
            refit_every_s=args.refit_every,
            noise_window_s=args.noise_window,
            max_cpu_share=args.max_cpu_share,
        )
        runner = Runner(opts)
    except (ValueError, RuntimeError, CollectorUnavailable) as exc:
        print(f"chunkscope autopilot: {exc}", file=sys.stderr)
        return 2

    if args.nice > 0 and hasattr(os, "nice"):
        os.nice(args.nice)

    def stop(signum: int, _frame: Any) -> None:
        runner.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(
        f"chunkscope autopilot steering {args.engine} via {args.collector}: "
        f"{runner.pilot.current.label()}, SLOs {slo.text()}",
        flush=True,
    )
    return runner.run()


if __name__ == "__main__":
    raise SystemExit(main())
