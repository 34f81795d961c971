"""A synthetic but causally correct event stream, sent to a real collector as contract frames
(docs/telemetry.md), to seed stores for the dashboard tests: a scripted stall story (chat streams,
RAG prefills, one budget change), where ``testkit.engines.SyntheticEngine`` is seeded random
traffic with its true token times kept for the storage tests.

The simulated engine: chat requests decode one token per step; RAG prompts are prefilled in
chunks of whatever budget is left; a step lasts 4 ms plus 1 ms per 8 prefill tokens, so a
2,000-token prefill step stalls every chat stream for about 250 ms. At ``change_at_step`` the
budget drops (a ``control`` event, applied at that step).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import connect

from wire.events import SCHEMA_VERSION, ChunkRecord, ControlEvent, RequestEvent, StepEvent


@dataclass
class _Req:
    rid: str
    cls: str
    prompt: int
    output: int
    arrive_step: int
    done_prompt: int = 0
    produced: int = 0
    scheduled: bool = False


@dataclass
class SynthRun:
    engine_id: str = "engine-test"
    run_id: str = "run-test-1"
    budget: int = 2048
    new_budget: int = 128
    max_budget: int = 8192
    change_at_step: int | None = 120
    num_steps: int = 240
    wall_ns: int = field(default_factory=time.time_ns)
    mono_ns: int = 10**12

    def hello(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION, "type": "hello", "engine_id": self.engine_id,
            "run_id": self.run_id,
            "model": "synthetic", "host": "localhost", "pid": 1, "policy": "chunked",
            "token_budget": self.budget, "max_token_budget": self.max_budget,
            "kv_blocks_total": 1024, "block_size": 16, "config": {"model": "synthetic"},
            "clock": {"wall_ns": self.wall_ns, "mono_ns": self.mono_ns},
        }  # fmt: skip

    def events(self) -> list[dict[str, Any]]:
        """Every event of the run in causal order, with seq 1, 2, 3..."""
        reqs = [_Req(f"chat-{i}", "chat", 20 + i, 10_000, arrive_step=0) for i in range(4)]
        reqs += [
            _Req(f"rag-{i}", "rag", 2000, 4, arrive_step=s)
            for i, s in enumerate((10, 60, 130, 180))
        ]
        reqs += [_Req(f"short-{i}", "chat", 8, 30, arrive_step=20 + 40 * i) for i in range(5)]
        out: list[Any] = []
        t = self.mono_ns
        budget = self.budget
        for step in range(self.num_steps):
            if step == self.change_at_step:
                out.append(
                    ControlEvent(
                        key="token_budget", old_value=budget, new_value=self.new_budget,
                        accepted=True, time_ns=t, source="collector", applied_at_step=step,
                        request_id="seed-c1",
                    )
                )  # fmt: skip
                budget = self.new_budget
            for r in reqs:
                if r.arrive_step == step:
                    out.append(self._req("arrived", r, t, step))
            live = [r for r in reqs if r.arrive_step <= step and r.produced < r.output]
            chunks: list[ChunkRecord] = []
            left = budget
            after: list[RequestEvent] = []
            for r in live:  # decodes first
                if r.done_prompt == r.prompt and left > 0:
                    chunks.append(ChunkRecord(r.rid, "decode", r.prompt + r.produced - 1, 1, True))
                    left -= 1
            prefill = 0
            for r in live:
                if r.done_prompt < r.prompt and left > 0:
                    n = min(left, r.prompt - r.done_prompt)
                    done = r.done_prompt + n == r.prompt
                    chunks.append(ChunkRecord(r.rid, "prefill", r.done_prompt, n, done))
                    if not r.scheduled:
                        r.scheduled = True
                        out.append(self._req("first_scheduled", r, t, step))
                    r.done_prompt += n
                    left -= n
                    prefill += n
            decode = sum(1 for c in chunks if c.kind == "decode")
            end = t + 4_000_000 + prefill * 1_000_000 // 8
            for c in chunks:
                if c.produced_token:
                    r = next(x for x in reqs if x.rid == c.request_id)
                    r.produced += 1
                    if r.produced == 1:
                        after.append(self._req("first_token", r, end, step))
                    if r.produced == r.output:
                        after.append(self._req("finished", r, end, step, reason="length"))
            running = sum(1 for r in live if r.scheduled and r.produced < r.output)
            out.append(
                StepEvent(
                    step=step, start_ns=t, end_ns=end, token_budget=budget, policy="chunked",
                    num_decode_tokens=decode, num_prefill_tokens=prefill,
                    num_scheduled_tokens=decode + prefill, num_running=running,
                    num_waiting=sum(1 for r in live if not r.scheduled),
                    kv_blocks_used=sum((r.done_prompt + r.produced) // 16 + 1 for r in live),
                    kv_blocks_total=1024, num_preemptions=0, chunks=chunks,
                    forward_ns=(end - t) * 9 // 10,
                )
            )  # fmt: skip
            out.extend(after)
            t = end + 200_000
        dicts = [e.to_dict() for e in out]
        for seq, d in enumerate(dicts, start=1):
            d["seq"] = seq
        return dicts

    def _req(
        self, kind: str, r: _Req, t: int, step: int, reason: str | None = None
    ) -> RequestEvent:
        return RequestEvent(
            kind=kind, request_id=r.rid, time_ns=t, traffic_class=r.cls,
            num_prompt_tokens=r.prompt, num_output_tokens=r.produced, finish_reason=reason,
            step=step,
        )  # fmt: skip

    def frames(self, batch: int = 200) -> list[dict[str, Any]]:
        evs = self.events()
        return [
            {
                "schema": SCHEMA_VERSION,
                "type": "events",
                "engine_id": self.engine_id,
                "run_id": self.run_id,
                "events": evs[i : i + batch],
            }  # fmt: skip
            for i in range(0, len(evs), batch)
        ]


async def _send(collector_url: str, run: SynthRun, goodbye: bool, timeout: float) -> int:
    url = collector_url.rstrip("/") + "/ingest"
    frames = run.frames()
    last = frames[-1]["events"][-1]["seq"] if frames else 0
    async with asyncio.timeout(timeout):
        async with connect(url, proxy=None) as ws:
            await ws.send(json.dumps(run.hello()))
            acked = 0
            for f in frames:
                await ws.send(json.dumps(f))
            while acked < last:
                msg = json.loads(await ws.recv())
                if msg.get("type") == "ack":
                    acked = max(acked, int(msg["seq"]))
                elif msg.get("type") == "error":
                    raise RuntimeError(f"collector refused a frame: {msg}")
            if goodbye:
                bye = {"type": "goodbye", "seq": last + 1}
                await ws.send(
                    json.dumps(
                        {
                            "schema": SCHEMA_VERSION,
                            "type": "events",
                            "engine_id": run.engine_id,
                            "run_id": run.run_id,
                            "events": [bye],
                        }  # fmt: skip
                    )
                )
                while acked < last + 1:
                    msg = json.loads(await ws.recv())
                    if msg.get("type") == "ack":
                        acked = max(acked, int(msg["seq"]))
    return acked


def send_run(
    collector_url: str, run: SynthRun, *, goodbye: bool = True, timeout: float = 60
) -> int:
    """Send ``run`` to the collector, wait until every event is acknowledged; the highest seq."""
    return asyncio.run(_send(collector_url, run, goodbye, timeout))
