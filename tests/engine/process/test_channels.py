"""The engine core's command channel read ahead (``engine.process.channels.read_ahead``): what is
sent while the reader is busy is received at once, in order, and the end of the pipe (or an
unreadable message) ends it. Bounded waits only; no timing is asserted."""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from typing import Any

import pytest

from engine.process.channels import QueueChannel, read_ahead
from engine.process.core import EngineCore

BIG = 3 * 1024 * 1024  # an image request's pixels: far more than a pipe holds (64 KiB)


def _pipe() -> tuple[Any, Any]:
    recv_end, send_end = multiprocessing.get_context("spawn").Pipe(duplex=False)
    return recv_end, send_end


def test_messages_sent_while_the_reader_is_busy_are_all_there_in_order() -> None:
    recv_end, send_end = _pipe()
    inbox = read_ahead(recv_end)
    payloads = [bytes([i]) * BIG for i in range(3)]
    sender = threading.Thread(target=lambda: [send_end.send(("add", p)) for p in payloads])
    sender.start()
    # nobody reads inbox meanwhile: read straight from the pipe, the sender would block on the
    # first message until the reader came back
    sender.join(timeout=30)
    assert not sender.is_alive()
    got = []
    for _ in payloads:  # the last bytes may still be on their way from the pipe's buffer
        assert inbox.poll(10)
        got.append(inbox.recv())
    assert [p for _, p in got] == payloads and not inbox.poll(0)
    send_end.close()
    recv_end.close()


def test_end_of_the_pipe_is_eof_after_the_last_message() -> None:
    recv_end, send_end = _pipe()
    inbox = read_ahead(recv_end)
    send_end.send(("shutdown",))
    send_end.close()
    assert inbox.poll(10) and inbox.recv() == ("shutdown",)
    assert inbox.poll(10)  # the end is there to be read
    with pytest.raises(EOFError):
        inbox.recv()


def test_an_unreadable_message_ends_the_channel_saying_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recv_end, send_end = _pipe()
    inbox = read_ahead(recv_end, name="test-rx")
    with caplog.at_level(logging.ERROR):
        send_end.send_bytes(b"not a pickle")
        assert inbox.poll(10)
        with pytest.raises(EOFError):
            inbox.recv()
    assert "test-rx: could not read a message" in caplog.text
    send_end.close()


class _SlowEngine:
    """Just enough of ``LLMEngine`` for the core loop: each step takes ``step_s`` and records
    the requests added before it."""

    token_budget = 4096
    policy = "chunked"
    long_prefill_token_threshold = 0

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.pending: list[str] = []
        self.steps: list[list[str]] = []
        self.unfinished = 0
        self.first_step_started = threading.Event()

    def add_listener(self, fn: Any) -> None:
        pass

    def add_request(self, prompt: Any, params: Any, **kw: Any) -> None:
        self.pending.append(kw["request_id"])
        self.unfinished += 1

    def abort_request(self, request_id: str, reason: str | None = None) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return self.unfinished > 0

    def step(self) -> Any:
        self.steps.append(self.pending)
        self.pending = []
        self.first_step_started.set()
        time.sleep(self.step_s)
        if len(self.steps) >= 2:
            self.unfinished = 0
        return type("Result", (), {"outputs": [], "event": None})()

    def stats(self) -> Any:
        return None


def test_requests_sent_during_a_step_all_enter_the_next_one() -> None:
    recv_end, send_end = _pipe()
    engine = _SlowEngine(step_s=0.5)
    core = EngineCore(engine, read_ahead(recv_end), QueueChannel())
    loop = threading.Thread(target=core.run)
    loop.start()

    def add(rid: str) -> None:
        send_end.send(("add", rid, [1, 2, 3], None, "vlm", [b"\0" * BIG], 0))

    add("first")
    assert engine.first_step_started.wait(30)
    for i in range(4):  # a burst of image requests while the first step runs
        add(f"img-{i}")
    deadline = time.monotonic() + 30
    while len(engine.steps) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    send_end.send(("shutdown",))
    loop.join(timeout=30)
    assert not loop.is_alive()
    assert engine.steps[0] == ["first"]
    assert engine.steps[1] == [f"img-{i}" for i in range(4)]
    send_end.close()
    recv_end.close()


def test_the_core_process_reads_its_commands_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child process's entry wraps its command pipe in ``read_ahead`` (run here in this
    process, on the ``tiny`` preset, with a shutdown already waiting)."""
    import gc
    import signal

    from engine.core.config import EngineConfig
    from engine.process import core

    names: list[str] = []
    real = core.read_ahead

    def spy(channel: Any, name: str = "") -> QueueChannel:
        names.append(name)
        return real(channel, name)

    monkeypatch.setattr(core, "read_ahead", spy)
    recv_end, send_end = _pipe()
    results = QueueChannel()
    send_end.send(("shutdown",))
    sigint = signal.getsignal(signal.SIGINT)
    try:
        config = EngineConfig(model="tiny", device="cpu", max_model_len=256)
        core.run_core_process(config, recv_end, results, logging.WARNING)
    finally:
        signal.signal(signal.SIGINT, sigint)  # the core ignores Ctrl-C; this process does not
        gc.unfreeze()
    assert names == ["chunkscope-core-rx"]
    assert results.recv()[0] == "ready"
    send_end.close()
