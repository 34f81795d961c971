"""Where a step's wall time went: CPU, waiting for a CPU, garbage collection. No torch.

A step that takes longer than its work predicts either computed slower or did not run: on a
small machine the step's threads (the caller's and the numeric library's workers) wait on the
run queue while other processes run, and a parallel region is as slow as its slowest thread.
``StepTracer`` reads, around each step, this process's CPU time, every thread's run-queue wait
and involuntary context switches (Linux ``/proc/self/task/*/schedstat`` and ``status``) and the
time spent in the garbage collector (``gc.callbacks``), and writes one JSON line per step.

The engine core writes such a trace when ``CHUNKSCOPE_STEP_TRACE`` names a file (a diagnostic:
reading ``/proc`` costs ~0.1 ms a step); ``benchmarks/stall.py`` reads it next to the step
events.
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import IO, Any

ENV_VAR = "CHUNKSCOPE_STEP_TRACE"
_TASKS = Path("/proc/self/task")


def _sched_totals() -> tuple[int, int, int]:
    """(run-queue wait ns, involuntary context switches, threads) summed over this process's
    threads; zeros where /proc is missing."""
    wait = nivcsw = n = 0
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return 0, 0, 0
    for tid in tids:
        try:
            with open(_TASKS / tid / "schedstat", "rb") as f:
                wait += int(f.read().split()[1])
            with open(_TASKS / tid / "status", "rb") as f:
                for line in f:
                    if line.startswith(b"nonvoluntary_ctxt_switches"):
                        nivcsw += int(line.split()[1])
                        break
            n += 1
        except (OSError, IndexError, ValueError):  # the thread ended meanwhile
            continue
    return wait, nivcsw, n


class StepTracer:
    """Per-step accounting of this process, one JSON object per step to ``out``."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.gc_ns = 0
        self.gc_count = 0
        self._gc_t0 = 0
        self._before: tuple[int, int, int, int, int, int] | None = None
        gc.callbacks.append(self._on_gc)

    @classmethod
    def from_env(cls) -> StepTracer | None:
        path = os.environ.get(ENV_VAR)
        if not path:
            return None
        return cls(open(path, "a", buffering=1 << 16))  # noqa: SIM115 - closed by close()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter_ns()
        else:
            self.gc_ns += time.perf_counter_ns() - self._gc_t0
            self.gc_count += 1

    def _sample(self) -> tuple[int, int, int, int, int, int]:
        wait, nivcsw, _ = _sched_totals()
        return (
            time.monotonic_ns(),
            time.process_time_ns(),
            wait,
            nivcsw,
            self.gc_ns,
            self.gc_count,
        )

    def begin(self) -> None:
        self._before = self._sample()

    def end(self, step: int | None, **extra: Any) -> None:
        if self._before is None:
            return
        after = self._sample()
        b, self._before = self._before, None
        rec = {
            "step": step,
            "start_ns": b[0],
            "wall_ns": after[0] - b[0],
            "cpu_ns": after[1] - b[1],
            "runq_wait_ns": after[2] - b[2],
            "nivcsw": after[3] - b[3],
            "gc_ns": after[4] - b[4],
            "gc_count": after[5] - b[5],
            **extra,
        }
        self.out.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self.out.close()


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The records of a trace file (a partial last line is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
