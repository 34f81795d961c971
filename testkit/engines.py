"""Helpers for tests and benchmarks of anything that talks to the collector (no torch).

- ``SyntheticEngine``: a seeded stand-in for an engine's event stream (contract dicts, causal
  order, realistic chunk layouts), with the exact token times it produced kept as ground truth.
- ``FakeEngineClient``: a websockets client that speaks the ingest side of the contract (hello,
  event frames, acks, answering controls like the engine does).

The collector to talk to is ``testkit.collector``'s; a PostgreSQL server, ``testkit.postgres``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wire.control import refusal
from wire.events import SCHEMA_VERSION, ChunkRecord, ControlEvent, RequestEvent, StepEvent

# ---- synthetic engine -------------------------------------------------------------------------


@dataclass
class _Req:
    request_id: str
    traffic_class: str
    prompt: int
    output: int
    arrival_ns: int
    computed: int = 0
    produced: int = 0
    scheduled: bool = False


@dataclass
class SyntheticEngine:
    """Generates one run's events as the contract dicts, seq included.

    Each step: arrivals until ``concurrency`` requests are in the system, one decode token for
    every request past its prompt, then prompt chunks (oldest first) filling the rest of
    ``token_budget``; a chunk that completes a prompt produces the first token. A request
    finishes after ``output`` tokens. ``steps(n)`` returns the events of the next n steps in
    causal order (arrived / first_scheduled / control, step, first_token / finished).
    """

    engine_id: str = "engine-synthetic"
    run_id: str = "run-synthetic"
    seed: int = 0
    token_budget: int = 512
    max_token_budget: int = 16384
    policy: str = "chunked"
    long_prefill_token_threshold: int = 0
    concurrency: int = 16
    prompt_tokens: tuple[int, int] = (16, 400)
    output_tokens: tuple[int, int] = (4, 64)
    classes: tuple[str, ...] = ("chat", "rag", "vlm")
    step_ns: int = 20_000_000
    mono_ns: int = 1_000_000_000_000
    wall_ns: int | None = None
    kv_blocks_total: int = 4096
    # The hello's run_secret: "" derives one from the ids (so a test's second SyntheticEngine of
    # the same run is the same engine); None sends none (an engine from before run secrets).
    run_secret: str | None = ""
    seq: int = 0
    step: int = 0
    truth: dict[str, list[int]] = field(default_factory=dict)  # request_id -> token end_ns
    _rng: random.Random = field(init=False, repr=False)
    _reqs: list[_Req] = field(default_factory=list, repr=False)
    _next_id: int = 0
    _pending: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        if self.run_secret == "":
            ids = f"{self.engine_id}/{self.run_id}".encode()
            self.run_secret = "synthetic-" + hashlib.sha256(ids).hexdigest()[:32]
        if self.wall_ns is None:
            self.wall_ns = time.time_ns()
        self._clock = (self.wall_ns, self.mono_ns)

    def hello(self, token: str | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "type": "hello",
            "engine_id": self.engine_id,
            "run_id": self.run_id,
            "model": "synthetic",
            "host": "localhost",
            "pid": os.getpid(),
            "policy": self.policy,
            "token_budget": self.token_budget,
            "max_token_budget": self.max_token_budget,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "kv_blocks_total": self.kv_blocks_total,
            "block_size": 16,
            "config": {"preset": "synthetic", "seed": self.seed},
            "clock": {"wall_ns": self._clock[0], "mono_ns": self._clock[1]},
        }
        if token is not None:
            d["token"] = token
        if self.run_secret is not None:
            d["run_secret"] = self.run_secret
        return d

    def wall(self, t_ns: int) -> float:
        return (self._clock[0] + t_ns - self._clock[1]) / 1e9

    def _event(self, d: dict[str, Any]) -> dict[str, Any]:
        self.seq += 1
        d["seq"] = self.seq
        return d

    def _request_event(self, kind: str, r: _Req, t_ns: int, step: int | None) -> dict[str, Any]:
        return self._event(
            RequestEvent(
                kind=kind,
                request_id=r.request_id,
                time_ns=t_ns,
                traffic_class=r.traffic_class,
                num_prompt_tokens=r.prompt,
                num_image_tokens=r.prompt // 2 if r.traffic_class == "vlm" else 0,
                num_output_tokens=r.produced,
                num_cached_tokens=0,
                finish_reason="length" if kind == "finished" else None,
                step=step,
            ).to_dict()
        )

    def control(
        self,
        key: str,
        new_value: Any,
        *,
        accepted: bool = True,
        reason: str | None = None,
        source: str = "api",
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """Queue a control event (applied at the next step when accepted); returns it."""
        old = getattr(self, key)
        if accepted:
            setattr(self, key, new_value)
        ev = self._event(
            ControlEvent(
                key=key,
                old_value=old,
                new_value=new_value,
                accepted=accepted,
                time_ns=self.mono_ns,
                source=source,
                applied_at_step=self.step if accepted else None,
                reason=reason,
                request_id=request_id,
            ).to_dict()
        )
        self._pending.append(ev)
        return ev

    def gap(self, first: int, last: int, reason: str = "spill limit reached") -> dict[str, Any]:
        """Declare seqs first..last lost (they must not have been handed out) and skip them."""
        assert first == self.seq + 1 and last >= first
        self.seq = last
        ev = self._event(
            {
                "type": "gap",
                "first_seq_lost": first,
                "last_seq_lost": last,
                "num_events_lost": last - first + 1,
                "reason": reason,
                "time_ns": self.mono_ns,
            }
        )
        self._pending.append(ev)
        return ev

    def goodbye(self) -> dict[str, Any]:
        return self._event({"type": "goodbye", "time_ns": self.mono_ns})

    def steps(self, n: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for _ in range(n):
            out.extend(self._one_step())
        return out

    def _one_step(self) -> list[dict[str, Any]]:
        rng = self._rng
        out, self._pending = self._pending, []
        start = self.mono_ns
        end = start + self.step_ns + rng.randrange(0, self.step_ns // 4 + 1)
        while len(self._reqs) < self.concurrency:
            r = _Req(
                request_id=f"req-{self.seed}-{self._next_id}",
                traffic_class=self.classes[self._next_id % len(self.classes)],
                prompt=rng.randint(*self.prompt_tokens),
                output=rng.randint(*self.output_tokens),
                arrival_ns=start - rng.randrange(0, self.step_ns),
            )
            self._next_id += 1
            self._reqs.append(r)
            self.truth[r.request_id] = []
            out.append(self._request_event("arrived", r, r.arrival_ns, None))
        budget = self.token_budget
        chunks: list[dict[str, Any]] = []
        decode = prefill = 0
        for r in self._reqs:
            if r.computed >= r.prompt and budget > 0:
                chunks.append(
                    {
                        "request_id": r.request_id,
                        "kind": "decode",
                        "start": r.prompt + r.produced - 1,
                        "num_tokens": 1,
                        "produced_token": True,
                    }
                )
                budget -= 1
                decode += 1
        for r in self._reqs:
            if r.computed < r.prompt and budget > 0:
                if self.policy == "unchunked" and r.prompt - r.computed > budget:
                    continue
                n = min(budget, r.prompt - r.computed)
                cap = self.long_prefill_token_threshold
                capped = 0 < cap < n and self.policy == "chunked"
                n = cap if capped else n
                if not r.scheduled:
                    r.scheduled = True
                    out.append(self._request_event("first_scheduled", r, start, self.step))
                chunks.append(
                    {
                        "request_id": r.request_id,
                        "kind": "prefill",
                        "start": r.computed,
                        "num_tokens": n,
                        "produced_token": r.computed + n == r.prompt,
                        "capped": capped,
                    }
                )
                r.computed += n
                budget -= n
                prefill += n
        num_running = sum(1 for r in self._reqs if r.scheduled)
        out.append(
            self._event(
                StepEvent(
                    step=self.step,
                    start_ns=start,
                    end_ns=end,
                    forward_ns=(end - start) * 4 // 5,
                    token_budget=self.token_budget,
                    policy=self.policy,
                    long_prefill_token_threshold=self.long_prefill_token_threshold,
                    num_decode_tokens=decode,
                    num_prefill_tokens=prefill,
                    num_scheduled_tokens=decode + prefill,
                    num_running=num_running,
                    num_waiting=len(self._reqs) - num_running,
                    kv_blocks_used=min(self.kv_blocks_total, num_running * 8),
                    kv_blocks_total=self.kv_blocks_total,
                    num_preemptions=0,
                    chunks=[ChunkRecord(**c) for c in chunks],
                ).to_dict()
            )
        )
        done: list[_Req] = []
        by_id = {r.request_id: r for r in self._reqs}
        for c in chunks:
            if c["produced_token"]:
                r = by_id[c["request_id"]]
                r.produced += 1
                self.truth[r.request_id].append(end)
                if r.produced == 1:
                    out.append(self._request_event("first_token", r, end, self.step))
                if r.produced >= r.output:
                    done.append(r)
        for r in done:
            out.append(self._request_event("finished", r, end, self.step))
            self._reqs.remove(r)
        self.step += 1
        self.mono_ns = end + 100_000
        return out


def frames(
    engine: SyntheticEngine, events: list[dict[str, Any]], per_frame: int = 64
) -> list[dict[str, Any]]:
    """``events`` cut into ``events`` frames of at most ``per_frame`` events."""
    return [
        {
            "schema": SCHEMA_VERSION,
            "type": "events",
            "engine_id": engine.engine_id,
            "run_id": engine.run_id,
            "events": events[i : i + per_frame],
        }
        for i in range(0, len(events), per_frame)
    ]


# ---- a fake engine on the wire ----------------------------------------------------------------


class FakeEngineClient:
    """The engine side of ``/ingest`` over a websockets (sync) client.

    ``connect()`` sends the hello and returns the collector's first ack; ``send()`` sends one
    frame; a reader thread records acks (``acked``), errors (``errors``) and answers controls
    through ``on_control`` (default: apply them to the synthetic engine like the engine's
    ``PUT /v1/scheduler`` would, queueing the engine's own control event).
    """

    def __init__(
        self,
        url: str,
        engine: SyntheticEngine,
        *,
        token: str | None = None,
        on_control: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.engine = engine
        self.token = token
        self.on_control = on_control or self.apply_control
        self.acked = 0
        self.errors: list[dict[str, Any]] = []
        self.controls: list[dict[str, Any]] = []
        self.close_code: int | None = None
        self._cond = threading.Condition()
        self._ws: Any = None
        self._reader: threading.Thread | None = None

    def connect(self, timeout: float = 10.0) -> int:
        from websockets.sync.client import connect

        self._ws = connect(self.url + "/ingest", open_timeout=timeout, max_size=None, proxy=None)
        self._ws.__enter__()  # closed by close(); a context manager in websockets' terms
        self._ws.send(json.dumps(self.engine.hello(self.token)))
        first = json.loads(self._ws.recv(timeout=timeout))
        if first.get("type") != "ack":
            raise RuntimeError(f"expected an ack after the hello, got {first!r}")
        self.acked = int(first["seq"])
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self.acked

    def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            for raw in self._ws:
                msg = json.loads(raw)
                kind = msg.get("type")
                if kind == "ack":
                    with self._cond:
                        self.acked = max(self.acked, int(msg["seq"]))
                        self._cond.notify_all()
                elif kind == "control":
                    self.controls.append(msg)
                    reply = self.on_control(msg)
                    if reply is not None:
                        self._ws.send(json.dumps(reply))
                else:
                    with self._cond:
                        self.errors.append(msg)
                        self._cond.notify_all()
        except ConnectionClosed:
            pass
        finally:
            with self._cond:
                self.close_code = self._ws.close_code
                self._cond.notify_all()

    def apply_control(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer a relayed control as the engine would (checks, then both keys applied)."""
        eng = self.engine
        cid = msg.get("id")
        new = dict(msg.get("set") or {})
        for key, value in new.items():
            why = refusal(key, value, max_token_budget=eng.max_token_budget)
            if why is not None:
                eng.control(
                    key, value, accepted=False, reason=why, source="collector", request_id=cid
                )
                return {"type": "control_ack", "id": cid, "ok": False, "error": why}
        old = {key: getattr(eng, key) for key in new}
        for key, value in new.items():
            eng.control(key, value, source="collector", request_id=cid)
        return {
            "type": "control_ack",
            "id": cid,
            "ok": True,
            "applied_at_step": eng.step,
            "old": old,
            "new": new,
        }

    def send(self, frame: dict[str, Any] | str) -> None:
        self._ws.send(frame if isinstance(frame, str) else json.dumps(frame))

    def send_events(self, events: list[dict[str, Any]], per_frame: int = 64) -> None:
        for frame in frames(self.engine, events, per_frame):
            self.send(frame)

    def wait_ack(self, seq: int, timeout: float = 10.0) -> int:
        """Wait until the collector has acked ``seq`` (or the connection closed)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.acked < seq and self.close_code is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no ack for seq {seq} within {timeout} s (acked {self.acked})"
                    )
                self._cond.wait(left)
            return self.acked

    def wait_error(self, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.errors and self.close_code is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no error reply within {timeout} s")
                self._cond.wait(left)
            if not self.errors:
                raise RuntimeError(f"connection closed ({self.close_code}) without an error")
            return self.errors.pop(0)

    def wait_closed(self, timeout: float = 10.0) -> int | None:
        if self._reader is not None:
            self._reader.join(timeout)
        return self.close_code

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
        if self._reader is not None:
            self._reader.join(10)
