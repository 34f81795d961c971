"""The server-side wiring of the publisher with a real (tiny, in-thread) engine core and the fake
collector: hello fields, events as the engine emits them, the control relay through the
engine's own scheduler-change path, and the /metrics counters."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.process.client import EngineClient
from engine.server.publishing import start_server_publisher
from tests.engine.telemetry.test_telemetry_publisher import WAIT_S, FakeCollector, wait_until


def run_requests(client: EngineClient, n: int, max_tokens: int = 4) -> None:
    async def one(i: int) -> None:
        _, queue = client.submit(
            [1 + i, 2, 3, 4], SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
        while True:
            item = await asyncio.wait_for(queue.get(), WAIT_S)
            assert not isinstance(item, Exception), item
            if getattr(item, "finished", False):
                return

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(main())


@pytest.fixture(scope="module")
def client() -> Iterator[EngineClient]:
    c = EngineClient.in_thread(
        EngineConfig(model="tiny", device="cpu", token_budget=64, max_token_budget=512)
    )
    yield c
    c.shutdown()


def test_hello_control_relay_and_metrics(client: EngineClient) -> None:
    collector = FakeCollector().start()
    registry = CollectorRegistry()
    pub = start_server_publisher(
        client, collector.url, engine_id="eng-h", model_name="tiny", registry=registry,
        linger_s=0.01, metrics_url="http://127.0.0.1:8000/metrics",
    )  # fmt: skip
    try:
        wait_until(lambda: pub.connected, "connected")
        hello = collector.hellos[0]
        assert (hello["engine_id"], hello["model"], hello["token_budget"]) == ("eng-h", "tiny", 64)
        assert hello["max_token_budget"] == 512 and hello["block_size"] == 16
        assert hello["metrics_url"] == "http://127.0.0.1:8000/metrics"
        assert hello["kv_blocks_total"] == client.stats().kv_blocks_total > 0
        assert hello["config"]["model"] == "tiny"
        assert hello["clock"] == client.clock_anchor.to_dict()  # the core's own anchor
        json.dumps(hello)  # plain JSON all through

        collector.send({"type": "control", "id": "c1", "set": {"token_budget": 32}})
        ok = collector.wait_reply("c1")
        assert ok["ok"] is True and ok["old"] == {"token_budget": 64}
        assert ok["new"] == {"token_budget": 32} and isinstance(ok["applied_at_step"], int)
        for cid, value in (("c2", 0), ("c3", 10**9), ("c4", "abc")):
            collector.send({"type": "control", "id": cid, "set": {"token_budget": value}})
            bad = collector.wait_reply(cid)
            assert bad["ok"] is False and "token_budget" in bad["error"], bad
        collector.send({"type": "control", "id": "c5", "set": {"policy": "sideways"}})
        assert collector.wait_reply("c5")["ok"] is False
        run_requests(client, 3)  # the accepted change reaches listeners before its step
        assert client.token_budget == 32

        assert pub.wait_acked(timeout=WAIT_S)
        controls = [e for e in collector.stored.values() if e["type"] == "control"]
        got = [(e["request_id"], e["new_value"], e["accepted"], e["source"]) for e in controls]
        # refusals are recorded at once; the accepted change right before the step it applies at
        assert sorted(got, key=lambda g: str(g[0])) == [
            ("c1", 32, True, "collector"),
            ("c2", 0, False, "collector"),
            ("c3", 10**9, False, "collector"),
            ("c4", "abc", False, "collector"),
            ("c5", "sideways", False, "collector"),
        ]
        (c1,) = [e for e in controls if e["request_id"] == "c1"]
        assert c1["applied_at_step"] == ok["applied_at_step"]
        steps = sorted(e["step"] for e in collector.stored.values() if e["type"] == "step")
        assert steps == list(range(client.stats().step))  # every step the engine counted, once
        finished = [e for e in collector.stored.values() if e.get("kind") == "finished"]
        assert len(finished) == 3 and all(e["num_output_tokens"] == 4 for e in finished)
        by_step = {e["step"]: e for e in collector.stored.values() if e["type"] == "step"}
        step_of_c1 = by_step[ok["applied_at_step"]]
        assert step_of_c1["token_budget"] == 32 and step_of_c1["seq"] > c1["seq"]

        text = generate_latest(registry).decode()
        assert 'chunkscope_telemetry_connected{engine_id="eng-h",model_name="tiny"} 1.0' in text
        assert "chunkscope_telemetry_events_dropped_total" in text
        assert "chunkscope_telemetry_acked_seq" in text
    finally:
        pub.close(timeout=WAIT_S)
        collector.stop()
    assert collector.stored[max(collector.stored)]["type"] == "goodbye"


def test_bad_collector_url_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.server.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--collector-url", "http://127.0.0.1:8765"])
    assert info.value.code == 2
    assert "ws://HOST:PORT" in capsys.readouterr().err


def test_metrics_address_names_a_reachable_host() -> None:
    import socket

    from engine.server.cli import metrics_address

    assert metrics_address("127.0.0.1", 8000) == "http://127.0.0.1:8000/metrics"
    assert metrics_address("::1", 9) == "http://[::1]:9/metrics"
    assert metrics_address("0.0.0.0", 9) == f"http://{socket.gethostname()}:9/metrics"
