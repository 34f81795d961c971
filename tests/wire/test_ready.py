"""The ready lines: what servers print is what launchers parse, and the watcher finds it."""

from __future__ import annotations

import io
import time

from wire.ready import (
    COLLECTOR_READY,
    ENGINE_READY,
    ReadyWatch,
    collector_ready_line,
    engine_ready_line,
    ready_url,
)


def test_printed_lines_parse_back() -> None:
    assert ready_url(engine_ready_line("127.0.0.1", 8123), ENGINE_READY) == (
        "http://127.0.0.1:8123"
    )
    line = collector_ready_line("ws://127.0.0.1:8765")
    assert ready_url(line, COLLECTOR_READY) == "ws://127.0.0.1:8765"
    assert ready_url(line, ENGINE_READY) is None


def test_watch_finds_the_first_ready_line_and_keeps_reading() -> None:
    text = "starting\n" + collector_ready_line("ws://127.0.0.1:1") + "\n"
    text += collector_ready_line("ws://127.0.0.1:2") + "\nmore\n"
    watch = ReadyWatch(io.StringIO(text), COLLECTOR_READY)
    assert watch.wait(5) == "ws://127.0.0.1:1"
    for _ in range(500):  # the pump goes on reading after the ready line
        if watch.lines[-1:] == ["more"]:
            break
        time.sleep(0.01)
    assert watch.lines[0] == "starting" and watch.lines[-1] == "more"


def test_watch_gives_up_when_the_child_ends_without_it() -> None:
    watch = ReadyWatch(io.StringIO("Traceback\nboom\n"), ENGINE_READY, keep=1)
    assert watch.wait(5) is None
    assert watch.tail(5).endswith("boom")
