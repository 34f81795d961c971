"""The Control page's autopilot switch and what the Live page draws of it. No Streamlit here.

The autopilot runs as a child process (``python -m advisor.autopilot_run``, the very program
``chunkscope autopilot`` runs), not a thread of the dashboard: its decision simulates a dozen
settings every second or two, which in the Streamlit process would take the GIL from every
page's script; a child is managed like the embedded collector and engine
(``dashboard.processes``: it dies with the dashboard), switching it off is its SIGTERM (it stores
``autopilot off: engine left at ...``), and a CLI autopilot and a dashboard one behave alike.

Its decisions are read back from the store: control events with source ``autopilot`` (changes
and statuses), whose reasons carry the predicted chat ITL p99 and TTFT p99
(``advisor.autopilot.parse_reason``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from advisor.autopilot import parse_reason
from advisor.autopilot_run import EXIT_PAUSED, SOURCE
from dashboard.processes import ManagedProcess, python_argv
from dashboard.services import child_env


@dataclass(frozen=True)
class SwitchSlo:
    itl_ms: float
    ttft_ms: float
    tail_itl_ms: float | None = None  # None: no SLO on the longest gap

    def check(self) -> None:
        for name, v in (("ITL p99", self.itl_ms), ("TTFT p99", self.ttft_ms)):
            if not v > 0:
                raise ValueError(f"the {name} SLO must be a positive number of ms, got {v:g}")
        if self.tail_itl_ms is not None and not self.tail_itl_ms > 0:
            raise ValueError(f"the ITL max SLO must be positive, got {self.tail_itl_ms:g}")

    def label(self) -> str:
        """The SLOs as the page says them: ``chat ITL p99 <= 250 ms, TTFT p99 <= 2000 ms``."""
        out = f"chat ITL p99 <= {self.itl_ms:g} ms, TTFT p99 <= {self.ttft_ms:g} ms"
        if self.tail_itl_ms is not None:
            out += f", ITL max <= {self.tail_itl_ms:g} ms"
        return out


class AutopilotSwitch:
    """At most one autopilot child per engine id, shared by every browser session."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._procs: dict[str, ManagedProcess] = {}
        self._slos: dict[str, SwitchSlo] = {}
        self._lock = threading.Lock()

    def argv(self, collector_url: str, engine_id: str, slo: SwitchSlo) -> list[str]:
        """The child's command line; its control token and the store's URL (which may hold a
        password) travel in its environment, never here (a command line is readable by every
        local user)."""
        args = ["--collector", collector_url, "--engine", engine_id,
                "--slo-itl-ms", f"{slo.itl_ms:g}", "--slo-ttft-ms", f"{slo.ttft_ms:g}"]  # fmt: skip
        if slo.tail_itl_ms is not None:
            args += ["--slo-itl-max-ms", f"{slo.tail_itl_ms:g}"]
        return python_argv("advisor.autopilot_run", *args)

    def start(
        self,
        collector_url: str,
        engine_id: str,
        db_url: str,
        slo: SwitchSlo,
        token: str | None = None,
    ) -> ManagedProcess:
        slo.check()
        with self._lock:
            old = self._procs.get(engine_id)
            if old is not None and old.alive():
                return old
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in engine_id)[:64]
            log = self.data_dir / "logs" / f"autopilot-{safe}.log"
            proc = ManagedProcess("autopilot", self.argv(collector_url, engine_id, slo), log).start(
                env=child_env(control=token, db_url=db_url)
            )
            self._procs[engine_id] = proc
            self._slos[engine_id] = slo
            return proc

    def stop(self, engine_id: str) -> None:
        with self._lock:
            proc = self._procs.get(engine_id)
        if proc is not None:
            proc.stop(grace=15.0)

    def state(self, engine_id: str) -> str:
        """``on``, ``off``, ``paused`` (a manual control won), or ``exited (N)``."""
        proc = self._procs.get(engine_id)
        if proc is None or proc.proc is None:
            return "off"
        rc = proc.returncode
        if rc is None:
            return "on"
        if rc == EXIT_PAUSED:
            return "paused"
        return "off" if proc.stopped or rc == 0 else f"exited ({rc})"

    def slo(self, engine_id: str) -> SwitchSlo | None:
        return self._slos.get(engine_id)

    def log_tail(self, engine_id: str) -> str:
        proc = self._procs.get(engine_id)
        return proc.log_tail(2000) if proc is not None else ""

    def stop_all(self) -> None:
        for engine_id in list(self._procs):
            self.stop(engine_id)


def autopilot_events(controls: pd.DataFrame | None) -> pd.DataFrame:
    """The autopilot's control events (changes and statuses) with the predictions their
    reasons name: columns ``time``, ``key``, ``old_value``, ``new_value``, ``change`` (the value
    moved), ``reason``, ``pred_itl_p99_ms``, ``pred_ttft_p99_ms``."""
    cols = ["time", "key", "old_value", "new_value", "change", "reason", "pred_itl_p99_ms",
            "pred_ttft_p99_ms"]  # fmt: skip
    if controls is None or controls.empty or "source" not in controls:
        return pd.DataFrame(columns=cols)
    c = controls[(controls["source"] == SOURCE) & controls["accepted"].astype(bool)].copy()
    if c.empty:
        return pd.DataFrame(columns=cols)
    preds = [parse_reason(r if isinstance(r, str) else None) for r in c["reason"]]
    c["pred_itl_p99_ms"] = [p[0] for p in preds]
    c["pred_ttft_p99_ms"] = [p[1] for p in preds]
    c["change"] = c["old_value"].astype(str) != c["new_value"].astype(str)
    return c[cols].reset_index(drop=True)


def latest_status(controls: pd.DataFrame | None, now: float | None = None) -> str | None:
    """The newest autopilot reason, with its age: what the page says it is doing."""
    ev = autopilot_events(controls)
    if ev.empty:
        return None
    last = ev.iloc[-1]
    age = (now if now is not None else time.time()) - float(last["time"])
    return f"{last['reason']} ({age:.0f} s ago)"
