"""The engine core behind a server leaves a CPU to the HTTP side, freezes its start-up objects,
and can account for each step's time (``CHUNKSCOPE_STEP_TRACE``). No timing is asserted."""

from __future__ import annotations

import asyncio
import gc
import io
import json
from pathlib import Path

import pytest

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.process.client import EngineClient
from engine.process.core import freeze_startup_objects
from engine.process.steptrace import ENV_VAR, StepTracer, read_trace
from engine.process.transport import default_core_threads, usable_cpus
from engine.server.cli import build_parser, config_from_args


def _config(**kw: object) -> EngineConfig:
    kw = {"model": "tiny", "device": "cpu", "max_model_len": 256, **kw}
    return EngineConfig(**kw)  # type: ignore[arg-type]


def test_default_core_threads_leaves_one_cpu() -> None:
    assert default_core_threads(1) == 1
    assert default_core_threads(2) == 1
    assert default_core_threads(16) == 15
    assert default_core_threads() == max(1, usable_cpus() - 1)


def test_cpu_threads_is_validated() -> None:
    with pytest.raises(ValueError, match="cpu_threads"):
        _config(cpu_threads=0).validate()
    with pytest.raises(TypeError, match="cpu_threads"):
        _config(cpu_threads="2").validate()
    assert _config(cpu_threads=3).validate().cpu_threads == 3


def test_cli_flag_maps_to_config() -> None:
    args = build_parser().parse_args(["--cpu-threads", "3"])
    assert config_from_args(args).cpu_threads == 3
    assert config_from_args(build_parser().parse_args([])).cpu_threads is None


@pytest.mark.parametrize("threads", [None, 1])
def test_spawned_core_steps_with_the_threads_it_reports(threads: int | None) -> None:
    client = EngineClient.spawn(_config(cpu_threads=threads))
    try:
        expected = default_core_threads() if threads is None else threads
        assert client.cpu_threads == expected
        assert client.config.cpu_threads == expected  # what the telemetry hello reports
    finally:
        client.shutdown()


def test_step_tracer_records_each_step_and_gc() -> None:
    out = io.StringIO()
    out.close = lambda: None  # type: ignore[method-assign] - read it after close()
    tracer = StepTracer(out)
    try:
        tracer.begin()
        gc.collect()
        tracer.end(7, send_ns=5)
        tracer.end(8)  # no begin: nothing written
    finally:
        tracer.close()
    (rec,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert rec["step"] == 7 and rec["send_ns"] == 5
    assert rec["gc_count"] >= 1 and rec["gc_ns"] > 0
    for key in ("wall_ns", "cpu_ns", "runq_wait_ns", "nivcsw"):
        assert rec[key] >= 0
    assert tracer._on_gc not in gc.callbacks  # noqa: SLF001


def test_core_writes_a_step_trace_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))  # the spawned core inherits it
    client = EngineClient.spawn(_config())
    try:

        async def run() -> int:
            _, queue = client.submit(
                [1, 2, 3, 4], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
            )
            n = 0
            while True:
                item = await asyncio.wait_for(queue.get(), 30)
                if getattr(item, "finished", False):
                    return n + len(item.new_token_ids)
                n += len(getattr(item, "new_token_ids", []))

        assert asyncio.run(run()) == 5
    finally:
        client.shutdown()
    records = read_trace(path)
    assert [r["step"] for r in records] == list(range(5))  # a prefill that samples, 4 decodes
    assert [r["prefill_tokens"] for r in records] == [4, 0, 0, 0, 0]
    assert [r["decode_tokens"] for r in records] == [0, 1, 1, 1, 1]


def test_freeze_startup_objects_leaves_nothing_to_collect() -> None:
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        assert gc.get_count()[0] < 700
    finally:
        gc.unfreeze()
